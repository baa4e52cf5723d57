// ControlChannel: the control plane's one primitive, "everyone's bytes", built on a CPU (Gloo)
// CollectiveBackend reserved for negotiation.
//
// Each rank sends a fixed slot holding its length and, when it fits, its bytes: one collective
// per round in the common case. When any message is larger than a slot, a second exchange at
// the largest size carries everything.
//
// Note [Control exchange by alltoall]
// The slot exchange is an alltoall in which every rank sends its own slot to every rank, not
// an allgather, although both deliver the same bytes: Gloo runs alltoall as direct pairwise
// transfers that all happen at once, and allgather as a ring of size - 1 sequential steps. On
// the 2-rank loopback reference machine a 2 KiB slot took 0.33-0.43 ms by alltoall against
// 0.57-0.76 ms by allgather (a 1-float allreduce: 0.42 ms); the round is the whole cost of a
// small collective, so this is the latency of every tiny allreduce. The rare oversized second
// exchange stays an allgather, which moves size times fewer bytes per rank.
// Background thread only; reuses its tensors across rounds.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "backend.h"
#include "shm_channel.h"

namespace hvdlite {

class ControlChannel {
 public:
  // Note [Control exchange through shared memory] (shm_channel.h): with `shm`, slots travel
  // through it (an engine whose ranks all share one host), else through `backend`.
  ControlChannel(CollectiveBackend* backend, ShmChannel* shm, int size);
  // Every rank calls this once per round; returns every rank's bytes, indexed by rank.
  std::vector<std::string> Exchange(const std::string& mine);

 private:
  // Every message at the longest length, by Gloo allgather (a message did not fit in a slot).
  std::vector<std::string> ExchangeLarge(const std::string& mine, const std::vector<int64_t>& lengths);

  // Fits a training step's worth of cached requests (Note [Response cache]) for ~200 tensors.
  static constexpr int64_t kSlotBytes = 2048;
  static constexpr int64_t kHeaderBytes = 8;
  CollectiveBackend* backend_;
  ShmChannel* shm_;  // owned by the engine; may be null
  int size_;
  std::vector<int64_t> slot_splits_;  // kSlotBytes for every rank
  at::Tensor send_;                   // this rank's slot, once per destination rank
  at::Tensor receive_;
};

}  // namespace hvdlite
