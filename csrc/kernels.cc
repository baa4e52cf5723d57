#include "kernels.h"

#include <ATen/Functions.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace hvdlite {

void Scale(at::Tensor& t, double factor) {
  if (factor == 1.0) return;
  const c10::ScalarType dtype = t.scalar_type();
  if (!at::isFloatingType(dtype)) {
    t.copy_(t.to(at::kDouble).mul_(factor));  // truncates toward zero on the way back
  } else if (dtype == at::kHalf && t.device().is_cpu()) {
    t.copy_(t.to(at::kFloat).mul_(factor));  // as horovod.torch scales CPU float16
  } else {
    t.mul_(factor);
  }
}

void Postprocess(at::Tensor& t, bool average, int divisor, double postscale) {
  // Note [Scaling as horovod.torch does]: an average is a postscale by 1/divisor, applied in one
  // multiplication, so results match Horovod's to the bit (x * (1/3) and x / 3 can differ).
  Scale(t, average ? postscale / divisor : postscale);
}

at::Tensor Shaped(const at::Tensor& flat, int64_t offset, const at::Tensor& like) {
  return flat.narrow(0, offset, like.numel()).view(like.sizes());
}

// Note [Copies into fusion buffers]: a fused batch copies every member in and out. For CPU
// tensors laid out densely that is a memcpy; going through narrow/view/copy_ costs a few
// microseconds of dispatch per tensor (three ops, one autograd view each), which for 200 small
// gradients was as much as the copies themselves. Other tensors take the ATen path.
bool Memcpyable(const at::Tensor& t) { return t.device().is_cpu() && t.is_contiguous(); }

void CopyIn(at::Tensor& buffer, int64_t offset, const at::Tensor& src) {
  if (src.numel() == 0) return;
  if (Memcpyable(src) && buffer.device().is_cpu() && src.scalar_type() == buffer.scalar_type()) {
    std::memcpy(static_cast<char*>(buffer.data_ptr()) + offset * buffer.element_size(), src.data_ptr(),
                src.nbytes());
    return;
  }
  Shaped(buffer, offset, src).copy_(src);
}

void CopyOut(const at::Tensor& buffer, int64_t offset, at::Tensor& dst) {
  if (dst.numel() == 0) return;
  if (Memcpyable(dst) && buffer.device().is_cpu() && dst.scalar_type() == buffer.scalar_type()) {
    std::memcpy(dst.data_ptr(), static_cast<const char*>(buffer.data_ptr()) + offset * buffer.element_size(),
                dst.nbytes());
    return;
  }
  dst.copy_(Shaped(buffer, offset, dst));
}

void CopyElements(const void* src, c10::ScalarType from, void* dst, c10::ScalarType to, int64_t n) {
  if (from == to) {
    std::memcpy(dst, src, static_cast<size_t>(n) * c10::elementSize(from));
    return;
  }
  at::from_blob(dst, {n}, at::TensorOptions().dtype(to))
      .copy_(at::from_blob(const_cast<void*>(src), {n}, at::TensorOptions().dtype(from)));
}

void CopyRange(const at::Tensor& src, int64_t from, const at::Tensor& dst, int64_t to, int64_t n) {
  CopyElements(static_cast<const char*>(src.data_ptr()) + from * static_cast<int64_t>(src.element_size()),
               src.scalar_type(),
               static_cast<char*>(dst.data_ptr()) + to * static_cast<int64_t>(dst.element_size()),
               dst.scalar_type(), n);
}

namespace {

// Whether this kernel knows MADV_POPULATE_WRITE, asked once on a page of our own.
bool CanPopulateWrite() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* probe = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (probe == MAP_FAILED) return false;
  const bool known = madvise(probe, page, MADV_POPULATE_WRITE) == 0;
  munmap(probe, page);
  return known;
}

}  // namespace

void PrefaultForWrite(void* data, int64_t bytes) {
  static const bool supported = CanPopulateWrite();
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  if (bytes <= 0 || !supported) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) & ~(page - 1);
  // Only whole pages inside the range, and the advice keeps what they hold. A failure (a
  // mapping that cannot be written ahead) leaves the copy to fault the pages in, as before.
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE);
}

void Combine(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin: at::minimum_out(out, a, b); return;
    case ReduceOp::kMax: at::maximum_out(out, a, b); return;
    case ReduceOp::kProduct: at::mul_out(out, a, b); return;
    default: at::add_out(out, a, b); return;
  }
}

}  // namespace hvdlite
