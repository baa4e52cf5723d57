// The Python module hvdlite._core: one binding per operation, nothing else (the test hooks
// live in test_hooks.cc). The only file that includes torch/extension.h. Every call that can
// wait or take an engine lock releases the GIL (Note [GIL and tensor references] in
// tensor_queue.h). Errors travel as StatusError and become the matching HvdliteError subclass
// (hvdlite/exceptions.py), with the status's fields, in the translator. The C++ enums that
// Python needs (reduce ops, collective kinds, status codes) are exported from here, once.
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>
#include <ATen/EmptyTensor.h>

#include <map>
#include <optional>

#include "backend_c10d.h"
#include "build_id.h"
#include "config.h"
#include "control_link.h"
#include "engine.h"
#include "message.h"
#include "recorder.h"
#include "timeline.h"
#include "status_error.h"
#include "test_hooks.h"
#include "shm_point_to_point.h"
#include "torch_backend.h"

namespace py = pybind11;

namespace hvdlite {
namespace {

Config ConfigFromMap(const std::map<std::string, std::string>& env) {
  Config config;
  Check(Config::FromLookup(
      [&](const char* name) -> const char* {
        auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      &config));
  return config;
}

// `settings`: the HVDLITE_* variables in force for this engine, job-wide ones from rank 0
// (Note [Job-wide settings] in config.h); hvd.init() builds it.
std::shared_ptr<Engine> MakeEngine(std::optional<c10::intrusive_ptr<c10d::Backend>> control,
                                   std::vector<c10::intrusive_ptr<c10d::Backend>> cpu,
                                   std::optional<c10::intrusive_ptr<c10d::Backend>> cuda, int rank,
                                   int size, const std::map<std::string, std::string>& settings,
                                   std::shared_ptr<ShmChannel> shm,
                                   std::optional<c10::intrusive_ptr<c10d::Backend>> cross, const std::string& route,
                                   double control_timeout_s, double data_timeout_s,
                                   std::shared_ptr<ControlLink> link) {
  Config config = ConfigFromMap(settings);
  // Note [Frozen peers] (hvdlite/_runtime/groups.py): the collectives' own timeouts (0: the group's).
  auto millis = [](double seconds) {
    return seconds > 0 ? std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0)) : c10d::kUnsetTimeout;
  };
  std::unique_ptr<CollectiveBackend> cuda_backend;
  if (cuda && *cuda) cuda_backend = MakeC10dBackend(*cuda);
  if (cpu.empty()) Check(Status(StatusCode::kInternal, "an engine needs at least one CPU process group"));
  std::vector<std::unique_ptr<CollectiveBackend>> cpu_backends;
  for (auto& backend : cpu) cpu_backends.push_back(MakeC10dBackend(std::move(backend), millis(data_timeout_s)));
  std::unique_ptr<CollectiveBackend> cross_backend;
  if (cross && *cross) cross_backend = MakeC10dBackend(*cross, millis(data_timeout_s));
  // Note [Transport plan] (hvdlite/_runtime/groups.py): the route was chosen there.
  CpuRouteKind kind;
  if (!ParseCpuRouteKind(route, &kind)) Check(Status(StatusCode::kInternal, "unknown CPU route '" + route + "'"));
  std::shared_ptr<CollectiveBackend> control_backend;
  if (link) {
    control_backend = link;  // Note [Control link]: its partners are connected already
  } else if (!control || !*control) {
    Check(Status(StatusCode::kInternal, "an engine needs a control process group or a control link"));
  } else if (control_backend = MakeC10dBackend(std::move(*control), millis(control_timeout_s));
             shm == nullptr || kind == CpuRouteKind::kHierarchical) {
    // Note [Connections on first use] (hvdlite/_runtime/groups.py): the control plane's
    // partners are connected before the engine starts. The GIL is released: a lazy connection
    // may read the store, which can be a Python object.
    py::gil_scoped_release release;
    ControlChannel(control_backend.get(), nullptr, rank, size, config.control_alltoall_max).Exchange(std::string());
  }
  return std::make_shared<Engine>(config, rank, size, std::move(control_backend),
                                  std::move(cpu_backends), std::move(cuda_backend), std::move(shm),
                                  std::move(cross_backend), kind);
}

// One tensor's arguments, as every enqueueing binding receives them.
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
                             const std::vector<std::vector<int64_t>>& splits,
                             std::optional<at::ScalarType> wire) {
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
    args.back().wire = wire;  // Note [Casting on the wire]
  }
  std::vector<int64_t> handles;
  Check(engine.Enqueue(std::move(args), &handles));
  return handles;
}

// The dtypes the transports carry and reduce (Gloo for CPU tensors, NCCL for CUDA ones): the
// one list, which Python's argument checks read as _core.CARRIED_DTYPES (hvdlite/_runtime/checks.py).
constexpr std::pair<at::ScalarType, const char*> kCarriedDtypes[] = {
    {at::kHalf, "float16"}, {at::kBFloat16, "bfloat16"}, {at::kFloat, "float32"}, {at::kDouble, "float64"},
    {at::kByte, "uint8"},   {at::kChar, "int8"},         {at::kInt, "int32"},     {at::kLong, "int64"}};

bool Carried(at::ScalarType dtype) {
  for (const auto& [type, name] : kCarriedDtypes) {
    if (type == dtype) return true;
  }
  return false;
}

// The tensors the lean allreduce bindings take: CPU, strided, with storage of their own (not a
// wrapper such as torch.func's) and of a dtype the transport reduces.
bool Lean(const at::Tensor& tensor) {
  return tensor.defined() && tensor.device().is_cpu() && tensor.layout() == at::kStrided &&
         tensor.has_storage() && !tensor.is_conj() && !tensor.is_neg() && Carried(tensor.scalar_type());
}

// allreduce_async_'s common case (hvdlite/ops.py): an in-place allreduce of one dense CPU
// tensor of a dtype the transport reduces, no scaling. Returns -1, enqueuing nothing, for any
// other tensor (Python's general path then checks it and says what is wrong). The checks cost
// nanoseconds here and a fraction of a microsecond each as Python attribute reads.
int64_t AllreduceInPlace(Engine& engine, const at::Tensor& tensor, const std::string& name, int op) {
  if (!Lean(tensor)) return -1;
  std::vector<EnqueueArgs> args;
  args.push_back(Args(static_cast<int>(CollectiveKind::kAllreduce), tensor, tensor, name, op, 0, 1.0, 1.0));
  std::vector<int64_t> handles;
  Status status;
  {
    py::gil_scoped_release release;
    status = engine.Enqueue(std::move(args), &handles);
  }
  Check(status);
  return handles.front();
}

// hvd.allreduce and hvd.allreduce_ in the same common case, enqueued and waited for in one
// call; for small tensors, and allreduces repeated as a training loop does, the caller runs the
// round itself (Note [A waiting caller runs the round] in round_driver.h).
// Returns the result, or None when the tensor is not that case (the general path takes it).
py::object AllreduceNow(Engine& engine, const at::Tensor& tensor, const std::string& name, int op, bool in_place) {
  if (!Lean(tensor)) return py::none();
  // (empty_cpu: the same contiguous CPU tensor as empty_like, without the operator dispatch)
  const at::Tensor output = in_place ? tensor : at::Tensor(at::detail::empty_cpu(tensor.sizes(), tensor.scalar_type()));
  std::vector<EnqueueArgs> args;
  args.push_back(Args(static_cast<int>(CollectiveKind::kAllreduce), tensor, output, name, op, 0, 1.0, 1.0));
  std::vector<int64_t> handles;
  at::Tensor result;
  std::vector<int64_t> aux;
  Status status;
  {
    py::gil_scoped_release release;
    status = engine.Enqueue(std::move(args), &handles, /*waits_now=*/true);
    if (status.ok()) status = engine.Wait(handles.front(), &result, &aux);
  }
  Check(status);
  return py::cast(result);
}

// Both wait bindings: a completed handle is taken with the GIL held (releasing and retaking it
// costs more than the take); only a wait that blocks releases it. Raises the handle's failure.
void WaitFor(Engine& engine, int64_t handle, at::Tensor* output, std::vector<int64_t>* aux) {
  Status status;
  if (!engine.TryWait(handle, output, aux, &status)) {
    py::gil_scoped_release release;
    status = engine.Wait(handle, output, aux);
  }
  Check(status);
}

py::dict ParseConfig(const std::map<std::string, std::string>& env) {
  py::dict out;
  VisitSettings(ConfigFromMap(env), {[&](const char* key, int64_t v) { out[key] = v; },
                                     [&](const char* key, double v) { out[key] = v; },
                                     [&](const char* key, bool v) { out[key] = v; },
                                     [&](const char* key, const std::string& v) { out[key] = v; }});
  return out;
}

// Note [Straggler attribution]: {rank: {...}} (hvd.straggler_report()).
py::dict StragglerDict(const Engine& engine) {
  py::dict out;
  const std::vector<StragglerFigures> figures = engine.recorder().Stragglers();
  for (size_t r = 0; r < figures.size(); ++r) {
    const StragglerFigures& f = figures[r];
    out[py::int_(r)] = py::dict(py::arg("last_fraction") = f.last_fraction, py::arg("lag_median_s") = f.lag_median_s,
                                py::arg("lag_p95_s") = f.lag_p95_s, py::arg("rounds_last") = f.rounds_last,
                                py::arg("rounds") = f.rounds, py::arg("flagged") = f.flagged);
  }
  return out;
}

// Note [Flight record]: recent rounds, what the engine thread does, and (if it answered within
// `timeout_s`) the collectives pending now.
py::dict FlightRecordDict(Engine& engine, double timeout_s) {
  std::vector<PendingCollective> pending;
  bool answered = false;
  {
    py::gil_scoped_release release;
    answered = engine.PendingNow(timeout_s, &pending);
  }
  py::list rounds;
  for (const FlightRound& round : engine.recorder().Rounds()) {
    py::list items;
    for (const FlightItem& item : round.items) {
      items.append(py::dict(py::arg("name") = item.name, py::arg("op") = KindName(item.kind),
                            py::arg("bytes") = item.bytes, py::arg("transport") = item.transport,
                            py::arg("error") = item.error));
    }
    rounds.append(py::dict(py::arg("round") = round.round, py::arg("at_s") = round.at_us / 1e6,
                           py::arg("tensors") = round.tensors, py::arg("bytes") = round.bytes,
                           py::arg("last_rank") = round.last_rank, py::arg("lag_s") = round.lag_us / 1e6,
                           py::arg("items") = items));
  }
  py::object waiting = py::none();
  if (answered) {
    py::list list;
    for (const PendingCollective& p : pending) {
      list.append(py::dict(py::arg("name") = p.name, py::arg("op") = KindName(p.kind), py::arg("bytes") = p.bytes,
                           py::arg("waited_s") = p.waited_ms / 1e3, py::arg("submitted") = p.submitted,
                           py::arg("missing") = p.missing));
    }
    waiting = list;
  }
  const auto [activity, since_us] = engine.recorder().Activity();
  return py::dict(py::arg("rounds") = rounds, py::arg("pending") = waiting, py::arg("activity") = activity,
                  py::arg("activity_for_s") = (MonotonicMicros() - since_us) / 1e6);
}

// Note [Metrics] (hvdlite/_runtime/metrics.py): the engine's counters.
py::dict MetricsDict(const Engine& engine) {
  const MetricsSnapshot m = engine.recorder().Metrics();
  py::list traffic;
  for (const auto& [key, t] : m.traffic) traffic.append(py::make_tuple(key.first, key.second, t.tensors, t.bytes));
  return py::dict(py::arg("traffic") = traffic, py::arg("round_bounds_s") = m.round_bounds_s,
                  py::arg("round_counts") = m.round_counts, py::arg("round_sum_s") = m.round_sum_s,
                  py::arg("rounds") = m.rounds, py::arg("negotiate_sum_s") = m.negotiate_sum_s,
                  py::arg("negotiations") = m.negotiations, py::arg("fusion_fill_sum") = m.fusion_fill_sum,
                  py::arg("fused_batches") = m.fused_batches, py::arg("cache_hits") = m.cache_hits,
                  py::arg("cache_misses") = m.cache_misses, py::arg("stall_warnings") = m.stall_warnings,
                  py::arg("stall_failures") = m.stall_failures);
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
      // Note [Status subjects]: the fields travel as fields.
      const Status& s = e.status;
      py::object exc = py::module_::import("hvdlite.exceptions")
                           .attr("_from_status")(static_cast<int>(s.code()), s.message(), s.op(),
                                                 s.tensor(), s.ranks(), s.reason());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  // The vocabulary Python shares with the core, exported once (names -> values).
  py::dict reduce_ops, kinds, codes;
  for (int op = 0; op <= kMaxReduceOp; ++op) reduce_ops[ReduceOpName(static_cast<ReduceOp>(op))] = op;
  for (int kind = 0; kind < kNumCollectiveKinds; ++kind) kinds[KindName(static_cast<CollectiveKind>(kind))] = kind;
  const std::pair<const char*, StatusCode> kCodes[] = {
      {"invalid_argument", StatusCode::kInvalidArgument}, {"mismatch", StatusCode::kMismatch},
      {"rank_failure", StatusCode::kRankFailure},         {"stall", StatusCode::kStall},
      {"shutdown", StatusCode::kShutdown},                {"internal", StatusCode::kInternal},
      {"reset", StatusCode::kReset}};
  for (const auto& [name, code] : kCodes) codes[name] = static_cast<int>(code);
  m.attr("REDUCE_OPS") = reduce_ops;
  m.attr("COLLECTIVE_KINDS") = kinds;
  m.attr("STATUS_CODES") = codes;
  py::list dtypes;
  for (const auto& [type, name] : kCarriedDtypes) dtypes.append(name);
  m.attr("CARRIED_DTYPES") = dtypes;
  m.attr("PROTOCOL_VERSION") = kProtocolVersion;
  m.attr("BUILD_ID") = HVDLITE_BUILD_ID;
  m.attr("JOB_WIDE_SETTINGS") = JobWideVariables();

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine")
      .def(py::init(&MakeEngine), py::arg("control").none(true), py::arg("cpu"),
           py::arg("cuda"), py::arg("rank"), py::arg("size"), py::arg("settings"),
           py::arg("shm").none(true) = nullptr, py::arg("cross").none(true) = py::none(),
           py::arg("route") = "gloo_channels", py::arg("control_timeout") = 0.0, py::arg("data_timeout") = 0.0,
           py::arg("link").none(true) = nullptr)
      // The door of every collective: one request per tensor, every option named (a grouped
      // call, alltoall's splits, a wire dtype). The lean allreduces below are its common case
      // taken without Python's checks (they say which tensors they take).
      .def("enqueue", &Enqueue, py::arg("kind"), py::arg("inputs"), py::arg("outputs"), py::arg("names"),
           py::arg("op") = static_cast<int>(ReduceOp::kSum), py::arg("root") = 0, py::arg("prescale") = 1.0,
           py::arg("postscale") = 1.0, py::arg("group") = "", py::arg("splits") = std::vector<std::vector<int64_t>>(),
           py::arg("wire") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("new_name", &Engine::NewName, py::arg("prefix"))
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
             WaitFor(engine, handle, &output, &aux);
             return std::make_pair(output, aux);
           })
      .def("allreduce_", &AllreduceInPlace)
      .def("allreduce_now", &AllreduceNow)
      .def("wait_done",
           [](Engine& engine, int64_t handle) {
             // wait() for a result the caller already holds (an in-place allreduce's tensor):
             // nothing to convert on the way back.
             at::Tensor output;
             std::vector<int64_t> aux;
             WaitFor(engine, handle, &output, &aux);
           })
      .def("wait_all",
           [](Engine& engine, const std::vector<int64_t>& handles) {
             // One call for a whole group: waits for every handle (even after a failure),
             // then reports the first failure.
             std::vector<at::Tensor> outputs;
             std::vector<std::vector<int64_t>> aux;
             std::vector<Status> statuses;
             engine.WaitAll(handles, &outputs, &aux, &statuses);
             for (const Status& status : statuses) Check(status);
             std::vector<std::pair<at::Tensor, std::vector<int64_t>>> results(handles.size());
             for (size_t i = 0; i < handles.size(); ++i) results[i] = {std::move(outputs[i]), std::move(aux[i])};
             return results;
           },
           py::call_guard<py::gil_scoped_release>())
      .def("set_timeline", &Engine::SetTimeline, py::arg("path"), py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &Engine::Shutdown, py::arg("reason") = "", py::arg("reset") = false, py::call_guard<py::gil_scoped_release>())
      .def("stragglers", &StragglerDict)
      .def("flight_record", &FlightRecordDict, py::arg("timeout_s") = 2.0)
      .def("metrics", &MetricsDict)
      .def("set_recording", &Engine::set_recording, py::arg("on"))
      .def("set_label", &Engine::SetLabel, py::arg("label"), py::arg("propagates_signals") = false)
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("size", &Engine::size)
      .def_property_readonly("shared_memory", &Engine::shared_memory)
      .def_property_readonly("hierarchical", &Engine::hierarchical)
      .def_property_readonly("shm_waits", &Engine::shm_waits)
      .def_property_readonly("_caller_rounds", &Engine::caller_rounds)
      // Note [Slots sized by the last rounds]: (rounds through the backend, second exchanges, next slot).
      .def_property_readonly("_control_exchanges",
                             [](const Engine& e) {
                               const ControlChannel& c = e.control_channel();
                               return py::make_tuple(c.rounds(), c.second_exchanges(), c.slot_bytes());
                             })
      // Note [Cached rounds]: (reductions tried, rounds decided by them).
      .def_property_readonly("_cached_rounds",
                             [](const Engine& e) {
                               return py::make_tuple(e.control_channel().reductions(), e.cached_rounds());
                             })
      .def_property_readonly("_straight_shares", &Engine::straight_shares)
      .def_property_readonly("_single_copy_blocks", &Engine::single_copy_blocks)
      .def("_set_single_copy_min", &Engine::SetSingleCopyMin, py::arg("min_bytes"))
      .def_property_readonly("single_copy", &Engine::single_copy)
      .def_property_readonly("fusion_threshold_bytes",
                             [](const Engine& e) { return e.config().fusion_threshold_bytes; })
      .def_property_readonly("cycle_time_ms", [](const Engine& e) { return e.config().cycle_time_ms; });

  // Note [Shared-memory allreduce]: hvdlite/_runtime/groups.py creates, opens and unlinks the segment.
  py::class_<ShmChannel, std::shared_ptr<ShmChannel>>(m, "ShmChannel")
      .def(py::init<const std::string&, int, int, std::vector<int64_t>, std::vector<int64_t>, double, int64_t>(),
           py::arg("name"), py::arg("rank"), py::arg("size"), py::arg("ranks"), py::arg("pids"),
           py::arg("timeout_seconds"), py::arg("chunk_bytes") = 0)
      .def_readonly_static("HIERARCHICAL_CHUNK", &ShmChannel::kHierarchicalChunk)
      .def_readonly_static("SINGLE_COPY_MIN_BYTES", &ShmChannel::kSingleCopyMinBytes)
      .def_static("create", &ShmSegment::Create, py::arg("name"), py::arg("size"), py::arg("chunk_bytes") = 0)
      .def_static("unlink", &ShmSegment::Unlink, py::arg("name"))
      // Note [Single-copy allreduce]: the probe at init and the switch
      .def("probe_word", [](ShmChannel& c) { return std::make_pair(c.ProbeAddress(), c.ProbeValue()); })
      .def_static("can_reach", &ShmChannel::CanReach, py::arg("pid"), py::arg("address"), py::arg("value"))
      .def("enable_single_copy", &ShmChannel::EnableSingleCopy, py::arg("min_bytes") = ShmChannel::kSingleCopyMinBytes)
      .def_property_readonly("single_copy", &ShmChannel::single_copy_enabled)
      // Note [Point-to-point through shared memory]: the floor a message's latency is measured against.
      .def("ping_pong_floor", &ShmPointToPoint::PingPongFloor, py::arg("rounds"),
           py::call_guard<py::gil_scoped_release>())
      .def_static("segment_bytes", &ShmSegment::Bytes, py::arg("size"), py::arg("chunk_bytes") = 0);

  // Note [Dump requests] (recorder.h)
  m.def("install_dump_signal", &InstallDumpSignal, py::arg("signum"));
  m.def("ring_dump", &RingDump, py::arg("id"), py::arg("reason"));
  m.def("wait_dump", &WaitDump, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>());

  // Note [Control link] (control_link.h): made and connected by init() (hvdlite/_runtime/groups.py).
  py::class_<ControlLink, std::shared_ptr<ControlLink>>(m, "ControlLink")
      .def(py::init<int, int, const std::string&, const std::vector<std::string>&, double>(), py::arg("rank"),
           py::arg("size"), py::arg("listen_host"), py::arg("published"), py::arg("timeout_s"))
      .def_property_readonly("address", &ControlLink::address)
      .def_property_readonly("partners", &ControlLink::partners)
      .def("connect", &ControlLink::Connect, py::arg("addresses"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("connections", &ControlLink::connections)
      .def_property_readonly("frames", [](const ControlLink& l) { return std::make_pair(l.frames_sent(), l.frames_received()); });

  DefineTestHooks(m);
  m.def("_parse_config", &ParseConfig);
  m.def("control_peers", &ControlChannel::Peers, py::arg("rank"), py::arg("size"), py::arg("alltoall_max"));
  // Note [Engine behind a process group] (torch_backend.h): the c10d::Backend over `engine`.
  m.def(
      "torch_backend",
      [](std::shared_ptr<Engine> engine, std::optional<c10::intrusive_ptr<c10d::Backend>> link,
         double timeout_s, std::shared_ptr<ShmChannel> messages,
         std::optional<c10::intrusive_ptr<c10d::Backend>> cuda_link) -> c10::intrusive_ptr<c10d::Backend> {
        return c10::make_intrusive<TorchBackend>(
            std::move(engine), link ? *link : c10::intrusive_ptr<c10d::Backend>(),
            std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0)), std::move(messages),
            cuda_link ? *cuda_link : c10::intrusive_ptr<c10d::Backend>());
      },
      py::arg("engine"), py::arg("link") = py::none(), py::arg("timeout_s") = 1800.0, py::arg("messages") = nullptr,
      py::arg("cuda_link") = py::none());
  m.def(
      "point_to_point_path",
      [](c10::intrusive_ptr<c10d::Backend> backend) {
        auto* ours = dynamic_cast<TorchBackend*>(backend.get());
        return ours == nullptr ? std::string() : ours->pointToPointPath();
      },
      py::arg("backend"));
  m.def(
      "pending_point_to_point",
      [](c10::intrusive_ptr<c10d::Backend> backend) {
        auto* ours = dynamic_cast<TorchBackend*>(backend.get());
        return ours == nullptr ? std::vector<std::string>{} : ours->pendingPointToPoint();
      },
      py::arg("backend"), py::call_guard<py::gil_scoped_release>());
}
