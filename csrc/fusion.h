// Fusion: the planner that packs ready tensors into batches that one collective can serve,
// and the pool of persistent buffers those batches are packed into.
//
// PlanBatches is pure and deterministic: every rank plans the same ready list into the same
// batches in the same order (Note [Replicated negotiation] in controller.h). The buffer pool
// is the executor's, used only on the thread that runs the round (the background thread, or a
// waiting caller that holds the engine's round lock: Note [A waiting caller runs the round] in
// round_driver.h); no locking.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <tuple>
#include <vector>

#include "ready_item.h"

namespace hvdlite {

struct Batch {
  std::vector<ReadyItem> items;
  int64_t bytes = 0;
};

// Allreduces, reducescatters and broadcasts that agree on dtype, device type, op, root, scale
// factors and joined ranks are fused up to threshold_bytes per batch (a tensor larger than the
// threshold gets a batch of its own). Failed items and other kinds get a batch each. Batches
// are ordered by their first item.
// `cpu_streams`: the CPU route streams batches through a buffer of the threshold's size (Note
// [Streaming a batch through its buffer] in cpu_route.h), so CPU allreduces fuse up to
// kStreamedBatches thresholds.
std::vector<Batch> PlanBatches(std::vector<ReadyItem> ready, int64_t threshold_bytes, bool cpu_streams = false);
constexpr int64_t kStreamedBatches = 4;

int64_t RequestBytes(const Request& request);
int64_t NumElements(const std::vector<int64_t>& shape);

// Note [Persistent fusion buffers]
// Allocating and first touching a large buffer costs several times what copying into a reused
// one does (measured: docs/performance.md, Design measurements), so buffers live for the
// engine's lifetime, one per (device, dtype), grown to the largest batch seen and never shrunk.
class FusionBufferPool {
 public:
  // A flat, contiguous view of `numel` elements; valid until the next Get for the same key.
  at::Tensor Get(c10::Device device, c10::ScalarType dtype, int64_t numel);
  void Clear() { buffers_.clear(); }

 private:
  std::map<std::tuple<int, int, int>, at::Tensor> buffers_;
};

}  // namespace hvdlite
