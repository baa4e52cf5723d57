#include "executor.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>

#include <cstring>

#include "kernels.h"

namespace hvdlite {

// Note [Inline small tensors]: every rank computes the result from everyone's bytes, in rank
// order, so every rank gets the same result without a data collective.
void Executor::FromPayloads(Local& local) {
  const ReadyItem& item = *local.item;
  const Request& request = item.request;
  const at::Tensor& input = local.entry.input;
  // Note [Casting on the wire]: the payloads are of the request's dtype, which an allreduce's
  // input may not share; the result is cast back as it is written to the output.
  const auto dtype = static_cast<c10::ScalarType>(request.dtype);
  auto rank_tensor = [&](int r) {
    const std::string& bytes = item.payloads[r];
    at::Tensor t = at::empty({static_cast<int64_t>(bytes.size() / c10::elementSize(dtype))}, input.options().dtype(dtype));
    if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
    return t;
  };
  switch (request.kind) {
    case CollectiveKind::kAllreduce: {
      at::Tensor result;
      for (int r = 0; r < size_; ++r) {
        at::Tensor t = rank_tensor(r);
        Scale(t, request.prescale);
        if (r == 0) {
          result = t;
        } else if (request.op == ReduceOp::kMin) {
          result = at::minimum(result, t);
        } else if (request.op == ReduceOp::kMax) {
          result = at::maximum(result, t);
        } else if (request.op == ReduceOp::kProduct) {
          result.mul_(t);
        } else {
          result.add_(t);
        }
      }
      Postprocess(result, request.op == ReduceOp::kAverage, item.average_divisor, request.postscale);
      local.entry.output.copy_(result.view(local.entry.output.sizes()));
      return;
    }
    case CollectiveKind::kAllgather: {
      std::vector<int64_t> shape = input.dim() == 0 ? std::vector<int64_t>{1} : input.sizes().vec();
      int64_t rows = 0;
      for (int64_t d : item.rank_dim0) rows += d;
      shape[0] = rows;
      at::Tensor output = at::empty(shape, input.options().memory_format(at::MemoryFormat::Contiguous));
      auto* out = static_cast<char*>(output.data_ptr());
      for (const std::string& bytes : item.payloads) {
        if (!bytes.empty()) std::memcpy(out, bytes.data(), bytes.size());
        out += bytes.size();
      }
      local.entry.output = output;
      local.aux = item.rank_dim0;
      return;
    }
    case CollectiveKind::kBroadcast:
      if (rank_ == request.root) {
        if (!local.entry.output.is_same(input)) local.entry.output.copy_(input);
      } else {
        local.entry.output.copy_(rank_tensor(request.root).view(local.entry.output.sizes()));
      }
      return;
    default:
      return;
  }
}

}  // namespace hvdlite
