// When a negotiation round runs and on which thread: the background thread's loop (Note [Cycle
// policy], [Gathering by size]) and a waiting caller running the round itself (Note [A waiting
// caller runs the round]), both through RunRoundHere under drive_mu_.
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <pthread.h>
#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <functional>

#include "engine.h"

namespace hvdlite {
namespace {

constexpr double kActiveHeartbeatMs = 100.0;

// Set while this thread runs a round, and for good on the background thread, so that Python
// code a round sets off (a tensor's last reference dropped, its finalizers) never tries to run
// one inside it, nor to take drive_mu_ that its own thread holds.
thread_local bool t_running_round = false;

Clock::duration Millis(double ms) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(ms));
}

}  // namespace

void Engine::Loop() {
  struct MarkStopped {
    std::atomic<bool>& flag;
    ~MarkStopped() { flag = true; }
  } mark{stopped_};
  t_running_round = true;
  at::NoGradGuard no_grad;
  // The pauses of Note [Cycle policy] are tens of microseconds; the default timer slack
  // (50 us) would more than double them.
  prctl(PR_SET_TIMERSLACK, 1000UL /* ns */);
  // Named for top -H, perf and bench/step_profile.py (at most 15 characters).
  pthread_setname_np(pthread_self(), "hvdlite-engine");
  // Held except while this thread sleeps: a caller that finds it free runs the round itself
  // (Note [A waiting caller runs the round]), so everything the thread does after waking is
  // checked again once it holds the lock.
  std::unique_lock<std::mutex> drive(drive_mu_);
  while (!finished_) {
    ApplyTimelineRequest();  // hvd.start_timeline / stop_timeline
    ServePendingRequest();   // Note [Flight record]
    // Note [Cycle policy]
    const bool has_new = queue_.HasNew();
    const bool waiting = queue_.HasInFlight();
    if (shutdown_requested_) {
      // go now
    } else if (has_new || (waiting && !stuck_)) {
      // Note [A waiting caller ends the gathering]
      const auto next = last_round_ + Millis(params_.cycle_time_ms);
      drive.unlock();
      const bool waited =
          Clock::now() < next && queue_.Pause(next) == TensorQueue::PauseEnd::kWaiter;
      if (has_new && !waited) {
        CoalesceBurst();
        GatherBySize();
      }
      drive.lock();
      if (finished_) break;
      // A caller that waited may have run the round meanwhile.
      if (!shutdown_requested_ && !queue_.HasNew() && !(queue_.HasInFlight() && !stuck_)) continue;
    } else {
      const auto wait = stuck_ ? backoff_ : IdleHeartbeat(Clock::now() - last_busy_);
      const auto due = last_round_end_ + wait;
      drive.unlock();
      queue_.WaitForWork(due);
      drive.lock();
      if (finished_) break;
      if (!shutdown_requested_) {
        // Woken by a push: go back and gather (cycle time, burst) instead of sending it alone.
        if (queue_.HasNew()) continue;
        // Woken early (a timeline or flight-record request, served at the top), or a caller
        // ran a round meanwhile: the heartbeat is not due yet.
        if (Clock::now() < last_round_end_ + wait) continue;
        if (stuck_) backoff_ = std::min(backoff_ * 2, Millis(config_.idle_heartbeat_ms));
      }
    }
    if (!RunRoundHere()) break;
  }
}

bool Engine::RunRoundHere() {
  last_round_ = Clock::now();
  bool keep_going = false, quiet = false, stuck = false;
  // Note [Fatal errors]: nothing leaves the round, whichever thread runs it.
  try {
    keep_going = RunRound(&stuck, &quiet);
  } catch (const StatusError& e) {
    Stop(e.status);
  } catch (const std::exception& e) {
    Stop(Status(StatusCode::kRankFailure,
                std::string("hvdlite lost contact with its peers; the job cannot continue: ") + ExceptionText(e)));
  } catch (...) {
    Stop(Status(StatusCode::kInternal, "the engine thread failed with an unknown exception"));
  }
  last_round_end_ = Clock::now();
  if (!quiet) last_busy_ = last_round_end_;
  stuck_ = stuck;
  if (!stuck) backoff_ = Millis(0.1);
  finished_ = !keep_going;
  return keep_going;
}

// Note [A waiting caller runs the round]
void Engine::RunRoundsWhile(const std::function<bool()>& pending) {
  if (!callers_run_rounds_ || t_running_round) return;
  bool ran = false, wake = false;
  while (pending()) {
    std::unique_lock<std::mutex> drive(drive_mu_, std::try_to_lock);
    if (!drive.owns_lock() || finished_ || shutdown_requested_) break;
    // The last round changed nothing and this rank has nothing new: the background thread
    // backs off instead of this caller spinning rounds.
    // Large or new work, and rounds that grow long-lived tables (the timeline's rows, the
    // tuner's samples), are the background thread's: what the caller allocates would land in
    // its own heap among Python's objects (Note [A waiting caller runs the round]).
    if ((stuck_ && !queue_.HasNew()) || !CallerMayRun()) {
      wake = true;
      break;
    }
    // The round runs as the background thread's do, whatever the caller's own thread state:
    // no autograd, no inference tensors (buffers outlive the call), no autocast, no Python
    // dispatch modes (a TorchDispatchMode the caller entered would see the round's kernels).
    c10::InferenceMode not_inference(false);
    at::NoGradGuard no_grad;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    c10::impl::ExcludeDispatchKeyGuard no_python(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    t_running_round = true;
    ran = true;
    caller_rounds_.fetch_add(1, std::memory_order_relaxed);
    const bool going = RunRoundHere();
    t_running_round = false;
    if (!going) break;  // finished_: the background thread must wake to exit
  }
  // The background thread sleeps through rounds run here; what they leave is its work again.
  // If it holds the lock now, it is awake and looks at the queue before it sleeps.
  if (ran && !wake) {
    std::unique_lock<std::mutex> drive(drive_mu_, std::try_to_lock);
    wake = drive.owns_lock() && (finished_ || queue_.HasInFlight() || queue_.HasNew());
  }
  if (wake) queue_.Wake();
}

bool Engine::CallerMayRun() {
  if (timeline_.enabled() || (tuner_ && !tuner_->done())) return false;
  const int64_t bytes = queue_.InFlightBytes();
  if (bytes <= kCallerRoundMaxBytes) return true;
  return bytes <= kCallerRoundKnownMaxBytes && CallersTakeKnownWork() &&
         queue_.AllInFlight([this](const Entry& e) { return KnownToCallers(e); });
}

bool Engine::CallersTakeKnownWork() const {
  // Over shared memory, and not on the single-copy path (its block is allocated by the first
  // round that takes it), which starts above kCallerRoundKnownMaxBytes unless a test or a
  // benchmark lowers it.
  return shared_memory() && !shm_->SingleCopy(kCallerRoundKnownMaxBytes);
}

bool Engine::KnownToCallers(const Entry& entry) const {
  // A CPU allreduce whose output Python allocated, that this rank sent before exactly so: the
  // round allocates nothing that outlives it (the response cache only moves the entry to the
  // front). Not one that would grow the fusion buffer (a cast on the wire, a non-contiguous
  // tensor).
  return entry.request.kind == CollectiveKind::kAllreduce && entry.input.device().is_cpu() &&
         entry.input.is_contiguous() && entry.output.defined() && entry.output.is_contiguous() &&
         static_cast<c10::ScalarType>(entry.request.dtype) == entry.input.scalar_type() &&
         controller_.CacheLookup(rank_, entry.request) >= 0;
}

bool Engine::AllKnownToCallers(const std::vector<Entry>& entries) {
  if (t_running_round || !CallersTakeKnownWork()) return false;
  std::unique_lock<std::mutex> drive(drive_mu_, std::try_to_lock);
  return drive.owns_lock() && std::all_of(entries.begin(), entries.end(), [this](const Entry& e) { return KnownToCallers(e); });
}

void Engine::CoalesceBurst() {
  // Note [Cycle policy]: a caller that enqueues many tensors in a loop pushes one every few
  // microseconds; starting the round at the first would send it alone and the rest a round
  // later. Pause while pushes keep coming (one arrived during the last pause of kBurstGap), for
  // at most kMaxBurstWait in all. The first pause is unconditional: this thread's own wake-up
  // may have kept the pushing thread off the CPU (on a busy machine they share a core), so a
  // gap measured before pausing says nothing. A waiting caller ends the burst at once (Note
  // [A waiting caller ends the gathering]), so blocking calls never pay for this.
  constexpr auto kBurstGap = std::chrono::microseconds(100);
  constexpr auto kMaxBurstWait = std::chrono::microseconds(4000);
  auto [oldest, newest] = queue_.NewSpan();
  while (!shutdown_requested_) {
    const auto deadline = std::min(Clock::now() + kBurstGap, oldest + kMaxBurstWait);
    if (Clock::now() >= deadline || queue_.Pause(deadline) == TensorQueue::PauseEnd::kWaiter) return;
    const auto latest = queue_.NewSpan().second;
    if (latest == newest) return;  // nothing arrived during the pause: the burst is over
    newest = latest;
  }
}

void Engine::GatherBySize() {
  // Note [Gathering by size]
  if (config_.gather_bytes <= 0 || shutdown_requested_) return;
  const auto deadline = queue_.NewSpan().first + Millis(config_.gather_max_ms);
  // Reached by a push while paused: that push may start a burst, which joins the same round.
  if (queue_.Pause(deadline, config_.gather_bytes) == TensorQueue::PauseEnd::kBytesArrived) {
    CoalesceBurst();
  }
}

Clock::duration Engine::IdleHeartbeat(Clock::duration idle_for) const {
  // Note [Cycle policy]: soon after activity, a short heartbeat keeps a peer's shutdown or
  // stall check prompt; a long-idle engine wakes rarely (each round has a fixed cost in the
  // transport; measured: docs/performance.md, Design measurements).
  const auto slow = Millis(config_.idle_heartbeat_ms);
  return idle_for < std::chrono::seconds(2) ? std::min(slow, Millis(kActiveHeartbeatMs)) : slow;
}

}  // namespace hvdlite
