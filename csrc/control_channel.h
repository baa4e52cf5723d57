// ControlChannel: the control plane's one primitive, "everyone's bytes", built on a CPU (Gloo)
// CollectiveBackend reserved for negotiation, or on the shared-memory channel where every rank
// shares the host. Exchange is called once per round by every rank, on whichever thread runs
// the round (the background thread, or a waiting caller that holds the engine's round lock: Note
// [A waiting caller runs the round] in round_driver.h), so one exchange at a time; it takes no lock
// and reuses its tensors across rounds. Its counters for tests are atomics, read from any
// thread.
//
// Across hosts the backend is normally the control link (Note [Control link] in
// control_link.h), which has point-to-point only: every round then travels by recursive
// doubling over it (Note [Control exchange by hypercube] in hypercube.h). On a Gloo group
// (HVDLITE_CONTROL_LINK=0), up to HVDLITE_CONTROL_ALLTOALL_MAX ranks (16 by default), each rank
// sends a slot holding its length and, when it fits, its bytes: one collective per round in
// the common case. When any message is larger than a slot,
// a second exchange at the largest size carries everything. Past it the messages
// travel by recursive doubling instead (Note [Control exchange by hypercube] in hypercube.h):
// log2(N) steps and partners, where an alltoall costs every rank N - 1 messages and a
// connection to every peer. Measured side by side on namespace hosts (docs/performance.md,
// "Scale: the control plane across hosts"), the alltoall's one collective is quicker up to 16
// hosts and the hypercube from 32: each of its steps is a Gloo operation of its own, and a
// chain of thread hand-offs per operation costs more than the alltoall's extra messages until
// those number about 30. The same count decides on every rank (the job's size).
//
// Note [Control exchange by alltoall]
// The slot exchange is an alltoall in which every rank sends its own slot to every rank, not
// an allgather, although both deliver the same bytes: Gloo runs alltoall as direct pairwise
// transfers that all happen at once, and allgather as a ring of size - 1 sequential steps, so
// the alltoall ends sooner (measured: docs/performance.md, Design measurements). The round is
// the whole cost of a small collective, so this is the latency of every tiny allreduce. The
// rare oversized second exchange stays an allgather, which moves size times fewer bytes per
// rank.
//
// Note [Slots sized by the last rounds]
// A fixed 2 KiB slot held a step's cached requests but not a ResNet-50 step across hosts: 161
// cached requests and the 30 bias and norm tensors' inlined bytes make a 12 KB message, and 161
// one-float tensors 2.8 KB. Each such round paid the second exchange, a whole extra round trip
// (measured: docs/performance.md, Design measurements). Every rank receives every length, so
// every rank can size the next round's slot the same way without another word: the longest
// message plus an eighth, in whole KiB, at once when a round needs more, and back down only
// after kCalmRounds rounds in a row that would all have fitted a smaller slot, so a training
// step's big round keeps its slot through the small rounds between steps. The slot stays
// between 2 KiB and kRoundBytes / size, so a round never sends more than kRoundBytes per rank
// in slots (the hypercube: the buffers it posts): a large job keeps 2 KiB, and past the cap the
// second exchange (the hypercube: second transfers) is back.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <string>
#include <vector>

#include "backend.h"
#include "hypercube.h"
#include "shm_channel.h"

namespace hvdlite {

// Note [Slots sized by the last rounds]: the slot, in bytes with its header, that every rank
// computes alike from the lengths that every rank received.
class SlotSizer {
 public:
  static constexpr int64_t kMinSlotBytes = 2048;
  static constexpr int64_t kRoundBytes = 128 << 10;
  static constexpr int kCalmRounds = 32;

  explicit SlotSizer(int size);
  int64_t slot() const { return slot_; }
  // After a round whose messages were `lengths` bytes long; returns the next round's slot.
  int64_t Next(const std::vector<int64_t>& lengths);

 private:
  int64_t cap_;
  int64_t slot_ = kMinSlotBytes;
  int calm_ = 0;  // rounds in a row that a smaller slot would have held
};

class ControlChannel {
 public:
  // Note [Control exchange through shared memory] (shm_channel.h): with `shm`, slots travel
  // through it (an engine whose ranks all share one host), else through `backend` (a Gloo
  // group, or the control link: Note [Control link] in control_link.h).
  // `alltoall_max`: the largest size that exchanges by alltoall (HVDLITE_CONTROL_ALLTOALL_MAX).
  ControlChannel(CollectiveBackend* backend, ShmChannel* shm, int rank, int size, int64_t alltoall_max);
  // Every rank calls this once per round; returns every rank's bytes, indexed by rank.
  std::vector<std::string> Exchange(const std::string& mine);
  // The ranks whose connections a channel over `backend` (no shared memory) uses, for `rank`:
  // every other rank by alltoall, its partners by hypercube. init() reads their addresses in
  // one store request (Note [Group addresses in two requests], hvdlite/_runtime/group_store.py).
  static std::vector<int> Peers(int rank, int size, int64_t alltoall_max);
  // Note [Cached rounds] (cached_round.h): whether this channel can combine every rank's bytes
  // by reduction (recursive doubling, without shared memory), and the reduction itself.
  bool reduces() const { return shm_ == nullptr && !by_alltoall_; }
  std::string Reduce(const std::string& mine, const Hypercube::Combine& combine);
  // For tests: rounds exchanged through the backend, how many of them needed the second
  // exchange (the hypercube: carried a message longer than its slot), and the slot the next
  // round sends. Read from any thread.
  uint64_t rounds() const { return rounds_.load(); }
  uint64_t second_exchanges() const { return second_exchanges_.load(); }
  int64_t slot_bytes() const { return slot_now_.load(); }
  uint64_t reductions() const { return reductions_.load(); }

 private:
  // Note [Control exchange by hypercube]: past alltoall_max ranks.
  std::vector<std::string> ExchangeByHypercube(const std::string& mine);
  // Every message at the longest length, by Gloo allgather (a message did not fit in a slot).
  std::vector<std::string> ExchangeLarge(const std::string& mine, const std::vector<int64_t>& lengths);

  // The slot tensors for sizer_'s current slot.
  void Resize();

  static constexpr int64_t kHeaderBytes = 8;
  CollectiveBackend* backend_;
  ShmChannel* shm_;  // owned by the engine; may be null
  int size_;
  bool by_alltoall_;
  SlotSizer sizer_;
  Hypercube cube_;
  int64_t slot_bytes_ = 0;            // the slot that send_ and receive_ hold
  std::vector<int64_t> slot_splits_;  // slot_bytes_ for every rank
  at::Tensor send_;                   // this rank's slot, once per destination rank
  at::Tensor receive_;
  std::atomic<uint64_t> rounds_{0}, second_exchanges_{0}, reductions_{0};
  std::atomic<int64_t> slot_now_{0};
};

}  // namespace hvdlite
