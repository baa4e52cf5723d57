// RoundDriver: which thread runs an engine's next negotiation round, and the lock that makes
// rounds run one at a time.
//
// Contract: a round (and with it every collective on the engine's control and data process
// groups) runs only on the thread that holds mutex(): the engine's background thread, which
// holds it except while it sleeps, or a caller blocked on a handle that RunWhile lets run it.
// The round's state (controller, executor, channel, timeline) is therefore touched by one
// thread at a time and needs no lock of its own. finished() and stuck() are the last round's
// outcome, read and written under mutex(). CallerTakes and RunWhile may be called from any
// thread that does not hold mutex(); they only try it. The engine owns the driver and the
// collaborators it reads (queue, controller, channel, timeline, tuner), all outliving it.
//
// Note [A waiting caller runs the round]
// A blocking call handed its round to the background thread and took it back: the push woke
// the thread, the thread ran the round and completed the handle, and that woke the caller. A
// tiny allreduce so took many times a shared-memory ping-pong between the two processes,
// nearly all of it the two wake-ups (and the extra thread competing for the cores while the
// peer's caller waits) (measured: docs/performance.md, Design measurements). So whichever
// thread holds the lock runs rounds: the background thread holds it except while it sleeps,
// and a caller that blocks on a handle (Wait, WaitAll) and finds it free runs rounds itself
// until its handles complete (RunWhile). A call that waits at once (hvd.allreduce and
// hvd.allreduce_, through Enqueue's `waits_now`) pushes without waking the thread
// (CallerTakes). The ranks do not care which thread runs a round: rounds pair up by their
// order on each rank. A caller stops running rounds when the lock is busy, at shutdown, and
// when a round changed nothing (its peers have not caught up: the background thread's
// back-off takes over); it wakes the thread if work is left.
// Its allocations are the catch: they land in the caller's heap (glibc's main arena, among
// Python's objects and the script's tensors), and whatever outlives the call there pins that
// heap's pages: in tests/reliability's soak, caller rounds for work of any size grew the
// resident size with the C heap in use flat (measured: docs/performance.md, Design
// measurements). The soak names every operation anew, so each of its rounds leaves state that
// outlives it: the name's response-cache entry (every rank's request). So a caller runs the
// round (CallerMayRun) only while
//   - at most kMaxBytes (4 KiB) are in flight on the rank, or
//   - at most kKnownMaxBytes (4 MB) are, every one of them a CPU allreduce over shared
//     memory, its output allocated by Python, that this rank sent before exactly so (a response
//     cache hit, Known): a training loop's steady state, whose round allocates nothing
//     that outlives it (ResponseCache::Record moves a known name's node, no allocation), unless
//     a peer sends a name this rank has not (its pending entry waits for this rank's request);
//     not with a cast on the wire or a non-contiguous tensor (the fusion buffer would grow) nor
//     where single copy starts at or below 4 MB (its block is allocated by its first round);
// and never while rounds grow long-lived tables: the timeline's rows (a row per tensor name) and
// the tuner's samples. A training-like loop whose callers run every round up to 3 MB
// (tests/reliability/test_caller_rounds_steady.py) shows no upward trend in resident size, and
// a 1 MB allreduce run by its caller comes closer to the staged memory floor than one handed to
// the background thread, whose handoff costs two wake-ups (more where a vCPU had gone idle)
// (measured: docs/performance.md, Design measurements). CallerTakes skips waking the thread
// for such work too (AllKnown, looked at only if the lock is free).
// The per-round state that lives on is written in place (Recorder::NextRound) and an inlined
// allreduce allocates nothing (Note [Inline reduce in place]). The background thread looks at the
// queue again whenever it takes the lock back, and skips a heartbeat that a caller's round made
// unnecessary. HVDLITE_CALLER_ROUNDS=0 turns it off; never where CUDA is on (the CUDA work runs on
// the background thread's streams).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "tensor_queue.h"

namespace hvdlite {

class Autotuner;
class Controller;
class ShmChannel;
class Timeline;

class RoundDriver {
 public:
  // `enabled`: callers may run rounds at all (HVDLITE_CALLER_ROUNDS, and no CUDA backend).
  // `shm`: the engine's shared-memory channel where CPU allreduces go through it, else null.
  RoundDriver(bool enabled, int rank, TensorQueue* queue, const Controller* controller, const ShmChannel* shm,
              const Timeline* timeline);
  void set_tuner(const Autotuner* tuner) { tuner_ = tuner; }

  std::mutex& mutex() { return mu_; }
  // The last round's outcome (under mutex()): the engine stopped; the round changed nothing
  // while every rank waited (Note [Cycle policy] in engine.h).
  bool finished() const { return finished_; }
  bool stuck() const { return stuck_; }
  void set_outcome(bool finished, bool stuck) {
    finished_ = finished;
    stuck_ = stuck;
  }

  // Whether the caller enqueuing `entries` (`bytes` in all) and about to wait on them
  // (`waits_now`) runs their round itself, so the push need not wake the background thread.
  bool CallerTakes(const std::vector<Entry>& entries, int64_t bytes, bool waits_now);
  // Runs rounds (`run_round`, which returns false once the engine stopped) on the calling
  // thread while `pending` holds, the lock is free, `stopping` is false and the policy allows;
  // wakes the background thread for what is left.
  void RunWhile(const std::function<bool()>& pending, const std::function<bool()>& run_round,
                const std::atomic<bool>& stopping);

  // Marks the calling thread as one that runs rounds for good (the background thread), so that
  // Python code a round sets off never tries to run one inside it.
  static void MarkRoundThread();
  // Rounds run by waiting callers (tests read it from any thread).
  uint64_t caller_rounds() const { return caller_rounds_.load(); }

 private:
  static constexpr int64_t kMaxBytes = 4 << 10;
  static constexpr int64_t kKnownMaxBytes = 4 << 20;
  // Under the lock: whether a caller may run the next round; whether this engine lets callers
  // run known work above kMaxBytes, and whether an entry is such work.
  bool CallerMayRun() const;
  bool TakesKnownWork() const;
  bool Known(const Entry& entry) const;
  // Whether every one of `entries` is Known, looked at under the lock if it is free (false if not).
  bool AllKnown(const std::vector<Entry>& entries);

  const bool enabled_;
  const int rank_;
  TensorQueue* const queue_;
  const Controller* const controller_;
  const ShmChannel* const shm_;
  const Timeline* const timeline_;
  const Autotuner* tuner_ = nullptr;  // rank 0 with HVDLITE_AUTOTUNE=1 only
  std::mutex mu_;
  bool finished_ = false;  // under mu_
  bool stuck_ = false;     // under mu_
  std::atomic<uint64_t> caller_rounds_{0};
};

}  // namespace hvdlite
