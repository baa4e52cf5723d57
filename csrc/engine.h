// Engine: one per process set (the global one is created by hvd.init()). Owns the tensor
// queue, the handle table, the controller, the executor and the background thread.
//
// Negotiation rounds, and with them every collective on the control and data process groups,
// run on whichever thread holds the round driver's lock: the
// background thread, or a caller blocked on a handle that the driver lets run it (RoundDriver,
// round_driver.h, Note [A waiting caller runs the round]); so one round at a time, and the
// round's state (controller, executor, channel, timeline) needs no lock of its own. Python
// threads call Enqueue / Poll / Wait / Shutdown with the GIL released; outside the lock they
// touch only the queue and the handle table, each behind its own short-held mutex, the recorder
// (its own mutex) and the fields marked below as under a mutex of their own.
//
// Note [Cycle policy]
// The background thread negotiates when it has new requests, when it still waits on requests
// that other ranks have not matched yet (it then blocks inside the control collective, which
// costs no CPU, until a peer joins the round), when shutdown was asked for, and otherwise once
// per idle heartbeat: every 100 ms for two seconds after the last activity, then every
// HVDLITE_IDLE_HEARTBEAT_MS (default 1 s). A round with new requests waits while a burst of
// pushes is still arriving (a push within every 100 us pause, at most 4 ms), so a loop of async
// calls shares one round instead of sending its first tensor alone. Busy rounds start at least
// HVDLITE_CYCLE_TIME apart, so tensors that arrive close together share a fused collective. Both
// pauses end as soon as a caller blocks on a handle (Note [A waiting caller ends the gathering]
// in tensor_queue.h). When every rank waits on something and a round changed nothing (ranks
// submitted different names), rounds back off exponentially up to the heartbeat instead of
// spinning, until local work arrives.
//
// Note [Inference tensors]
// Rounds run outside inference mode, on whichever thread (Note [A waiting caller runs the
// round]), so that the buffers and results they make are normal tensors; but outside inference
// mode an inference tensor may not be written. So an output that is one (a tensor made under
// torch.inference_mode, an in-place call's tensor or the result Python allocated for a call made
// there) is swapped at Enqueue for a normal tensor of its shape, which the round writes, and the
// result is copied into the caller's tensor when the caller takes it (TakeResult).
//
// Note [Gathering by size]
// Every round costs both Gloo collectives' fixed CPU, taken from a backward pass that shares
// the core. Negotiating each layer's gradients as they appear cost a compute-bound CNN many
// more rounds per step than DDP's buckets, and more CPU per step than DDP (measured:
// docs/performance.md, Design measurements). So after a burst, a round whose new requests add
// up to less than HVDLITE_GATHER_BYTES (default 4 MiB) is held until more arrive, a caller
// waits (the optimizer's step() does; Note [A waiting caller ends the gathering]) or
// HVDLITE_GATHER_MAX_MS (default 100) passes since the oldest of them. Large gradients, which a
// communication-bound model wants on the wire at once, are never held. Holding small rounds so
// brought that CNN's step time and its process CPU per step down to DDP's (measured:
// docs/performance.md, Design measurements).
//
// Note [Fatal errors]
// Some failures make the engine unusable. The thread running the round then completes every
// pending handle with the failure's status and closes the queue, so later calls fail at once
// with the same status, and the background thread exits; the process lives on and every later
// call raises. Nothing escapes the round, whichever thread runs it (an exception leaving the
// background thread would end the process). Three kinds, told apart by their code:
//   - the transport failed (a collective threw: a dead peer, a broken connection) or a peer
//     sent a malformed control message: kRankFailure;
//   - this rank could not take part (Executor reports an exception thrown before its
//     collective started, e.g. out of memory for a fusion buffer): kInternal, naming the
//     operation and the cause; the peers then fail when this rank's transport goes;
//   - the ranks' agreement digests differ (Note [Agreement digest] in controller.h): every
//     rank sees the same digests in the same round, so every rank stops in that round, before
//     deciding anything, with a kMismatch naming the ranks that differ.
// Shutdown by any rank is negotiated: every rank stops after the round in which it is seen,
// failing what is still pending with kShutdown (kReset if a rank asked for a reset).
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "autotune.h"
#include "backend.h"
#include "config.h"
#include "cached_round.h"
#include "control_channel.h"
#include "controller.h"
#include "executor.h"
#include "logging.h"
#include "recorder.h"
#include "round_driver.h"
#include "tensor_queue.h"
#include "timeline.h"

namespace hvdlite {

using Clock = std::chrono::steady_clock;

struct EnqueueArgs {
  std::string name;
  CollectiveKind kind = CollectiveKind::kAllreduce;
  at::Tensor input;
  at::Tensor output;  // undefined for allgather
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::string group;
  std::vector<int64_t> splits;  // alltoall
  // Note [Casting on the wire]: allreduce only; a floating-point input of
  // another dtype travels (and is reduced) as this dtype, and its result is cast back.
  std::optional<c10::ScalarType> wire;
};

class Engine {
 public:
  // `cuda` may be null. The engine starts its thread at once.
  // `cpu` holds one backend per CPU channel, at least one (Note [CPU channels] in cpu_route.h).
  // `control` carries negotiation where shared memory does not: a Gloo group, or the control
  // link (Note [Control link] in control_link.h), which Python made and also holds.
  Engine(const Config& config, int rank, int size, std::shared_ptr<CollectiveBackend> control,
         std::vector<std::unique_ptr<CollectiveBackend>> cpu, std::unique_ptr<CollectiveBackend> cuda,
         std::shared_ptr<ShmChannel> shm = nullptr, std::unique_ptr<CollectiveBackend> cross = nullptr,
         CpuRouteKind route = CpuRouteKind::kGlooChannels);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // All of `args` or none of them; a non-empty group name makes them one grouped operation.
  // `waits_now`: the caller waits on the handles next (Note [A waiting caller runs the round]).
  Status Enqueue(std::vector<EnqueueArgs> args, std::vector<int64_t>* handles, bool waits_now = false);
  Status Poll(int64_t handle, bool* done);
  // `aux`: alltoall's received splits, join's last rank (else empty).
  // Blocks until the handle completes (callers try TryWait first, which does not block).
  Status Wait(int64_t handle, at::Tensor* output, std::vector<int64_t>* aux);
  // Wait's result if the handle has completed (true); false, without blocking, if not.
  bool TryWait(int64_t handle, at::Tensor* output, std::vector<int64_t>* aux, Status* status);
  // Waits for every handle of a group at once (Note [Completing in one step]); statuses[i] is
  // handles[i]'s outcome.
  // `as_caller` false: a helper thread waits (TorchBackend's completion thread), not a caller
  // whose wait should end the gathering or make the shared-memory channel spin (Note [Yield
  // only while a caller waits]).
  void WaitAll(const std::vector<int64_t>& handles, std::vector<at::Tensor>* outputs,
               std::vector<std::vector<int64_t>>* aux, std::vector<Status>* statuses,
               bool as_caller = true);
  // A caller that waits on something the engine will complete, outside Wait/WaitAll (a
  // TorchWork's wait()).
  void AddWaiter() { queue_.AddWaiter(); }
  void RemoveWaiter() { queue_.RemoveWaiter(); }
  // Starts writing the timeline to `path` (empty: stops it); returns once the background thread
  // has switched, false if the engine has stopped.
  bool SetTimeline(const std::string& path);
  // Blocks until the background thread has stopped; idempotent. `reason` travels to the other
  // ranks, whose pending operations then fail quoting it ("exiting after RuntimeError: ...").
  // With `reset` every rank's pending work fails with kReset instead of kShutdown: the code,
  // not the words, tells an elastic worker that it should start again.
  void Shutdown(const std::string& reason = "", bool reset = false);

  // Note [Generated names]: "<prefix>.<n>", n counting every generated name of this engine.
  std::string NewName(const std::string& prefix) { return prefix + "." + std::to_string(name_counter_++); }

  int rank() const { return rank_; }
  int size() const { return size_; }
  const Config& config() const { return config_; }
  bool shared_memory() const { return shm_ != nullptr && !hierarchical_; }
  // Note [A waiting caller runs the round]: how many rounds callers have run (tests).
  uint64_t caller_rounds() const { return driver_.caller_rounds(); }
  // Note [Slots sized by the last rounds] (control_channel.h): for tests.
  const ControlChannel& control_channel() const { return channel_; }
  uint64_t cached_rounds() const { return cached_rounds_.load(); }
  // Note [Single-copy allreduce] (shm_channel.h): for benchmarks and tests; false where the
  // engine has no channel or the probe did not allow it.
  bool SetSingleCopyMin(int64_t min_bytes) { return shared_memory() && shm_->SetSingleCopyMin(min_bytes); }
  bool single_copy() const { return shared_memory() && shm_->single_copy_enabled(); }
  // (barrier waits that yielded, that slept) in this engine's shared-memory channel (tests).
  std::pair<uint64_t, uint64_t> shm_waits() const {
    return shm_ ? std::make_pair(shm_->waits_yielded(), shm_->waits_slept()) : std::make_pair(uint64_t{0}, uint64_t{0});
  }
  // Note [Own share straight from the input] (shm_channel.h): chunks so reduced (tests).
  uint64_t straight_shares() const { return shm_ ? shm_->straight_shares() : 0; }
  // Note [Single-copy allreduce] (shm_channel.h): blocks this rank reduced (tests).
  uint64_t single_copy_blocks() const { return shm_ ? shm_->single_copy_blocks() : 0; }
  bool hierarchical() const { return hierarchical_; }

  // Note [Straggler attribution], [Flight record] and [Metrics]: read by Python threads.
  const Recorder& recorder() const { return recorder_; }
  void set_recording(bool on) { recorder_.set_enabled(on); }
  // Note [Dump requests]: `label` names this engine's dumps ("global", "set1", ...); the
  // global engine also tells the other ranks when this process got a dump signal.
  void SetLabel(const std::string& label, bool propagates_signals);
  // Note [Flight record]: the collectives pending now, from the background thread within
  // `timeout_s`; false (and `pending` untouched) if the thread did not answer in time.
  bool PendingNow(double timeout_s, std::vector<PendingCollective>* pending);

 private:
  // A completed handle's result for its caller (the error it carries, or its output).
  Status TakeResult(Completion* completion, at::Tensor* output, std::vector<int64_t>* aux);
  void Loop();
  // One negotiation round; returns false when the engine must stop.
  bool RunRound(bool* stuck, bool* quiet);
  // RunRound under the driver's lock, on whichever thread holds it, with Note [Fatal errors]'s
  // handling and the state the next round's timing reads; false once the engine has stopped.
  bool RunRoundHere();
  // Note [A waiting caller runs the round]: rounds on the calling thread while `pending` holds
  // and the driver lets it.
  void RunRoundsWhile(const std::function<bool()>& pending);
  // RunRound's steps: this rank's message for the round; every rank's, decoded, with the
  // status the round ends the engine with when a rank shuts down (Ok if none does), or a
  // kRankFailure when a message is malformed.
  RankMessage ComposeMessage();
  Status DecodeRound(const std::vector<std::string>& raw, std::vector<RankMessage>* messages);
  // Note [Cached rounds] (cached_round.h): tries this round as a cached one; true if it was
  // settled so (`verdict`: the ids ready everywhere and their payloads; what `mine` offered
  // that is not ready everywhere moves to held_), false if every rank must run the full round
  // with `mine`. DecideCached decides a settled round.
  bool CachedRound(RankMessage* mine, CachedVerdict* verdict, int64_t* cache_hits);
  RoundResult DecideCached(CachedVerdict& verdict);
  Clock::duration IdleHeartbeat(Clock::duration idle_for) const;
  void CoalesceBurst();
  void GatherBySize();
  void Stop(const Status& status);
  // Note [Agreement digest]: Ok, or the status that stops every rank in this round.
  Status CheckDigests(const std::vector<std::string>& raw) const;
  void MaybeInline(Request* r, const at::Tensor& input, c10::ScalarType wire) const;
  // Note [Autotune]: feeds rank 0's tuner after a round that moved `bytes`.
  void RecordForAutotune(int64_t bytes);

  const Config config_;
  const int rank_;
  const int size_;
  Logger logger_;
  std::shared_ptr<CollectiveBackend> control_backend_;
  std::vector<std::unique_ptr<CollectiveBackend>> cpu_backends_;
  std::unique_ptr<CollectiveBackend> cuda_backend_;
  std::shared_ptr<ShmChannel> shm_;  // null unless every rank is on this host (Note [Shared-memory allreduce])
  std::unique_ptr<CollectiveBackend> cross_;  // Note [Hierarchical allreduce]: first rank of a host only
  const bool hierarchical_;
  TensorQueue queue_;
  HandleTable handles_;
  Timeline timeline_;
  ControlChannel channel_;
  Controller controller_;
  Executor executor_;
  const uint64_t settings_digest_;    // Note [Job-wide settings] in config.h
  int64_t rounds_ = 0;
  TunedParams params_;                // in effect this round: rank 0's (Note [Autotune])
  std::unique_ptr<Autotuner> tuner_;  // rank 0 with HVDLITE_AUTOTUNE=1 only
  std::atomic<bool> shutdown_requested_{false};
  void ApplyTimelineRequest();
  void ServePendingRequest();
  // Note [Metrics]: the way `batch` travels ("shared_memory", "gloo", "inline", ...).
  std::string TransportOf(const Batch& batch) const;
  // After a round that decided something: dumps for stalls, the straggler line.
  void AfterDecisions(const RoundResult& round, int64_t at_us);
  Recorder recorder_;
  int64_t last_exchange_end_us_ = 0;  // Note [Submission times]
  // Note [Cached rounds]: requests a cached round held back (they go first in the next round's
  // message), since when (0: none), and for how long at most before a full round takes them.
  static constexpr int64_t kHoldMs = 100;
  std::vector<Request> held_;
  int64_t held_since_us_ = 0;
  std::atomic<uint64_t> cached_rounds_{0};  // decided so (tests read it from any thread)
  int64_t job_clock_ms_ = 0, job_clock_local_ms_ = 0;  // rank 0's clock at the last round, and ours
  uint64_t signals_sent_ = 0;          // Note [Dump requests]
  std::mutex label_mu_;
  std::string label_ = "engine";       // under label_mu_
  std::atomic<bool> propagates_signals_{false};
  int64_t last_straggler_line_ms_ = 0;
  std::mutex pending_mu_;
  std::condition_variable pending_cv_;
  uint64_t pending_requested_ = 0, pending_served_ = 0;  // under pending_mu_
  std::vector<PendingCollective> pending_view_;         // under pending_mu_
  std::mutex timeline_mu_;
  std::condition_variable timeline_cv_;
  std::string timeline_path_;              // under timeline_mu_
  uint64_t timeline_requested_ = 0, timeline_applied_ = 0;  // under timeline_mu_
  std::atomic<bool> stopped_{false};       // the background thread has exited
  // Note [A waiting caller runs the round]: whoever holds the driver's lock runs rounds; the
  // rest of this block is under it.
  RoundDriver driver_;
  Clock::duration backoff_ = std::chrono::microseconds(100);
  Clock::time_point last_round_ = Clock::now() - std::chrono::hours(1);  // when the last round started
  Clock::time_point last_round_end_ = Clock::now();
  Clock::time_point last_busy_ = Clock::now();  // the end of the last round that was not quiet
  std::mutex shutdown_mu_;
  std::mutex join_mu_;  // Shutdown may be called from two threads (elastic notice, shutdown())
  std::string shutdown_reason_;  // under shutdown_mu_; set before shutdown_requested_
  bool shutdown_reset_ = false;   // under shutdown_mu_, with shutdown_reason_
  // Note [Generated names]
  // An operation without a name gets one from its engine: the engine's counter is the one
  // sequence that numbers every unnamed operation of the process set, those enqueued unnamed
  // here ("hvdlite.noname.<n>") and the composite ones Python names before enqueuing (a group,
  // a barrier, an Adasum or sparse allreduce: Engine.new_name). Ranks that issue the same
  // unnamed calls in the same order so generate the same names.
  std::atomic<int64_t> name_counter_{0};
  std::thread thread_;
};

}  // namespace hvdlite
