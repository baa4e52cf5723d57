#include "engine.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>

namespace hvdlite {
namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

constexpr double kActiveHeartbeatMs = 100.0;

Clock::duration Millis(double ms) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(ms));
}

}  // namespace

Engine::Engine(const Config& config, int rank, int size, std::unique_ptr<CollectiveBackend> control,
               std::unique_ptr<CollectiveBackend> cpu, std::unique_ptr<CollectiveBackend> cuda)
    : config_(config),
      rank_(rank),
      size_(size),
      logger_(rank, config.log_level),
      control_backend_(std::move(control)),
      cpu_backend_(std::move(cpu)),
      cuda_backend_(std::move(cuda)),
      channel_(control_backend_.get(), size),
      controller_(size, config.stall_check_seconds, config.stall_shutdown_seconds),
      executor_(rank, size, cpu_backend_.get(), cuda_backend_.get(), &queue_, &handles_) {
  thread_ = std::thread([this] { Loop(); });
}

Engine::~Engine() { Shutdown(); }

Status Engine::Enqueue(std::vector<EnqueueArgs> args, std::vector<int64_t>* handles) {
  if (args.empty()) return Status(StatusCode::kInvalidArgument, "nothing to enqueue");
  std::vector<Entry> entries;
  entries.reserve(args.size());
  const std::string group = args.front().group;
  for (EnqueueArgs& a : args) {
    Entry entry;
    Request& r = entry.request;
    r.name = a.name.empty() ? "hvdlite.noname." + std::to_string(name_counter_++) : a.name;
    r.kind = a.kind;
    r.dtype = static_cast<int8_t>(a.input.scalar_type());
    r.device_type = static_cast<int8_t>(a.input.device().type());
    r.op = a.op;
    r.root = a.root;
    r.prescale = a.prescale;
    r.postscale = a.postscale;
    r.shape = a.input.sizes().vec();
    r.group = group;
    r.group_size = group.empty() ? 0 : static_cast<int32_t>(args.size());
    r.splits = std::move(a.splits);
    if (!a.input.device().is_cpu()) {
      // Note [Device streams]: the input is ready once the caller's current stream gets here.
      c10::impl::VirtualGuardImpl impl(a.input.device().type());
      entry.ready_event = std::make_shared<c10::Event>(a.input.device().type());
      entry.ready_event->record(impl.getStream(a.input.device()));
    }
    entry.input = std::move(a.input);
    entry.output = std::move(a.output);
    entries.push_back(std::move(entry));
  }
  std::vector<int64_t> created;
  for (Entry& entry : entries) {
    entry.handle = handles_.Create();
    created.push_back(entry.handle);
  }
  Status status = queue_.Push(std::move(entries));
  if (!status.ok()) {
    for (int64_t h : created) handles_.Discard(h);
    return status;
  }
  *handles = std::move(created);
  return Status::Ok();
}

Status Engine::Poll(int64_t handle, bool* done) { return handles_.Poll(handle, done); }

Status Engine::Wait(int64_t handle, at::Tensor* output, std::vector<int64_t>* aux) {
  Completion completion;
  Status status = handles_.Wait(handle, &completion);
  if (!status.ok()) return status;
  if (!completion.status.ok()) return completion.status;
  if (completion.done_event && completion.output.defined()) {
    // Make the caller's current stream wait for the engine's work, without blocking the CPU.
    c10::Device device = completion.output.device();
    c10::impl::VirtualGuardImpl impl(device.type());
    completion.done_event->block(impl.getStream(device));
  }
  *output = std::move(completion.output);
  *aux = std::move(completion.aux);
  return Status::Ok();
}

void Engine::Shutdown() {
  shutdown_requested_ = true;
  queue_.Wake();
  if (thread_.joinable()) thread_.join();
}

void Engine::Loop() {
  at::NoGradGuard no_grad;
  auto last_round = Clock::now() - std::chrono::hours(1);
  auto last_busy = Clock::now();
  auto backoff = Millis(0.1);
  bool stuck = false;
  while (true) {
    // Note [Cycle policy]
    const bool has_new = queue_.HasNew();
    const bool waiting = queue_.HasInFlight();
    if (shutdown_requested_) {
      // go now
    } else if (has_new || (waiting && !stuck)) {
      auto next = last_round + Millis(config_.cycle_time_ms);
      if (Clock::now() < next) std::this_thread::sleep_until(next);
    } else {
      auto wait = stuck ? backoff : IdleHeartbeat(Clock::now() - last_busy);
      queue_.WaitForWork(Clock::now() + wait);
      if (stuck && !queue_.HasNew() && !shutdown_requested_) {
        backoff = std::min(backoff * 2, Millis(config_.idle_heartbeat_ms));
      }
    }
    last_round = Clock::now();
    bool keep_going = false, quiet = false;
    try {
      keep_going = RunRound(&stuck, &quiet);
    } catch (const std::exception& e) {
      Stop(Status(StatusCode::kRankFailure,
                  std::string("hvdlite lost contact with its peers; the job cannot continue: ") +
                      e.what()));
      return;
    }
    if (!quiet) last_busy = Clock::now();
    if (!stuck) backoff = Millis(0.1);
    if (!keep_going) return;
  }
}

Clock::duration Engine::IdleHeartbeat(Clock::duration idle_for) const {
  // Note [Cycle policy]: soon after activity, a short heartbeat keeps a peer's shutdown or
  // stall check prompt; a long-idle engine wakes rarely (each round costs the transport ~1 ms).
  const auto slow = Millis(config_.idle_heartbeat_ms);
  return idle_for < std::chrono::seconds(2) ? std::min(slow, Millis(kActiveHeartbeatMs)) : slow;
}

bool Engine::RunRound(bool* stuck, bool* quiet) {
  RankMessage mine;
  mine.clock_ms = NowMs();
  if (shutdown_requested_) mine.flags |= kFlagShutdown;
  mine.requests = queue_.TakeNewRequests();
  if (!mine.requests.empty() || queue_.HasInFlight()) mine.flags |= kFlagHasOutstanding;

  std::vector<std::string> raw = channel_.Allgather(EncodeRankMessage(mine));
  std::vector<RankMessage> messages(size_);
  std::vector<int> shutting_down;
  for (int r = 0; r < size_; ++r) {
    Status status = DecodeRankMessage(raw[r].data(), raw[r].size(), &messages[r]);
    if (!status.ok()) {
      Stop(Status(StatusCode::kRankFailure,
                  "rank " + std::to_string(r) + " sent a malformed control message: " +
                      status.message()));
      return false;
    }
    if (messages[r].flags & kFlagShutdown) shutting_down.push_back(r);
  }
  RoundResult round = controller_.ProcessRound(messages);
  if (!round.stall_warning.empty()) logger_.Log(LogLevel::kWarning, round.stall_warning);
  for (const Batch& batch : PlanBatches(std::move(round.ready), config_.fusion_threshold_bytes)) {
    executor_.Execute(batch);
  }
  if (round.shutdown) {
    Stop(Status(StatusCode::kShutdown, "hvdlite was shut down (requested by " +
                                           RanksString(shutting_down) + ")"));
    return false;
  }
  *stuck = round.quiet && round.all_outstanding;
  *quiet = round.quiet;
  return true;
}

void Engine::Stop(const Status& status) {
  if (status.code() != StatusCode::kShutdown) logger_.Log(LogLevel::kError, status.message());
  std::vector<Entry> remaining = queue_.Close(status);
  for (Entry& entry : remaining) {
    Status failed(status.code(), std::string(KindName(entry.request.kind)) + " of '" +
                                     entry.request.name + "': " + status.message());
    handles_.Complete(entry.handle, Completion{failed, {}, nullptr, {}});
  }
  executor_.ReleaseBuffers();
  // `remaining` dies here, outside every lock (Note [GIL and tensor references]).
}

}  // namespace hvdlite
