// Kernels: the small per-tensor steps the executor applies around a collective: scaling,
// averaging, and the copies into and out of fusion buffers. Free functions with no state and no
// locks; the executor and the shared-memory channel call them on the thread that runs the round
// (Note [A waiting caller runs the round] in round_driver.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "types.h"

namespace hvdlite {

// Multiplies in place, as horovod.torch does: integer tensors in double, truncated toward zero;
// CPU float16 in float32; other floating types in their own precision.
void Scale(at::Tensor& t, double factor);
// Average's division (by `divisor`, Note [Join]) and the postscale factor, after the sum: one
// Scale by postscale / divisor (Note [Scaling as horovod.torch does]).
void Postprocess(at::Tensor& t, bool average, int divisor, double postscale);
// Views a flat slice with the entry's shape (0-d tensors have one element).
at::Tensor Shaped(const at::Tensor& flat, int64_t offset, const at::Tensor& like);
// Note [Copies into fusion buffers]: a dense CPU tensor, which is copied with memcpy.
bool Memcpyable(const at::Tensor& t);
// Note [Copies into fusion buffers]: `offset` counts elements of the flat buffer. The buffer's
// dtype may differ from the tensor's (Note [Casting on the wire]): the copy then casts.
void CopyIn(at::Tensor& buffer, int64_t offset, const at::Tensor& src);
void CopyOut(const at::Tensor& buffer, int64_t offset, at::Tensor& dst);
// Note [Prefaulting outputs while the link works] (cpu_route.h): maps the whole pages of
// [data, data + bytes) for writing without changing what they hold; does nothing where the
// kernel cannot (before Linux 5.14).
void PrefaultForWrite(void* data, int64_t bytes);
// Copies n elements from CPU memory `src` of dtype `from` to `dst` of dtype `to`: a memcpy, or
// a cast where the dtypes differ (Note [Casting on the wire] in executor.h).
void CopyElements(const void* src, c10::ScalarType from, void* dst, c10::ScalarType to, int64_t n);
// CopyElements from element `from` of dense CPU `src` to element `to` of dense CPU `dst`.
void CopyRange(const at::Tensor& src, int64_t from, const at::Tensor& dst, int64_t to, int64_t n);
// out = a (op) b, elementwise, for op kSum, kMin, kMax or kProduct; `out` may be `a`. The
// shared-memory paths reduce with it, so the staged and single-copy paths agree bit for bit.
void Combine(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, ReduceOp op);

}  // namespace hvdlite
