// Kernels: the small per-tensor steps the executor applies around a collective: scaling,
// averaging, and the copies into and out of fusion buffers. Background thread only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace hvdlite {

// Multiplies in place; integer tensors are scaled in double and truncated toward zero.
void Scale(at::Tensor& t, double factor);
// Average's division (by the ranks that contributed) and the postscale factor, after the sum.
void Postprocess(at::Tensor& t, bool average, int contributors, double postscale);
// Views a flat slice with the entry's shape (0-d tensors have one element).
at::Tensor Shaped(const at::Tensor& flat, int64_t offset, const at::Tensor& like);
// Note [Copies into fusion buffers]: `offset` counts elements of the flat buffer.
void CopyIn(at::Tensor& buffer, int64_t offset, const at::Tensor& src);
void CopyOut(const at::Tensor& buffer, int64_t offset, at::Tensor& dst);

}  // namespace hvdlite
