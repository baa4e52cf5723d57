// ShmSegment: the shared-memory segment the ranks of one host meet in, and the barrier they
// meet at. It owns the mapping, the layout and the ranks' liveness; the algorithms that move
// data through it live in ShmChannel (shm_channel.h), which holds one segment.
//
// Contract: every rank of the segment calls Barrier() the same number of times, in the same
// order, from one thread at a time (whichever thread runs the engine's rounds; Note [A waiting
// caller runs the round] in round_driver.h). Barrier() throws std::runtime_error naming the engine rank
// of a peer that exited, aborted (Abort(), or a destroyed segment) or did not arrive within the
// timeout; nothing else blocks. The wait counters may be read from any thread.
//
// Layout: a header page (the words of Header, the single-copy claim counter on its own cache
// line, then one 64-byte line per rank holding its arrival counter and its Inside word), the
// control banks (two banks of kControlSlot per rank, Note [Control exchange through shared
// memory] in shm_channel.h), then two data banks, each holding one slot per rank and one result
// area of chunk_bytes() (4 MB, less for many ranks, so the segment stays near 32 MB), then,
// for at most kMailboxMaxRanks ranks, the point-to-point mailboxes (Note [Point-to-point
// through shared memory] in shm_point_to_point.h), which ShmPointToPoint lays out.
//
// Note [Barrier waits]
// A barrier wait spins briefly (20 us); then, while a caller of this rank waits on a handle
// (Note [Yield only while a caller waits]), it keeps spinning but calls sched_yield every 64
// spins until 500 us have passed since the wait began (one budget for the whole wait, however
// many peers it waits for); then, or at once when no caller waits, it sleeps on a futex in the
// segment. The yielding phase is there because waking a sleeper is slow where cores idle: a
// barrier whose peer was already there takes far longer when the waiter had gone to sleep (its
// idle vCPU has to be woken) than when it yielded (measured: docs/performance.md, Design
// measurements). A sleeping rank wakes every kCheckMs to check that the ranks it waits for are
// alive (their pids, which all live on this host); a rank that exited makes this one throw
// naming it (the engine then reports a rank failure, as for a broken Gloo connection). A rank
// that fails inside the segment sets the abort word, so the others throw at once instead of
// waiting. A rank that is alive but never arrives is given the segment's timeout: the
// process-group timeout, or the stall shutdown time when that is shorter
// (hvdlite/_runtime/groups.py, _channel_timeout), and the error says whether its process is
// stopped.
//
// Note [Yield only while a caller waits]
// Yielding is cheap only when the core has nothing better to run. A round that overlaps the
// backward pass (nobody waits on a handle yet) shares the core with the rank's own compute,
// and there sched_yield often gives nothing back: a scheduler that keeps fair time (EEVDF)
// can pick the waiting thread again, since it slept while the compute ran and so is owed
// time, and the compute stays preempted for the whole wait (measured: docs/performance.md,
// Design measurements). So the engine passes the count of waiting callers
// (TensorQueue::waiting), and a wait yields only while it is above zero: when a caller blocks,
// its core is free and the peer's arrival is what everyone waits for.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace hvdlite {

class ShmSegment {
 public:
  // Creates (rank 0's job) a zero-filled segment for `size` ranks under `name` (a POSIX shared
  // memory name such as "/hvdlite.123.abc"); the pages are reserved now, so a full /dev/shm is
  // an error here instead of a SIGBUS later. Returns "" or what went wrong.
  // `chunk_bytes` 0: ChunkBytes(size); the hierarchical allreduce passes its own.
  static std::string Create(const std::string& name, int size, int64_t chunk_bytes = 0);
  static void Unlink(const std::string& name);
  static size_t Bytes(int size, int64_t chunk_bytes = 0);

  // Maps the segment; throws std::runtime_error when it cannot. `rank` and `size` index the
  // ranks sharing the segment; `ranks[i]` is what messages call the i-th (its engine rank) and
  // `pids[i]` its process.
  ShmSegment(const std::string& name, int rank, int size, std::vector<int64_t> ranks, std::vector<int64_t> pids,
             double timeout_seconds, int64_t chunk_bytes = 0);
  // Aborts (anyone still waiting on this rank fails now) and unmaps.
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The engine rank of the segment's i-th rank, and its process.
  int64_t engine_rank(int i) const { return ranks_[i]; }
  int64_t pid(int i) const { return pids_[i]; }
  const std::vector<int64_t>& engine_ranks() const { return ranks_; }
  int64_t chunk_bytes() const { return chunk_; }

  // The areas. Banks are 0 or 1; `rank` indexes the segment's ranks.
  static constexpr int64_t kControlSlot = 64LL << 10;
  char* ControlSlot(int bank, int rank) const;
  char* Slot(int bank, int rank) const;
  char* Result(int bank) const { return Slot(bank, size_); }
  // The point-to-point mailboxes' area (MailboxBytes(size()) bytes), or null past kMailboxMaxRanks.
  static constexpr int kMailboxMaxRanks = 32;
  static size_t MailboxBytes(int size);
  char* Mailbox() const;
  // False once `pid` has exited (a zombie has exited too); true when unsure.
  static bool Running(int64_t pid);
  // "(hung: its process P is alive)" or "(its process P is stopped: ...)", for timeouts.
  static std::string Why(int64_t pid);

  // Note [Barrier waits]. Throws as the contract says; the caller aborts if it gives up.
  void Barrier();
  // Tells every peer that this rank gave up (their barriers throw naming it), and wakes them.
  void Abort();
  // Throws naming the rank that aborted, if one has.
  void ThrowIfAborted() const;

  // Note [Single-copy allreduce] (shm_channel.h): the next block to claim, and whether `rank`
  // may still read or write its peers' tensors (the word after its arrival counter).
  std::atomic<uint64_t>& Claims() const;
  std::atomic<uint32_t>& Inside(int rank) const;
  // After this rank failed inside a single-copy allreduce: waits (at most 10 s) until every
  // peer that is alive and not stopped has left it, so none writes into tensors this rank is
  // about to free.
  void AwaitPeersOut() const;

  // Note [Yield only while a caller waits]: `count` > 0 lets barrier waits yield before they
  // sleep; null: always yield. Read only inside barrier waits: whoever passes it keeps it alive
  // while rounds run (the engine sets it before starting its thread and clears it after joining).
  void YieldWhile(const std::atomic<int>* count) { callers_waiting_ = count; }
  // Barrier waits that yielded and that slept at least once, since the segment was mapped.
  uint64_t waits_yielded() const { return waits_yielded_.load(); }
  uint64_t waits_slept() const { return waits_slept_.load(); }

 private:
  static constexpr size_t kClaimsAt = 64, kArrivalsAt = 128;
  struct Header {
    std::atomic<uint32_t> futex;    // bumped by every arrival; sleepers wait on it
    std::atomic<int32_t> sleepers;  // ranks asleep (or about to be) on `futex`
    std::atomic<int32_t> abort;     // 0, or 1 + the rank that gave up
  };
  static size_t HeaderBytes(int size);
  static size_t ControlBytes(int size) { return 2 * static_cast<size_t>(size) * kControlSlot; }
  static int64_t ChunkBytes(int size);
  std::atomic<uint64_t>& Arrived(int rank) const;
  void Wait(uint64_t target);

  std::string name_;
  int rank_;
  int size_;
  std::vector<int64_t> ranks_;
  std::vector<int64_t> pids_;
  double timeout_seconds_;
  size_t bytes_ = 0;
  int64_t chunk_ = 0;
  void* base_ = nullptr;
  Header* header_ = nullptr;
  uint64_t barriers_ = 0;  // barriers this rank has completed
  const std::atomic<int>* callers_waiting_ = nullptr;  // Note [Yield only while a caller waits]
  std::atomic<uint64_t> waits_yielded_{0};
  std::atomic<uint64_t> waits_slept_{0};
};

}  // namespace hvdlite
