#include "executor.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>

#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace hvdlite {
namespace {

// Note [Inline reduce in place]
// An inlined allreduce's result was built with ATen operators: an at::empty and a memcpy per
// rank, an add_ per rank, a view and a copy_ into the output, whose operator dispatch was most
// of a small allreduce's own CPU (measured: docs/performance.md, Design measurements). In the
// common case (a sum, average or product, no prescale, a dense CPU output of the payloads'
// dtype, a dtype below) the payloads are reduced by a typed loop straight into the output
// instead. The loop does what
// those operators do element by element: the same order (rank 0, then 1, ...), the same
// arithmetic (integers wrap as ATen's do, hence the unsigned sums; an average or a postscale
// is one multiplication by postscale / divisor, in the float's own precision, or in double and
// truncated toward zero for an integer, as Scale does), so the result is the same bit for bit.
// Min, max (NaN and signed-zero rules), float16 and bfloat16 (computed in float) keep the
// operators.

// The type integer arithmetic runs in: unsigned, so that it wraps, and at least as wide as
// int, so that no product of narrow types overflows int. Floats compute in their own type.
template <typename T, bool = std::is_integral_v<T>>
struct Wrapping {
  using type = T;
};
template <typename T>
struct Wrapping<T, true> {
  using type = std::conditional_t<(sizeof(T) < 4), uint32_t, std::make_unsigned_t<T>>;
};

template <typename T>
void ReduceInto(T* out, const std::vector<std::string>& payloads, int64_t n, ReduceOp op, double scale) {
  using Acc = typename Wrapping<T>::type;
  std::memcpy(out, payloads[0].data(), static_cast<size_t>(n) * sizeof(T));
  for (size_t r = 1; r < payloads.size(); ++r) {
    const auto* in = reinterpret_cast<const T*>(payloads[r].data());
    for (int64_t i = 0; i < n; ++i) {
      T v;
      std::memcpy(&v, in + i, sizeof(T));  // payload bytes carry no alignment promise
      out[i] = op == ReduceOp::kProduct ? static_cast<T>(static_cast<Acc>(out[i]) * static_cast<Acc>(v))
                                        : static_cast<T>(static_cast<Acc>(out[i]) + static_cast<Acc>(v));
    }
  }
  if (scale == 1.0) return;
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_integral_v<T>) {
      out[i] = static_cast<T>(static_cast<double>(out[i]) * scale);
    } else {
      out[i] = out[i] * static_cast<T>(scale);
    }
  }
}

// True if the allreduce was reduced into `output` (Note [Inline reduce in place]).
bool ReduceInPlace(const ReadyItem& item, c10::ScalarType dtype, at::Tensor& output) {
  const Request& request = item.request;
  const ReduceOp op = request.op;
  if ((op != ReduceOp::kSum && op != ReduceOp::kAverage && op != ReduceOp::kProduct) || request.prescale != 1.0 ||
      !output.defined() || !output.device().is_cpu() || output.scalar_type() != dtype || !output.is_contiguous() ||
      item.payloads.empty()) {
    return false;
  }
  const int64_t n = output.numel();
  const size_t bytes = static_cast<size_t>(n) * c10::elementSize(dtype);
  for (const std::string& p : item.payloads) {
    if (p.size() != bytes) return false;
  }
  if (n == 0) return true;
  const double scale = op == ReduceOp::kAverage ? request.postscale / item.average_divisor : request.postscale;
  void* out = output.data_ptr();
  switch (dtype) {
    case at::kFloat: ReduceInto(static_cast<float*>(out), item.payloads, n, op, scale); return true;
    case at::kDouble: ReduceInto(static_cast<double*>(out), item.payloads, n, op, scale); return true;
    case at::kInt: ReduceInto(static_cast<int32_t*>(out), item.payloads, n, op, scale); return true;
    case at::kLong: ReduceInto(static_cast<int64_t*>(out), item.payloads, n, op, scale); return true;
    case at::kChar: ReduceInto(static_cast<int8_t*>(out), item.payloads, n, op, scale); return true;
    case at::kByte: ReduceInto(static_cast<uint8_t*>(out), item.payloads, n, op, scale); return true;
    default: return false;
  }
}

}  // namespace

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
      if (ReduceInPlace(item, dtype, local.entry.output)) return;
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
