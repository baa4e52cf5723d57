// The Python module hvdlite._core: one binding per operation, nothing else. The only file
// that includes torch/extension.h. Every call that can wait or take an engine lock releases
// the GIL (Note [GIL and tensor references] in tensor_queue.h). Errors travel as StatusError
// and become the matching HvdliteError subclass (hvdlite/exceptions.py) in the translator.
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <map>
#include <optional>

#include "autotune.h"
#include "backend_c10d.h"
#include "config.h"
#include "controller.h"
#include "engine.h"
#include "fusion.h"
#include "message.h"

namespace py = pybind11;

namespace hvdlite {
namespace {

struct StatusError : std::exception {
  explicit StatusError(Status s) : status(std::move(s)) {}
  const char* what() const noexcept override { return status.message().c_str(); }
  Status status;
};

void Check(const Status& status) {
  if (!status.ok()) throw StatusError(status);
}

Config ConfigFromEnvironment() {
  Config config;
  Check(Config::FromEnvironment(&config));
  return config;
}

std::unique_ptr<Engine> MakeEngine(c10::intrusive_ptr<c10d::Backend> control,
                                   std::vector<c10::intrusive_ptr<c10d::Backend>> cpu,
                                   std::optional<c10::intrusive_ptr<c10d::Backend>> cuda, int rank,
                                   int size) {
  Config config = ConfigFromEnvironment();
  std::unique_ptr<CollectiveBackend> cuda_backend;
  if (cuda && *cuda) cuda_backend = MakeC10dBackend(*cuda);
  if (cpu.empty()) Check(Status(StatusCode::kInternal, "an engine needs at least one CPU process group"));
  std::vector<std::unique_ptr<CollectiveBackend>> cpu_backends;
  for (auto& backend : cpu) cpu_backends.push_back(MakeC10dBackend(std::move(backend)));
  return std::make_unique<Engine>(config, rank, size, MakeC10dBackend(std::move(control)),
                                  std::move(cpu_backends), std::move(cuda_backend));
}

// One tensor's arguments, as both enqueue bindings receive them.
EnqueueArgs Args(int kind, const at::Tensor& input, const std::optional<at::Tensor>& output,
                 const std::string& name, int op, int root, double prescale, double postscale) {
  if (kind < 0 || kind >= kNumCollectiveKinds || op < 0 || op > kMaxReduceOp) {
    Check(Status(StatusCode::kInternal, "malformed enqueue call"));
  }
  EnqueueArgs a;
  a.name = name;
  a.kind = static_cast<CollectiveKind>(kind);
  a.input = input;
  if (output) a.output = *output;
  a.op = static_cast<ReduceOp>(op);
  a.root = root;
  a.prescale = prescale;
  a.postscale = postscale;
  return a;
}

std::vector<int64_t> Enqueue(Engine& engine, int kind, const std::vector<at::Tensor>& inputs,
                             const std::vector<std::optional<at::Tensor>>& outputs,
                             const std::vector<std::string>& names, int op, int root,
                             double prescale, double postscale, const std::string& group,
                             const std::vector<std::vector<int64_t>>& splits) {
  if (outputs.size() != inputs.size() || names.size() != inputs.size() ||
      (!splits.empty() && splits.size() != inputs.size())) {
    Check(Status(StatusCode::kInternal, "malformed enqueue call"));
  }
  std::vector<EnqueueArgs> args;
  args.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    args.push_back(Args(kind, inputs[i], outputs[i], names[i], op, root, prescale, postscale));
    args.back().group = group;
    if (!splits.empty()) args.back().splits = splits[i];
  }
  std::vector<int64_t> handles;
  Check(engine.Enqueue(std::move(args), &handles));
  return handles;
}

// The common case, one tensor with no group and no splits, without building lists on either
// side of the binding: every async allreduce of a training step comes through here.
int64_t EnqueueOne(Engine& engine, int kind, const at::Tensor& input,
                   const std::optional<at::Tensor>& output, const std::string& name, int op,
                   int root, double prescale, double postscale) {
  std::vector<EnqueueArgs> args;
  args.push_back(Args(kind, input, output, name, op, root, prescale, postscale));
  std::vector<int64_t> handles;
  Check(engine.Enqueue(std::move(args), &handles));
  return handles.front();
}

// ---- Test hooks: the pure logic, reachable from one process --------------------------------

Request RequestFromDict(const py::dict& d) {
  Request r;
  r.name = d["name"].cast<std::string>();
  r.kind = static_cast<CollectiveKind>(d.contains("kind") ? d["kind"].cast<int>() : 0);
  r.dtype = static_cast<int8_t>(d.contains("dtype") ? d["dtype"].cast<int>() : 6);
  r.device_type = static_cast<int8_t>(d.contains("device_type") ? d["device_type"].cast<int>() : 0);
  r.op = static_cast<ReduceOp>(d.contains("op") ? d["op"].cast<int>() : 1);
  r.root = d.contains("root") ? d["root"].cast<int>() : 0;
  r.prescale = d.contains("prescale") ? d["prescale"].cast<double>() : 1.0;
  r.postscale = d.contains("postscale") ? d["postscale"].cast<double>() : 1.0;
  r.shape = d.contains("shape") ? d["shape"].cast<std::vector<int64_t>>() : std::vector<int64_t>{};
  r.group = d.contains("group") ? d["group"].cast<std::string>() : "";
  r.group_size = d.contains("group_size") ? d["group_size"].cast<int>() : 0;
  if (d.contains("splits")) r.splits = d["splits"].cast<std::vector<int64_t>>();
  if (d.contains("payload")) {
    r.inlined = true;
    r.payload = d["payload"].cast<std::string>();
  }
  return r;
}

py::dict ItemToDict(const ReadyItem& item) {
  py::dict d;
  d["name"] = item.request.name;
  d["code"] = static_cast<int>(item.status.code());
  d["message"] = item.status.message();
  d["rank_dim0"] = item.rank_dim0;
  d["rank_splits"] = item.rank_splits;
  d["joined"] = item.joined;
  d["contributors"] = item.contributors;
  d["last_joined"] = item.last_joined;
  d["inlined"] = item.inlined;
  return d;
}

RankMessage MessageFromDict(const py::dict& d) {
  RankMessage m;
  m.flags = d.contains("flags") ? d["flags"].cast<uint32_t>() : 0;
  m.clock_ms = d.contains("clock_ms") ? d["clock_ms"].cast<int64_t>() : 0;
  if (d.contains("tuned")) {
    auto tuned = d["tuned"].cast<std::pair<int64_t, double>>();
    m.tuned = TunedParams{tuned.first, tuned.second};
  }
  if (d.contains("requests")) {
    for (auto r : d["requests"]) m.requests.push_back(RequestFromDict(r.cast<py::dict>()));
  }
  return m;
}

// A Controller driven round by round from Python, as every rank would drive its own.
class ControllerHarness {
 public:
  ControllerHarness(int size, double stall_check, double stall_shutdown, size_t cache_capacity)
      : controller_(size, stall_check, stall_shutdown, cache_capacity) {}
  // Encodes rank `rank`'s message as it would travel (cached requests abbreviated), then
  // decodes it as the receivers would: returns (bytes on the wire, decoded message).
  py::tuple Wire(int rank, const py::dict& message) {
    RankMessage m = MessageFromDict(message);
    std::string wire = EncodeRankMessage(m, [&](const Request& r) { return controller_.CacheLookup(rank, r); });
    RankMessage back;
    Check(DecodeRankMessage(wire.data(), wire.size(), &back, [&](uint32_t id, Request* out) {
      return controller_.CacheResolve(rank, id, out);
    }));
    py::list names;
    for (const Request& r : back.requests) names.append(r.name);
    return py::make_tuple(wire.size(), names);
  }
  py::dict Round(const py::list& messages) {
    std::vector<RankMessage> parsed;
    for (auto m : messages) parsed.push_back(MessageFromDict(m.cast<py::dict>()));
    RoundResult result = controller_.ProcessRound(parsed);
    py::list ready;
    for (const ReadyItem& item : result.ready) ready.append(ItemToDict(item));
    py::dict out;
    out["ready"] = ready;
    out["shutdown"] = result.shutdown;
    out["quiet"] = result.quiet;
    out["all_outstanding"] = result.all_outstanding;
    out["stall_warning"] = result.stall_warning;
    out["pending"] = controller_.pending_count();
    out["cache_entries"] = controller_.cache_entries();
    return out;
  }

 private:
  Controller controller_;
};

py::list Plan(const py::list& requests, int64_t threshold) {
  std::vector<ReadyItem> items;
  for (auto r : requests) {
    ReadyItem item;
    py::dict d = r.cast<py::dict>();
    item.request = RequestFromDict(d);
    if (d.contains("failed") && d["failed"].cast<bool>())
      item.status = Status(StatusCode::kMismatch, "failed");
    items.push_back(std::move(item));
  }
  py::list batches;
  for (const Batch& batch : PlanBatches(std::move(items), threshold)) {
    py::list names;
    for (const ReadyItem& item : batch.items) names.append(item.request.name);
    batches.append(names);
  }
  return batches;
}

py::bytes EncodeMessage(const py::dict& message) {
  return py::bytes(EncodeRankMessage(MessageFromDict(message)));
}

py::dict DecodeMessage(const py::bytes& data) {
  std::string raw = data;
  RankMessage message;
  Check(DecodeRankMessage(raw.data(), raw.size(), &message));
  py::dict out;
  out["flags"] = message.flags;
  out["clock_ms"] = message.clock_ms;
  out["tuned"] = py::make_tuple(message.tuned.fusion_threshold_bytes, message.tuned.cycle_time_ms);
  py::list requests;
  for (const Request& r : message.requests) {
    py::dict d;
    d["name"] = r.name;
    d["kind"] = static_cast<int>(r.kind);
    d["dtype"] = static_cast<int>(r.dtype);
    d["device_type"] = static_cast<int>(r.device_type);
    d["op"] = static_cast<int>(r.op);
    d["root"] = r.root;
    d["prescale"] = r.prescale;
    d["postscale"] = r.postscale;
    d["shape"] = r.shape;
    d["group"] = r.group;
    d["group_size"] = r.group_size;
    d["splits"] = r.splits;
    d["inlined"] = r.inlined;
    d["payload"] = py::bytes(r.payload);
    requests.append(d);
  }
  out["requests"] = requests;
  return out;
}

py::dict ParseConfig(const std::map<std::string, std::string>& env) {
  Config config;
  Check(Config::FromLookup(
      [&](const char* name) -> const char* {
        auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      &config));
  py::dict out;
  out["fusion_threshold_bytes"] = config.fusion_threshold_bytes;
  out["cycle_time_ms"] = config.cycle_time_ms;
  out["idle_heartbeat_ms"] = config.idle_heartbeat_ms;
  out["stall_check_seconds"] = config.stall_check_seconds;
  out["stall_shutdown_seconds"] = config.stall_shutdown_seconds;
  out["log_level"] = static_cast<int>(config.log_level);
  out["cache_capacity"] = config.cache_capacity;
  out["inline_bytes"] = config.inline_bytes;
  out["cpu_channels"] = config.cpu_channels;
  out["gather_bytes"] = config.gather_bytes;
  out["gather_max_ms"] = config.gather_max_ms;
  out["autotune"] = config.autotune;
  out["autotune_sample_seconds"] = config.autotune_sample_seconds;
  out["autotune_log_path"] = config.autotune_log_path;
  return out;
}

}  // namespace
}  // namespace hvdlite

PYBIND11_MODULE(_core, m) {
  using namespace hvdlite;
  m.doc() = "hvdlite's native engine (see csrc/engine.h)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object exc = py::module_::import("hvdlite.exceptions")
                           .attr("_from_status")(static_cast<int>(e.status.code()),
                                                 e.status.message());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::class_<Engine>(m, "Engine")
      .def(py::init(&MakeEngine), py::arg("control").none(false), py::arg("cpu"),
           py::arg("cuda"), py::arg("rank"), py::arg("size"))
      .def("enqueue", &Enqueue, py::call_guard<py::gil_scoped_release>())
      .def("enqueue_one", &EnqueueOne, py::call_guard<py::gil_scoped_release>())
      .def("poll",
           [](Engine& engine, int64_t handle) {
             bool done = false;
             Check(engine.Poll(handle, &done));
             return done;
           },
           py::call_guard<py::gil_scoped_release>())
      .def("wait",
           [](Engine& engine, int64_t handle) {
             at::Tensor output;
             std::vector<int64_t> aux;
             Check(engine.Wait(handle, &output, &aux));
             return std::make_pair(output, aux);
           },
           py::call_guard<py::gil_scoped_release>())
      .def("wait_all",
           [](Engine& engine, const std::vector<int64_t>& handles) {
             // One call for a whole group: waits for every handle even after a failure, then
             // reports the first failure.
             std::vector<std::pair<at::Tensor, std::vector<int64_t>>> results(handles.size());
             Status first_error;
             for (size_t i = 0; i < handles.size(); ++i) {
               Status status = engine.Wait(handles[i], &results[i].first, &results[i].second);
               if (!status.ok() && first_error.ok()) first_error = status;
             }
             Check(first_error);
             return results;
           },
           py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &Engine::Shutdown, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("size", &Engine::size)
      .def_property_readonly("fusion_threshold_bytes",
                             [](const Engine& e) { return e.config().fusion_threshold_bytes; })
      .def_property_readonly("cycle_time_ms", [](const Engine& e) { return e.config().cycle_time_ms; });

  py::class_<ControllerHarness>(m, "_ControllerHarness")
      .def(py::init<int, double, double, size_t>(), py::arg("size"),
           py::arg("stall_check_seconds") = 0.0, py::arg("stall_shutdown_seconds") = 0.0,
           py::arg("cache_capacity") = 0)
      .def("round", &ControllerHarness::Round)
      .def("wire", &ControllerHarness::Wire);
  py::class_<Autotuner>(m, "_Autotuner")
      .def(py::init([](int64_t threshold, double cycle_ms, double sample_seconds) {
             return Autotuner(TunedParams{threshold, cycle_ms}, sample_seconds);
           }),
           py::arg("fusion_threshold_bytes"), py::arg("cycle_time_ms"), py::arg("sample_seconds"))
      .def("record", &Autotuner::Record, py::arg("bytes"), py::arg("now_seconds"))
      .def_property_readonly("current",
                             [](const Autotuner& t) {
                               return py::make_tuple(t.current().fusion_threshold_bytes,
                                                     t.current().cycle_time_ms);
                             })
      .def_property_readonly("done", &Autotuner::done)
      .def("summary", &Autotuner::Summary)
      .def("samples", [](const Autotuner& t) {
        py::list out;
        for (const AutotuneSample& s : t.samples()) {
          out.append(py::make_tuple(AutotunePhaseName(s.phase), s.params.fusion_threshold_bytes,
                                    s.params.cycle_time_ms,
                                    s.bytes, s.seconds));
        }
        return out;
      });
  m.def("_plan", &Plan);
  m.def("_encode_message", &EncodeMessage);
  m.def("_decode_message", &DecodeMessage);
  m.def("_parse_config", &ParseConfig);
}
