// Test hooks: the core's pure logic (controller, planner, message encoding, autotuner, the
// channels' staged schedule) driven from Python in one process, for tests/unit. Nothing here
// is used by a running job.
#include "test_hooks.h"

#include <pybind11/stl.h>

#include <ATen/ops/empty.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>

#include "autotune.h"
#include "backend.h"
#include "control_channel.h"
#include "controller.h"
#include "cpu_route.h"
#include "fusion.h"
#include "message.h"
#include "pipeline.h"
#include "status_error.h"

namespace py = pybind11;

namespace hvdlite {
namespace {

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
  d["op"] = item.status.op();
  d["tensor"] = item.status.tensor();
  d["ranks"] = item.status.ranks();
  d["reason"] = item.status.reason();
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
  ControllerHarness(int size, double stall_check, double stall_shutdown, size_t cache_capacity, bool in_step)
      : size_(size), controller_(size, stall_check, stall_shutdown, cache_capacity) {
    if (!in_step) controller_.DisableInStepForTest();
  }
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
    return ResultToDict(controller_.ProcessRound(parsed));
  }
  // Note [Cached rounds]: the round in which every rank sent the cached entries of `names`
  // (in this order), decided by repeating their remembered decisions; None where one of them
  // has none (the engine then decides every rank's cached requests in full).
  py::object Repeat(const std::vector<std::string>& names) {
    std::vector<uint32_t> ids;
    for (const std::string& name : names) {
      Request probe;
      probe.name = name;
      int32_t id = -1;
      for (uint32_t i = 0; i < controller_.id_space() && id < 0; ++i) {
        if (controller_.CacheResolve(0, i, &probe) && probe.name == name) id = static_cast<int32_t>(i);
      }
      if (id < 0) throw std::runtime_error("'" + name + "' is not cached");
      ids.push_back(static_cast<uint32_t>(id));
    }
    std::sort(ids.begin(), ids.end());
    if (!controller_.CanRepeat(ids)) return py::none();
    std::vector<std::map<uint32_t, std::string>> payloads(size_);
    return ResultToDict(controller_.ProcessRepeated(ids, &payloads, false, false, 0));
  }
  py::dict ResultToDict(const RoundResult& result) {
    py::list ready;
    for (const ReadyItem& item : result.ready) ready.append(ItemToDict(item));
    py::dict out;
    out["ready"] = ready;
    out["shutdown"] = result.shutdown;
    out["quiet"] = result.quiet;
    out["all_outstanding"] = result.all_outstanding;
    out["stall_warning"] = result.stall_warning;
    out["pending"] = controller_.pending_count();
    out["in_step_rounds"] = controller_.in_step_rounds();
    out["cache_entries"] = controller_.cache_entries();
    return out;
  }
  uint64_t Digest() const { return controller_.Digest(); }
  void ForgetCache() { controller_.ForgetCacheForTest(); }
  // bench/scale_model.py: the CPU of `rounds` rounds in which every rank repeats `message`
  // (already decided once, so every request is a cache hit), as a cached round runs them
  // (Note [Cached rounds] in cached_round.h): seconds per round to expand every rank's message
  // from the response cache, and to decide it; and to repeat the remembered decisions instead
  // (Controller::ProcessRepeated, what a cached round runs).
  py::tuple RepeatCost(const py::dict& message, int rounds) {
    const RankMessage mine = MessageFromDict(message);
    const int size = size_;
    double expand = 0, decide = 0, repeat = 0;
    {
      py::gil_scoped_release release;
      for (int k = 0; k < rounds; ++k) {
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<RankMessage> all(size);
        for (int r = 0; r < size; ++r) {
          for (const Request& request : mine.requests) {
            const int32_t id = controller_.CacheLookup(r, request);
            all[r].requests.emplace_back();
            if (id < 0 || !controller_.CacheResolve(r, static_cast<uint32_t>(id), &all[r].requests.back())) {
              throw std::runtime_error("'" + request.name + "' is not cached for rank " + std::to_string(r));
            }
          }
        }
        const auto t1 = std::chrono::steady_clock::now();
        controller_.ProcessRound(std::move(all));
        const auto t2 = std::chrono::steady_clock::now();
        expand += std::chrono::duration<double>(t1 - t0).count();
        decide += std::chrono::duration<double>(t2 - t1).count();
        std::vector<uint32_t> ids;
        for (const Request& request : mine.requests) ids.push_back(controller_.CacheLookup(0, request));
        std::sort(ids.begin(), ids.end());
        std::vector<std::map<uint32_t, std::string>> payloads(size);
        const auto t3 = std::chrono::steady_clock::now();
        if (!controller_.CanRepeat(ids)) throw std::runtime_error("no decision to repeat");
        controller_.ProcessRepeated(ids, &payloads, true, false, 0);
        repeat += std::chrono::duration<double>(std::chrono::steady_clock::now() - t3).count();
      }
    }
    return py::make_tuple(expand / rounds, decide / rounds, repeat / rounds);
  }

 private:
  int size_;
  Controller controller_;
};

py::list Plan(const py::list& requests, int64_t threshold, bool cpu_streams) {
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
  for (const Batch& batch : PlanBatches(std::move(items), threshold, cpu_streams)) {
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

// Note [Pipelined fusion over channels]: a channel that moves no data and records what the
// route asks of it. The k-th chunk started (on any channel) says it has ended after
// probes[k % probes.size()] looks; its wait always ends it.
class ScriptedChannel : public CollectiveBackend {
 public:
  ScriptedChannel(int index, const std::vector<int64_t>& probes, int64_t& started, const at::Tensor& buffer,
                  py::list& events)
      : index_(index), probes_(probes), started_(started), base_(static_cast<const char*>(buffer.data_ptr())),
        events_(events) {}
  PendingWork StartAllreduce(at::Tensor& tensor, ReduceOp) override {
    const int64_t size = static_cast<int64_t>(tensor.element_size());
    const int64_t begin = (static_cast<const char*>(tensor.data_ptr()) - base_) / size;
    const int64_t end = begin + tensor.numel();
    events_.append(py::make_tuple("start", index_, begin, end));
    auto left = std::make_shared<int64_t>(probes_[started_++ % probes_.size()]);
    return PendingWork([this, begin, end] { events_.append(py::make_tuple("end", index_, begin, end)); },
                       [this, left, begin, end] {
                         const bool ended = (*left)-- <= 0;
                         events_.append(py::make_tuple("probe", index_, begin, end, ended));
                         return ended;
                       });
  }
  void Broadcast(at::Tensor&, int) override { throw std::logic_error("not scripted"); }
  void Allgather(at::Tensor&, std::vector<at::Tensor>&) override { throw std::logic_error("not scripted"); }
  void Alltoall(at::Tensor&, at::Tensor&, const std::vector<int64_t>&, const std::vector<int64_t>&) override {
    throw std::logic_error("not scripted");
  }
  std::string name() const override { return "scripted channel " + std::to_string(index_); }

 private:
  int index_;
  const std::vector<int64_t>& probes_;
  int64_t& started_;
  const char* base_;
  py::list& events_;
};

// The events of one staged allreduce of `elements` float32 over `channels` scripted channels,
// staged in a buffer of `buffer_elements` (0: all of them; fewer streams the elements through
// it, Note [Streaming a batch through its buffer]): ("in" | "out", begin, end, where) from the
// copies, `where` being the buffer offset that holds element `begin`, ("prefault", begin, end),
// ("start" | "end", channel, begin, end) from the channels with buffer offsets, and ("probe",
// channel, begin, end, ended), in the order they happened.
py::list StagedSchedule(int64_t elements, int channels, const std::vector<int64_t>& probes, bool prefault,
                        int64_t buffer_elements) {
  if (probes.empty()) throw std::invalid_argument("probes: at least one count");
  if (channels < 1) throw std::invalid_argument("channels: at least one");
  at::Tensor buffer = at::empty({buffer_elements > 0 ? buffer_elements : elements}, at::kFloat);
  const auto* base = static_cast<const char*>(buffer.data_ptr());
  py::list events;
  int64_t started = 0;
  std::vector<std::unique_ptr<ScriptedChannel>> owned;
  CpuRouteInputs inputs;  // kGlooChannels
  for (int i = 0; i < channels; ++i) {
    owned.push_back(std::make_unique<ScriptedChannel>(i, probes, started, buffer, events));
    inputs.channels.push_back(owned.back().get());
  }
  std::unique_ptr<CpuRoute> route = MakeCpuRoute(inputs);
  auto record = [&events, base](const char* what) {
    return [&events, base, what](int64_t begin, int64_t end, at::Tensor& part) {
      const int64_t where = (static_cast<const char*>(part.data_ptr()) - base) / static_cast<int64_t>(part.element_size());
      events.append(py::make_tuple(what, begin, end, where));
    };
  };
  CpuRoute::Range mapped;
  if (prefault) mapped = [&events](int64_t begin, int64_t end) { events.append(py::make_tuple("prefault", begin, end)); };
  CpuRoute::Staging staging{record("in"), [](at::Tensor&) {}, record("out"), mapped};
  route->AllreduceStaged(buffer, elements, ReduceOp::kSum, staging);
  return events;
}

// Note [Every path sends the same chunks] (pipeline.h): a WorkWindow of `count` scripted works on
// `lanes` lanes, driven as the pipelined loops drive it: work k is made ready, then work
// k - lag is reaped (lag 0: never before the end), then Finish. Work `fail_start` throws when
// started, work `fail_wait` (and every work in `also_fail`) when waited for; each work ends
// only when waited for. Returns the events ("start" | "wait", k) in order and the message of
// the error Finish threw ("" if none).
py::tuple WindowSchedule(int64_t count, int64_t lanes, int64_t lag, int64_t fail_start, int64_t fail_wait,
                         const std::vector<int64_t>& also_fail) {
  py::list events;
  std::string error;
  {
    WorkWindow window(count, lanes, [&](int64_t k) {
      events.append(py::make_tuple("start", k));
      if (k == fail_start) throw std::runtime_error("start " + std::to_string(k));
      const bool fails = k == fail_wait || std::count(also_fail.begin(), also_fail.end(), k) > 0;
      return PendingWork([&events, k, fails] {
        events.append(py::make_tuple("wait", k));
        if (fails) throw std::runtime_error("wait " + std::to_string(k));
      });
    });
    try {
      for (int64_t k = 0; k < count && !window.failed(); ++k) {
        window.Ready(k + 1);
        if (lag > 0) window.Reap(k - lag);
      }
      window.Finish();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  return py::make_tuple(events, error);
}

}  // namespace

void DefineTestHooks(py::module_& m) {
  py::class_<ControllerHarness>(m, "_ControllerHarness")
      .def(py::init<int, double, double, size_t, bool>(), py::arg("size"),
           py::arg("stall_check_seconds") = 0.0, py::arg("stall_shutdown_seconds") = 0.0,
           py::arg("cache_capacity") = 0, py::arg("in_step") = true)
      .def("round", &ControllerHarness::Round)
      .def("repeat", &ControllerHarness::Repeat)
      .def("wire", &ControllerHarness::Wire)
      .def("digest", &ControllerHarness::Digest)
      .def("forget_cache", &ControllerHarness::ForgetCache)
      .def("repeat_cost", &ControllerHarness::RepeatCost, py::arg("message"), py::arg("rounds") = 3);
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
  m.def("_plan", &Plan, py::arg("requests"), py::arg("threshold"), py::arg("cpu_streams") = false);
  m.def("_encode_message", &EncodeMessage);
  m.def("_decode_message", &DecodeMessage);
  // Note [Slots sized by the last rounds]: the slot after each round of lengths.
  m.def("_slot_sizes", [](int size, const std::vector<std::vector<int64_t>>& rounds) {
    SlotSizer sizer(size);
    std::vector<int64_t> slots;
    for (const auto& lengths : rounds) slots.push_back(sizer.Next(lengths));
    return slots;
  }, py::arg("size"), py::arg("rounds"));
  m.def("_cut_chunks", [](int64_t total, int64_t per, int64_t first) {
    py::list out;
    for (const Chunk& c : CutChunks(total, per, first)) out.append(py::make_tuple(c.begin, c.n));
    return out;
  }, py::arg("total"), py::arg("per"), py::arg("first") = 0);
  m.def("_window_schedule", &WindowSchedule, py::arg("count"), py::arg("lanes"), py::arg("lag"),
        py::arg("fail_start") = -1, py::arg("fail_wait") = -1, py::arg("also_fail") = std::vector<int64_t>());
  m.def("_staged_schedule", &StagedSchedule, py::arg("elements"), py::arg("channels"), py::arg("probes"),
        py::arg("prefault"), py::arg("buffer_elements") = 0);
  DefineHypercubeHooks(m);
}

}  // namespace hvdlite
