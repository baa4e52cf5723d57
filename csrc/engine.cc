#include "engine.h"

#include <ATen/Functions.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <stdexcept>

namespace hvdlite {
namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

std::vector<CollectiveBackend*> Pointers(const std::vector<std::unique_ptr<CollectiveBackend>>& owned) {
  std::vector<CollectiveBackend*> out;
  for (const auto& b : owned) out.push_back(b.get());
  return out;
}

}  // namespace

Engine::Engine(const Config& config, int rank, int size, std::shared_ptr<CollectiveBackend> control,
               std::vector<std::unique_ptr<CollectiveBackend>> cpu, std::unique_ptr<CollectiveBackend> cuda,
               std::shared_ptr<ShmChannel> shm, std::unique_ptr<CollectiveBackend> cross, CpuRouteKind route)
    : config_(config),
      rank_(rank),
      size_(size),
      logger_(rank, config.log_level),
      control_backend_(std::move(control)),
      cpu_backends_(std::move(cpu)),
      cuda_backend_(std::move(cuda)),
      shm_(std::move(shm)),
      cross_(std::move(cross)),
      hierarchical_(route == CpuRouteKind::kHierarchical),
      timeline_(config.timeline_path, rank, size),
      channel_(control_backend_.get(), hierarchical_ ? nullptr : shm_.get(), rank, size, config.control_alltoall_max),
      controller_(size, config.stall_check_seconds, config.stall_shutdown_seconds,
                  static_cast<size_t>(config.cache_capacity), config.average_over_contributors),
      executor_(rank, size, cpu_backends_.front().get(),
                MakeCpuRoute({route, Pointers(cpu_backends_), shm_.get(), cross_.get()}),
                cuda_backend_.get(), &queue_, &handles_, &timeline_),
      settings_digest_(JobWideDigest(config)),
      params_{config.fusion_threshold_bytes, config.cycle_time_ms},
      recorder_(size, config.flight_recorder_rounds, config.straggler_min_lag_ms),
      last_exchange_end_us_(MonotonicMicros()),
      driver_(config.caller_rounds && cuda_backend_ == nullptr, rank, &queue_, &controller_,
              hierarchical_ ? nullptr : shm_.get(), &timeline_) {
  if (shm_) shm_->YieldWhile(queue_.waiting());  // Note [Yield only while a caller waits]
  // Which way CPU reductions travel (Note [CPU routes]), for --verbose and the timeline.
  const std::string route_name = executor_.CpuRouteName();
  if (rank == 0) logger_.Log(LogLevel::kDebug, "CPU allreduces go through " + route_name);
  if (timeline_.enabled()) {
    timeline_.Marker("engine", "cpu route", MonotonicMicros(), "{\"route\": \"" + route_name + "\"}");
  }
  if (config.autotune && rank == 0) {
    tuner_ = std::make_unique<Autotuner>(params_, config.autotune_sample_seconds);
    driver_.set_tuner(tuner_.get());
  }
  thread_ = std::thread([this] { Loop(); });
}

Engine::~Engine() {
  Shutdown();
  // The channel may outlive this engine (Python holds it too); the count it reads does not.
  if (shm_) shm_->YieldWhile(nullptr);
}

Status Engine::Enqueue(std::vector<EnqueueArgs> args, std::vector<int64_t>* handles, bool waits_now) {
  if (args.empty()) return Status(StatusCode::kInvalidArgument, "nothing to enqueue");
  std::vector<Entry> entries;
  entries.reserve(args.size());
  const std::string group = args.front().group;
  for (EnqueueArgs& a : args) {
    Entry entry;
    Request& r = entry.request;
    r.name = a.name.empty() ? NewName("hvdlite.noname") : a.name;
    r.kind = a.kind;
    // Note [Casting on the wire]: the request carries the dtype that travels.
    const bool cast = a.wire && at::isFloatingType(a.input.scalar_type()) && *a.wire != a.input.scalar_type();
    if (a.wire && a.kind != CollectiveKind::kAllreduce) {
      return Status(StatusCode::kInternal, "a wire dtype for a collective other than allreduce");
    }
    const c10::ScalarType wire = cast ? *a.wire : a.input.scalar_type();
    r.dtype = static_cast<int8_t>(wire);
    r.device_type = static_cast<int8_t>(a.input.device().type());
    r.op = a.op;
    r.root = a.root;
    r.prescale = a.prescale;
    r.postscale = a.postscale;
    r.shape = a.input.sizes().vec();
    r.group = group;
    r.group_size = group.empty() ? 0 : static_cast<int32_t>(args.size());
    r.splits = std::move(a.splits);
    MaybeInline(&r, a.input, wire);
    if (!a.input.device().is_cpu()) {
      // Note [Device streams]: the input is ready once the caller's current stream gets here.
      c10::impl::VirtualGuardImpl impl(a.input.device().type());
      entry.ready_event = std::make_shared<c10::Event>(a.input.device().type());
      entry.ready_event->record(impl.getStream(a.input.device()));
    }
    entry.input = std::move(a.input);
    entry.output = std::move(a.output);
    if (entry.output.defined() && entry.output.is_inference()) {  // Note [Inference tensors]
      entry.write_back = std::move(entry.output);
      c10::InferenceMode normal(false);
      entry.output = at::empty_like(entry.write_back, at::MemoryFormat::Contiguous);
    }
    entry.enqueued_us = MonotonicMicros();
    r.submitted_us = entry.enqueued_us;  // Note [Submission times]
    entry.bytes = entry.input.numel() * static_cast<int64_t>(c10::elementSize(wire));
    entries.push_back(std::move(entry));
  }
  std::vector<int64_t> created;
  int64_t bytes = 0;
  for (Entry& entry : entries) {
    entry.handle = handles_.Create();
    created.push_back(entry.handle);
    bytes += entry.bytes;
  }
  // Note [A waiting caller runs the round]
  const bool caller_runs = driver_.CallerTakes(entries, bytes, waits_now);
  Status status = queue_.Push(std::move(entries), /*wake=*/!caller_runs);
  if (!status.ok()) {
    // Another caller may have given up on running rounds while CallerTakes held the
    // lock here; it counts on a holder that leaves work behind to wake the thread.
    if (caller_runs) queue_.Wake();
    for (int64_t h : created) handles_.Discard(h);
    return status;
  }
  *handles = std::move(created);
  return Status::Ok();
}

void Engine::MaybeInline(Request* r, const at::Tensor& input, c10::ScalarType wire) const {
  // Note [Inline small tensors]
  const bool kind_ok = r->kind == CollectiveKind::kAllreduce || r->kind == CollectiveKind::kAllgather ||
                       r->kind == CollectiveKind::kBroadcast;
  const int64_t bytes = input.numel() * static_cast<int64_t>(c10::elementSize(wire));
  if (!kind_ok || !input.device().is_cpu() || bytes > config_.inline_bytes) return;
  r->inlined = true;
  if (r->kind == CollectiveKind::kBroadcast && r->root != rank_) return;  // receivers send nothing
  // Note [Casting on the wire]: the bytes that travel are the wire dtype's.
  at::Tensor contiguous = input.scalar_type() == wire ? input.contiguous() : input.to(wire).contiguous();
  r->payload.assign(static_cast<const char*>(contiguous.data_ptr()), static_cast<size_t>(bytes));
}

Status Engine::Poll(int64_t handle, bool* done) { return handles_.Poll(handle, done); }

Status Engine::Wait(int64_t handle, at::Tensor* output, std::vector<int64_t>* aux) {
  Completion completion;
  queue_.AddWaiter();  // Note [A waiting caller ends the gathering]
  RunRoundsWhile([&] {  // Note [A waiting caller runs the round]
    bool done = true;
    return handles_.Poll(handle, &done).ok() && !done;
  });
  const Status status = handles_.Wait(handle, &completion);
  queue_.RemoveWaiter();
  if (!status.ok()) return status;
  return TakeResult(&completion, output, aux);
}

bool Engine::TryWait(int64_t handle, at::Tensor* output, std::vector<int64_t>* aux, Status* status) {
  Completion completion;
  if (!handles_.TryTake(handle, &completion, status)) return false;
  if (status->ok()) *status = TakeResult(&completion, output, aux);
  return true;
}

void Engine::WaitAll(const std::vector<int64_t>& handles, std::vector<at::Tensor>* outputs,
                     std::vector<std::vector<int64_t>>* aux, std::vector<Status>* statuses,
                     bool as_caller) {
  std::vector<Completion> completions;
  const bool blocks = as_caller && !handles_.AllDone(handles);
  if (blocks) {
    queue_.AddWaiter();  // Note [A waiting caller ends the gathering]
    RunRoundsWhile([&] { return !handles_.AllDone(handles); });  // Note [A waiting caller runs the round]
  }
  handles_.WaitAll(handles, &completions, statuses);
  if (blocks) queue_.RemoveWaiter();
  outputs->resize(handles.size());
  aux->resize(handles.size());
  for (size_t i = 0; i < handles.size(); ++i) {
    if ((*statuses)[i].ok()) (*statuses)[i] = TakeResult(&completions[i], &(*outputs)[i], &(*aux)[i]);
  }
}

Status Engine::TakeResult(Completion* completion, at::Tensor* output, std::vector<int64_t>* aux) {
  if (!completion->status.ok()) return completion->status;
  if (completion->done_event && completion->output.defined()) {
    // Make the caller's current stream wait for the engine's work, without blocking the CPU.
    c10::Device device = completion->output.device();
    c10::impl::VirtualGuardImpl impl(device.type());
    completion->done_event->block(impl.getStream(device));
  }
  if (completion->write_back.defined()) {  // Note [Inference tensors]
    try {
      // Below the autograd layer, which refuses to write an inference tensor outside inference
      // mode: an inference tensor has no version counter or history for it to keep.
      at::AutoDispatchBelowADInplaceOrView below;
      completion->write_back.copy_(completion->output);
    } catch (const std::exception& e) {
      return Status(StatusCode::kInvalidArgument, std::string("the result could not be written into its tensor: ") + e.what());
    }
    completion->output = std::move(completion->write_back);
  }
  *output = std::move(completion->output);
  *aux = std::move(completion->aux);
  return Status::Ok();
}

bool Engine::SetTimeline(const std::string& path) {
  std::unique_lock<std::mutex> lock(timeline_mu_);
  timeline_path_ = path;
  const uint64_t mine = ++timeline_requested_;
  lock.unlock();
  queue_.Wake();
  lock.lock();
  while (timeline_applied_ < mine) {
    if (stopped_) return false;
    timeline_cv_.wait_for(lock, std::chrono::milliseconds(50));
    queue_.Wake();
  }
  return true;
}

void Engine::ApplyTimelineRequest() {
  std::lock_guard<std::mutex> lock(timeline_mu_);
  if (timeline_applied_ == timeline_requested_) return;
  timeline_.Start(timeline_path_);
  timeline_applied_ = timeline_requested_;
  timeline_cv_.notify_all();
}

void Engine::Shutdown(const std::string& reason, bool reset) {
  {
    std::lock_guard<std::mutex> lock(shutdown_mu_);
    if (!shutdown_requested_ && shutdown_reason_.empty()) {
      shutdown_reason_ = reason;
      shutdown_reset_ = reset;
    }
  }
  shutdown_requested_ = true;
  queue_.Wake();
  std::lock_guard<std::mutex> join_lock(join_mu_);
  if (thread_.joinable()) thread_.join();
}

RankMessage Engine::ComposeMessage() {
  RankMessage mine;
  mine.clock_ms = NowMs();
  mine.base_us = last_exchange_end_us_;  // Note [Submission times]
  if (propagates_signals_) {  // Note [Dump requests]
    const uint64_t signals = DumpSignals();
    if (signals != signals_sent_) mine.flags |= kFlagDump;
    signals_sent_ = signals;
  }
  mine.settings_digest = settings_digest_;
  mine.state_digest = controller_.Digest();
  if (shutdown_requested_) {
    mine.flags |= kFlagShutdown;
    std::lock_guard<std::mutex> lock(shutdown_mu_);
    mine.shutdown_reason = shutdown_reason_;
    if (shutdown_reset_) mine.flags |= kFlagReset;
  }
  // Note [Cached rounds]: what the last cached round held back goes first, as it was taken first.
  mine.requests = std::move(held_);
  held_.clear();
  std::vector<Request> fresh = queue_.TakeNewRequests();
  if (mine.requests.empty()) {
    mine.requests = std::move(fresh);
  } else {
    for (Request& r : fresh) mine.requests.push_back(std::move(r));
  }
  if (!mine.requests.empty() || queue_.HasInFlight()) mine.flags |= kFlagHasOutstanding;
  if (tuner_) {
    mine.flags |= kFlagTuned;
    mine.tuned = tuner_->current();
  }
  return mine;
}

Status Engine::DecodeRound(const std::vector<std::string>& raw, std::vector<RankMessage>* messages) {
  messages->assign(size_, RankMessage());
  std::vector<int> shutting_down;
  std::string why;  // the shutting-down ranks' reasons, as the others will read them
  bool reset = false;  // some rank asked for a reset (kFlagReset)
  for (int r = 0; r < size_; ++r) {
    Status status = DecodeRankMessage(
        raw[r].data(), raw[r].size(), &(*messages)[r],
        [this, r](uint32_t id, Request* out) { return controller_.CacheResolve(r, id, out); });
    if (!status.ok()) {
      return Status::Of(StatusCode::kRankFailure, "", "",
                        "rank " + std::to_string(r) + " sent a malformed control message: " + status.message(),
                        {r});
    }
    const RankMessage& message = (*messages)[r];
    if (message.flags & kFlagDump) {
      std::lock_guard<std::mutex> lock(label_mu_);
      RingDump(label_ + "-r" + std::to_string(rounds_), "rank " + std::to_string(r) + " got a dump signal");
    }
    if (message.flags & kFlagShutdown) {
      shutting_down.push_back(r);
      if (message.flags & kFlagReset) reset = true;
      if (!message.shutdown_reason.empty()) {
        why += (why.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ", which is " +
               message.shutdown_reason;
      }
    }
  }
  if (messages->front().flags & kFlagTuned) params_ = messages->front().tuned;  // Note [Autotune]
  // Note [Submission times]: onto rank 0's clock.
  const int64_t base = messages->front().base_us;
  for (RankMessage& message : *messages) {
    for (Request& request : message.requests) request.submitted_us += base;
  }
  if (shutting_down.empty()) return Status::Ok();
  // Kept until the round is executed: the operations it decided complete first.
  return Status::Of(reset ? StatusCode::kReset : StatusCode::kShutdown, "", "",
                    why.empty() ? "hvdlite was shut down (requested by " + RanksString(shutting_down) + ")"
                                : "hvdlite was shut down by " + why,
                    shutting_down);
}

bool Engine::RunRound(bool* stuck, bool* quiet) {
  if (++rounds_ == config_.test_forget_cache_round) controller_.ForgetCacheForTest();
  RankMessage mine = ComposeMessage();
  const bool debug = logger_.Enabled(LogLevel::kDebug);
  const auto t0 = Clock::now();
  int64_t cache_hits = 0;
  const size_t sent = mine.requests.size();
  const bool recording = recorder_.enabled();
  if (recording) recorder_.SetRoundActivity("negotiating round", rounds_, MonotonicMicros());
  std::vector<RankMessage> messages;
  Status shutdown = Status::Ok();
  size_t sent_bytes = 0;
  // Note [Cached rounds]: a steady round settles by reduction; anything else takes the full one.
  CachedVerdict verdict;
  const bool cached = config_.cached_rounds && config_.cache_capacity > 0 && channel_.reduces() &&
                      CachedRound(&mine, &verdict, &cache_hits);
  int64_t exchanged_us = MonotonicMicros();  // the end of this round's exchange
  const int64_t my_base_us = last_exchange_end_us_;
  if (!cached) {
    held_since_us_ = 0;  // what was held travels in this round's message
    cache_hits = 0;
    std::vector<std::string> raw = channel_.Exchange(EncodeRankMessage(mine, [this, &cache_hits](const Request& r) {
      const int32_t id = controller_.CacheLookup(rank_, r);
      cache_hits += id >= 0;
      return id;
    }));
    exchanged_us = MonotonicMicros();
    sent_bytes = raw[rank_].size();
    Status agreement = CheckDigests(raw);
    if (!agreement.ok()) {
      Stop(agreement);
      return false;
    }
    shutdown = DecodeRound(raw, &messages);
    if (shutdown.code() == StatusCode::kRankFailure) {
      Stop(shutdown);
      return false;
    }
  }
  last_exchange_end_us_ = exchanged_us;
  const auto t1 = Clock::now();
  // The job's clock (rank 0's) now: its end of the previous exchange plus our time since ours.
  const int64_t job_base_us = cached ? verdict.base_us : messages.front().base_us;
  job_clock_ms_ = cached ? verdict.clock_ms : messages.front().clock_ms;
  job_clock_local_ms_ = NowMs();
  RoundResult round = cached ? DecideCached(verdict) : controller_.ProcessRound(std::move(messages));
  if (!round.stall_warning.empty()) logger_.Log(LogLevel::kWarning, round.stall_warning);
  const size_t ready = round.ready.size();
  const int64_t at_us = job_base_us + (exchanged_us - my_base_us);
  if (!round.quiet || !round.stall_warning.empty()) AfterDecisions(round, at_us);
  executor_.SetFusionThreshold(params_.fusion_threshold_bytes);
  std::vector<Batch> batches =
      PlanBatches(std::move(round.ready), params_.fusion_threshold_bytes, executor_.StreamsCpuBatches());
  const auto t2 = Clock::now();
  if (recording) {
    recorder_.RecordNegotiation(std::chrono::duration<double>(t2 - t0).count(), cache_hits,
                                static_cast<int64_t>(sent) - cache_hits, !round.stall_warning.empty());
  }
  if (recording && !batches.empty()) {
    recorder_.RecordDecisions(rounds_, at_us, batches, params_.fusion_threshold_bytes,
                              [this](const Batch& b) { return TransportOf(b); });
  }
  if (timeline_.enabled() && !round.quiet) {
    // Note [Straggler attribution]: the round's last rank and how late it was.
    int last = -1;
    int64_t lag = 0;
    for (const Batch& batch : batches) {
      for (const ReadyItem& item : batch.items) {
        if (item.last_rank >= 0 && item.lag_us >= lag) last = item.last_rank, lag = item.lag_us;
      }
    }
    timeline_.Marker("rounds", "round", MonotonicMicros(),
                     "{\"sent\": " + std::to_string(mine.requests.size()) + ", \"ready\": " +
                         std::to_string(ready) + ", \"batches\": " + std::to_string(batches.size()) +
                         ", \"last_rank\": " + std::to_string(last) + ", \"lag_ms\": " +
                         std::to_string(lag / 1000.0) + "}");
  }
  int64_t moved = 0;
  for (const Batch& batch : batches) {
    const ReadyItem& first = batch.items.front();
    if (recording && !first.inlined)  // Note [Flight record]: what the thread may wait in (inlined data has arrived)
      recorder_.SetActivity(std::string("running ") + KindName(first.request.kind) + " '" + first.request.name + "'" +
                              (batch.items.size() > 1 ? " and " + std::to_string(batch.items.size() - 1) + " more" : "") +
                              " over " + TransportOf(batch),
                          MonotonicMicros());
    executor_.Execute(batch);
    if (!first.inlined) moved += batch.bytes;
  }
  if (recording && !batches.empty()) {
    recorder_.RecordRoundTime(std::chrono::duration<double>(Clock::now() - t0).count());
    recorder_.SetRoundActivity("idle after round", rounds_, MonotonicMicros());
  }
  if (tuner_ && !round.quiet) RecordForAutotune(moved);
  if (debug && !round.quiet) {
    auto us = [](Clock::duration d) {
      return std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(d).count());
    };
    logger_.Log(LogLevel::kDebug, "round: sent " + std::to_string(mine.requests.size()) +
                                      " requests (" + (cached ? std::string("cached") : std::to_string(sent_bytes) + " bytes") + "), " +
                                      std::to_string(ready) + " ready in " +
                                      std::to_string(batches.size()) + " batches; negotiate " +
                                      us(t1 - t0) + " us, plan " + us(t2 - t1) + " us, execute " +
                                      us(Clock::now() - t2) + " us");
  }
  if (!shutdown.ok()) {  // the same test as round.shutdown: some rank's kFlagShutdown
    Stop(shutdown);
    return false;
  }
  *stuck = round.quiet && round.all_outstanding;
  *quiet = round.quiet;
  return true;
}

void Engine::RecordForAutotune(int64_t bytes) {
  const double now = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
  if (!tuner_->Record(bytes, now)) return;
  const AutotuneSample& s = tuner_->samples().back();
  if (!config_.autotune_log_path.empty()) {
    std::ofstream log(config_.autotune_log_path, std::ios::app);
    if (tuner_->samples().size() == 1) {
      log << "phase,fusion_threshold_bytes,cycle_time_ms,bytes,seconds,bytes_per_second\n";
    }
    log << AutotunePhaseName(s.phase) << ',' << s.params.fusion_threshold_bytes << ',' << s.params.cycle_time_ms << ','
        << s.bytes << ',' << s.seconds << ',' << s.BytesPerSecond() << '\n';
    if (tuner_->done()) log << "# " << tuner_->Summary() << '\n';
  }
  logger_.Log(LogLevel::kDebug, std::string("autotune sample (") + AutotunePhaseName(s.phase) + "): threshold " +
                                    std::to_string(s.params.fusion_threshold_bytes) + " bytes, cycle " +
                                    std::to_string(s.params.cycle_time_ms) + " ms: " +
                                    std::to_string(s.BytesPerSecond() / 1e6) + " MB/s");
  if (tuner_->done()) logger_.Announce(tuner_->Summary());
}

Status Engine::CheckDigests(const std::vector<std::string>& raw) const {
  // Note [Agreement digest]. Every rank compares the same bytes, so all reach the same verdict.
  std::vector<uint64_t> settings(size_), state(size_);
  for (int r = 0; r < size_; ++r) {
    if (!PeekDigests(raw[r].data(), raw[r].size(), &settings[r], &state[r])) {
      return Status::Of(StatusCode::kRankFailure, "", "",
                        "rank " + std::to_string(r) + " sent a control message with a malformed header", {r});
    }
  }
  auto differing = [&](const std::vector<uint64_t>& digests) {
    std::vector<int> ranks;
    for (int r = 0; r < size_; ++r) {
      if (digests[r] != digests[0]) ranks.push_back(r);
    }
    return ranks;
  };
  std::vector<int> ranks = differing(settings);
  if (!ranks.empty()) {
    return Status::Of(StatusCode::kMismatch, "", "",
                      "the job-wide settings in force on " + RanksString(ranks) +
                          " differ from rank 0's (every rank must run with rank 0's settings; see the "
                          "README's configuration table); the job cannot continue",
                      ranks);
  }
  ranks = differing(state);
  if (!ranks.empty()) {
    return Status::Of(StatusCode::kMismatch, "", "",
                      "the negotiation state of " + RanksString(ranks) + " diverged from rank 0's by round " +
                          std::to_string(rounds_) +
                          " (the ranks no longer decide alike: a bug in hvdlite); the job cannot continue",
                      ranks);
  }
  return Status::Ok();
}

void Engine::Stop(const Status& status) {
  if (status.code() != StatusCode::kShutdown && status.code() != StatusCode::kReset) logger_.Log(LogLevel::kError, status.message());
  std::vector<Entry> remaining = queue_.Close(status);
  for (Entry& entry : remaining) {
    // Note [Status subjects]: the failure, now about this entry (unless it already was).
    Status failed = status.tensor() == entry.request.name ? status : status.For(KindName(entry.request.kind), entry.request.name);
    handles_.Complete(entry.handle, Completion{failed, {}, nullptr, {}});
  }
  executor_.ReleaseBuffers();
  // `remaining` dies here, outside every lock (Note [GIL and tensor references]).
}

}  // namespace hvdlite
