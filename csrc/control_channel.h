// ControlChannel: the control plane's one primitive, "everyone's bytes", built on the
// allgather of a CPU (Gloo) CollectiveBackend reserved for negotiation.
//
// Gloo's allgather needs equal sizes, so each rank sends a fixed slot holding its length and,
// when it fits, its bytes: one collective per round in the common case. When any message is
// larger than a slot, a second allgather of the largest size carries everything.
// Background thread only; reuses its tensors across rounds.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "backend.h"

namespace hvdlite {

class ControlChannel {
 public:
  ControlChannel(CollectiveBackend* backend, int size);
  std::vector<std::string> Allgather(const std::string& mine);

 private:
  // Fits a training step's worth of cached requests (Note [Response cache]) for ~200 tensors.
  static constexpr int64_t kSlotBytes = 2048;
  static constexpr int64_t kHeaderBytes = 8;
  CollectiveBackend* backend_;
  int size_;
  at::Tensor send_;
  at::Tensor receive_;
  std::vector<at::Tensor> receive_slots_;
};

}  // namespace hvdlite
