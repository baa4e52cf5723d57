#include "fusion.h"

#include <ATen/ops/empty.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <limits>

namespace hvdlite {
namespace {

bool Fusable(const ReadyItem& item) {
  const CollectiveKind kind = item.request.kind;
  return item.status.ok() && !item.inlined && (kind == CollectiveKind::kAllreduce || kind == CollectiveKind::kBroadcast ||
                              kind == CollectiveKind::kReducescatter);
}

bool SameBatchKey(const ReadyItem& x, const ReadyItem& y) {
  const Request& a = x.request;
  const Request& b = y.request;
  return a.kind == b.kind && a.dtype == b.dtype && a.device_type == b.device_type &&
         a.op == b.op && a.root == b.root && a.prescale == b.prescale &&
         a.postscale == b.postscale && x.joined == y.joined;
}

}  // namespace

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t RequestBytes(const Request& request) {
  return NumElements(request.shape) *
         static_cast<int64_t>(c10::elementSize(static_cast<c10::ScalarType>(request.dtype)));
}

std::vector<Batch> PlanBatches(std::vector<ReadyItem> ready, int64_t threshold_bytes, bool cpu_streams) {
  std::vector<Batch> batches;
  std::vector<size_t> open;  // indices of batches that may still take items
  const int64_t streamed = threshold_bytes > std::numeric_limits<int64_t>::max() / kStreamedBatches
                               ? std::numeric_limits<int64_t>::max()
                               : threshold_bytes * kStreamedBatches;
  for (ReadyItem& item : ready) {
    const int64_t bytes = item.status.ok() ? RequestBytes(item.request) : 0;
    // Note [Streaming a batch through its buffer]
    const bool streams = cpu_streams && item.request.kind == CollectiveKind::kAllreduce &&
                         item.request.device_type == static_cast<int8_t>(c10::DeviceType::CPU);
    const int64_t limit = streams ? streamed : threshold_bytes;
    Batch* target = nullptr;
    if (Fusable(item)) {
      for (auto it = open.rbegin(); it != open.rend(); ++it) {
        Batch& candidate = batches[*it];
        if (SameBatchKey(candidate.items.front(), item) && candidate.bytes + bytes <= limit) {
          target = &candidate;
          break;
        }
      }
    }
    if (target == nullptr) {
      batches.emplace_back();
      target = &batches.back();
      if (Fusable(item)) open.push_back(batches.size() - 1);
    }
    target->bytes += bytes;
    target->items.push_back(std::move(item));
  }
  return batches;
}

at::Tensor FusionBufferPool::Get(c10::Device device, c10::ScalarType dtype, int64_t numel) {
  auto key = std::make_tuple(static_cast<int>(device.type()), static_cast<int>(device.index()),
                             static_cast<int>(dtype));
  at::Tensor& buffer = buffers_[key];
  if (!buffer.defined() || buffer.numel() < numel) {
    buffer = at::Tensor();  // free the old buffer before allocating the larger one
    buffer = at::empty({numel}, at::TensorOptions().device(device).dtype(dtype));
  }
  return buffer.narrow(0, 0, numel);
}

}  // namespace hvdlite
