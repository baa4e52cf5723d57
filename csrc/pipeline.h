// The data plane's shape: a pending work, the window of works in flight, and the one chunk cut.
//
// Every pipelined loop of the data plane (the Gloo channels' staged allreduce, the hierarchical
// route's cross-host chunks, the shared-memory channel's travelling chunk) is the same loop:
// cut a buffer into chunks, start the chunks' collectives as soon as they may start, wait for
// them in order, and on failure wait for every started one before throwing the first error, so
// that no collective still writes into memory the caller is about to free or reuse. This
// header states that loop once; the paths supply what a chunk's start and end mean.
//
// Background thread only (the thread that owns the wire); nothing here locks.
//
// Note [Every path sends the same chunks]
// Ranks of one batch may take different paths through the data plane: in place or out of
// place, fused straight into shared memory or through a fusion buffer, streamed through a
// buffer smaller than the batch or staged whole, from a joined rank's neutral input. Each of
// those is a rank's own decision, made from its own tensors (their layout, whether they
// overlap, their dtype), so two ranks may decide differently for the same batch. They still
// meet on the wire because every path of a route cuts the batch with CutChunks from values
// every rank agrees on (the element count, the element size, the route's constants and its
// channel count, all fixed at init() for the engine's life), runs the same collectives and
// barriers per chunk, and scales at the same points. Where that is not possible (a cast to the
// wire dtype that the single-copy path cannot read in place) the route says so through
// CpuRoute::FusesInPlace before any path is chosen, and that answer depends only on agreed
// values too. A new path must cut with CutChunks and keep the route's per-chunk sequence.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <vector>

namespace hvdlite {

// One asynchronous backend call in flight (c10d's Work in miniature). Empty: nothing to wait
// for (never started, already waited for, or a rank with no part in this step).
class PendingWork {
 public:
  PendingWork() = default;
  // `wait` blocks until the call ended and throws its failure; `done`, where the backend can
  // tell, says without blocking whether it ended.
  explicit PendingWork(std::function<void()> wait, std::function<bool()> done = nullptr)
      : wait_(std::move(wait)), done_(std::move(done)) {}
  explicit operator bool() const { return static_cast<bool>(wait_); }
  // Whether it has ended, without blocking: false where it is empty, where the backend cannot
  // tell, or where the probe itself failed (Wait says why).
  bool Done() const;
  // Blocks until it ended and rethrows its failure; afterwards the work is empty.
  void Wait();

 private:
  std::function<void()> wait_;
  std::function<bool()> done_;
};

// [begin, begin + n) of a buffer cut into chunks.
struct Chunk {
  int64_t begin;
  int64_t n;
};

// The one chunk cut (Note [Every path sends the same chunks]): `total` units in chunks of
// `per`, the first of `first` (0: `per`), the last shorter where it does not divide. A pure
// function of its arguments, so ranks that pass the same values cut the same chunks.
std::vector<Chunk> CutChunks(int64_t total, int64_t per, int64_t first = 0);

// The works of one pipelined call, numbered 0, 1, ... in the order the caller cuts them, on
// `lanes` lanes: work k runs on lane k % lanes, at most one work per lane at a time. A work
// starts once the caller says it is ready (Ready), its lane's work before it has ended, and no
// work has failed; a lane whose work ends starts its next ready work at once, so the lanes
// stay busy while the caller copies. The caller reaps works in its own order (usually k order,
// for copying out); Poll reaps whatever has ended meanwhile. A failure (a start or a wait that
// throws, or one the caller reports with Fail) stops further starts; the first is kept and
// rethrown by Finish or ThrowIfFailed after Drain has waited for every started work.
class WorkWindow {
 public:
  using Start = std::function<PendingWork(int64_t k)>;
  WorkWindow(int64_t count, int64_t lanes, Start start);
  ~WorkWindow();  // drains what is still in flight (never throws)
  WorkWindow(const WorkWindow&) = delete;
  WorkWindow& operator=(const WorkWindow&) = delete;

  // Works [0, through) are ready to start: starts those whose lane is free.
  void Ready(int64_t through);
  // Waits for work k where it is in flight (a failure is kept, not thrown) and starts its
  // lane's next ready work.
  void Reap(int64_t k);
  // Reaps, without blocking, every work in flight that has ended.
  void Poll();
  // Whether work k is in flight and has not ended as far as a probe can tell.
  bool Travelling(int64_t k) const;
  // Whether work k has ended (it was started and reaped).
  bool Ended(int64_t k) const { return ended_[k] != 0; }
  // Reaps every started work; no work starts afterwards.
  void Drain();
  // Keeps `failure` unless one is already kept; no work starts afterwards.
  void Fail(std::exception_ptr failure);
  bool failed() const { return static_cast<bool>(failure_); }
  // Rethrows the kept failure, if any (without draining: see Finish).
  void ThrowIfFailed() const;
  // Every call's last step: reaps every work in order (a lane whose work ends starts its next
  // ready one, unless one failed), then ThrowIfFailed. With no failure every work must have
  // been made ready: one that never started is a std::logic_error.
  void Finish();
  int64_t count() const { return count_; }

 private:
  void TryStart(int64_t k);

  int64_t count_;
  int64_t lanes_;
  Start start_;
  int64_t ready_ = 0;  // works [0, ready_) may start
  std::vector<PendingWork> works_;
  std::vector<char> started_, ended_;
  bool draining_ = false;
  std::exception_ptr failure_;
};

}  // namespace hvdlite
