#include "executor.h"

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>

#include "kernels.h"

namespace hvdlite {

void Executor::BroadcastOn(at::Tensor& tensor, int root, CollectiveBackend* backend) {
  if (tensor.is_cpu() && cpu_route_->MovesData()) {
    cpu_route_->Broadcast(tensor, root);  // Note [Shared-memory allgather and broadcast]
  } else {
    backend->Broadcast(tensor, root);
  }
}

void Executor::Broadcast(std::vector<Local>& locals, CollectiveBackend* backend) {
  const int root = locals.front().item->request.root;
  const bool is_root = rank_ == root;
  int64_t total = 0;
  for (Local& local : locals) total += local.entry.input.numel();
  if (total == 0) return;

  Entry& first = locals.front().entry;
  if (locals.size() == 1 && first.output.is_contiguous()) {
    if (is_root && !first.output.is_same(first.input)) first.output.copy_(first.input);
    CollectiveStarts();
    BroadcastOn(first.output, root, backend);
    CollectiveEnds();
    return;
  }
  at::Tensor buffer = buffers_.Get(first.input.device(), first.input.scalar_type(), total);
  int64_t offset = 0;
  if (is_root) {
    for (Local& local : locals) {
      CopyIn(buffer, offset, local.entry.input);
      offset += local.entry.input.numel();
    }
  }
  CollectiveStarts();
  BroadcastOn(buffer, root, backend);
  CollectiveEnds();
  offset = 0;
  for (Local& local : locals) {
    if (!(is_root && local.entry.output.is_same(local.entry.input))) {
      CopyOut(buffer, offset, local.entry.output);
    }
    offset += local.entry.output.numel();
  }
}

void Executor::Allgather(Local& local, CollectiveBackend* backend) {
  const std::vector<int64_t>& dims = local.item->rank_dim0;
  at::Tensor input = local.entry.input.dim() == 0 ? local.entry.input.view({1}) : local.entry.input;
  std::vector<int64_t> out_shape = input.sizes().vec();
  int64_t row = 1;
  for (size_t d = 1; d < out_shape.size(); ++d) row *= out_shape[d];
  int64_t total_rows = 0, max_rows = 0;
  for (int64_t d : dims) {
    total_rows += d;
    max_rows = std::max(max_rows, d);
  }
  out_shape[0] = total_rows;
  // A caller may hand in the output (the torch.distributed backend's allgather_into_tensor):
  // used where it fits, so the result is written once, straight where it belongs.
  const at::Tensor& given = local.entry.output;
  const bool fits = given.defined() && given.is_contiguous() && given.numel() == total_rows * row &&
                    given.scalar_type() == input.scalar_type() && given.device() == input.device();
  at::Tensor output = fits ? given.view(out_shape)
                           : at::empty(out_shape, input.options().memory_format(at::MemoryFormat::Contiguous));
  local.entry.output = output;
  local.aux = dims;  // the differentiable allgather slices its gradient with these
  if (output.numel() == 0) return;

  const int64_t slot = max_rows * row;
  const bool even = std::all_of(dims.begin(), dims.end(), [&](int64_t d) { return d == max_rows; });
  at::Tensor flat_output = output.view({-1});
  // Even sizes: gather straight into the output. Uneven: Gloo needs equal sizes, so every rank
  // sends a slot of the largest size and the rows that matter are copied out afterwards.
  at::Tensor receive = even ? flat_output : at::empty({slot * size_}, input.options());
  // A contiguous input of the common size is sent as it is; otherwise it is padded to a slot.
  at::Tensor send;
  if (even && input.is_contiguous()) {
    send = input.view({-1});
  } else {
    send = at::empty({slot}, input.options());
    send.narrow(0, 0, input.numel()).view(input.sizes()).copy_(input);
  }
  std::vector<at::Tensor> slots;
  for (int r = 0; r < size_; ++r) slots.push_back(receive.narrow(0, r * slot, slot));
  CollectiveStarts();
  if (send.is_cpu() && cpu_route_->MovesData()) {
    cpu_route_->Allgather(send, slots);  // Note [Shared-memory allgather and broadcast]
  } else {
    backend->Allgather(send, slots);
  }
  CollectiveEnds();
  if (!even) {
    int64_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      flat_output.narrow(0, offset, dims[r] * row).copy_(slots[r].narrow(0, 0, dims[r] * row));
      offset += dims[r] * row;
    }
  }
}

void Executor::Alltoall(Local& local, CollectiveBackend* backend) {
  const auto& matrix = local.item->rank_splits;
  std::vector<int64_t> send_splits = matrix[rank_];
  std::vector<int64_t> receive_splits(size_);
  int64_t moved = 0, received_rows = 0;
  for (int s = 0; s < size_; ++s) {
    receive_splits[s] = matrix[s][rank_];
    received_rows += receive_splits[s];
    for (int64_t n : matrix[s]) moved += n;
  }
  at::Tensor input = local.entry.input.contiguous();
  std::vector<int64_t> out_shape = input.sizes().vec();
  out_shape[0] = received_rows;
  at::Tensor output = at::empty(out_shape, input.options().memory_format(at::MemoryFormat::Contiguous));
  int64_t row = 1;
  for (size_t d = 1; d < out_shape.size(); ++d) row *= out_shape[d];
  if (moved > 0 && row > 0) {
    CollectiveStarts();
    backend->Alltoall(output, input, receive_splits, send_splits);
    CollectiveEnds();
  }
  local.entry.output = output;
  local.aux = std::move(receive_splits);
}

}  // namespace hvdlite
