// When a negotiation round runs: the background thread's loop (Note [Cycle policy], [Gathering
// by size]), and a waiting caller running the round itself (RoundDriver, round_driver.h), both
// through RunRoundHere under the driver's lock.
#include <ATen/core/grad_mode.h>
#include <pthread.h>
#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <functional>

#include "engine.h"

namespace hvdlite {
namespace {

constexpr double kActiveHeartbeatMs = 100.0;

Clock::duration Millis(double ms) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(ms));
}

}  // namespace

void Engine::Loop() {
  struct MarkStopped {
    std::atomic<bool>& flag;
    ~MarkStopped() { flag = true; }
  } mark{stopped_};
  RoundDriver::MarkRoundThread();
  at::NoGradGuard no_grad;
  // The pauses of Note [Cycle policy] are tens of microseconds; the default timer slack
  // (50 us) would more than double them.
  prctl(PR_SET_TIMERSLACK, 1000UL /* ns */);
  // Named for top -H, perf and bench/step_profile.py (at most 15 characters).
  pthread_setname_np(pthread_self(), "hvdlite-engine");
  // Held except while this thread sleeps: a caller that finds it free runs the round itself
  // (Note [A waiting caller runs the round]), so everything the thread does after waking is
  // checked again once it holds the lock.
  std::unique_lock<std::mutex> drive(driver_.mutex());
  while (!driver_.finished()) {
    ApplyTimelineRequest();  // hvd.start_timeline / stop_timeline
    ServePendingRequest();   // Note [Flight record]
    // Note [Cycle policy]
    const bool has_new = queue_.HasNew();
    const bool waiting = queue_.HasInFlight();
    if (shutdown_requested_) {
      // go now
    } else if (has_new || (waiting && !driver_.stuck())) {
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
      if (driver_.finished()) break;
      // A caller that waited may have run the round meanwhile.
      if (!shutdown_requested_ && !queue_.HasNew() && !(queue_.HasInFlight() && !driver_.stuck())) continue;
    } else {
      const auto wait = driver_.stuck() ? backoff_ : IdleHeartbeat(Clock::now() - last_busy_);
      const auto due = last_round_end_ + wait;
      drive.unlock();
      queue_.WaitForWork(due);
      drive.lock();
      if (driver_.finished()) break;
      if (!shutdown_requested_) {
        // Woken by a push: go back and gather (cycle time, burst) instead of sending it alone.
        if (queue_.HasNew()) continue;
        // Woken early (a timeline or flight-record request, served at the top), or a caller
        // ran a round meanwhile: the heartbeat is not due yet.
        if (Clock::now() < last_round_end_ + wait) continue;
        if (driver_.stuck()) backoff_ = std::min(backoff_ * 2, Millis(config_.idle_heartbeat_ms));
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
  driver_.set_outcome(!keep_going, stuck);
  if (!stuck) backoff_ = Millis(0.1);
  return keep_going;
}

// Note [A waiting caller runs the round]
void Engine::RunRoundsWhile(const std::function<bool()>& pending) {
  driver_.RunWhile(pending, [this] { return RunRoundHere(); }, shutdown_requested_);
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
