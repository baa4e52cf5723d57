#include "executor.h"

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <optional>

namespace hvdlite {
namespace {

// Multiplies in place; integer tensors are scaled in double and truncated toward zero.
void Scale(at::Tensor& t, double factor) {
  if (factor == 1.0) return;
  if (at::isFloatingType(t.scalar_type())) {
    t.mul_(factor);
  } else {
    t.copy_(t.to(at::kDouble).mul_(factor));
  }
}

// Average's division and the postscale factor, after the sum.
void Postprocess(at::Tensor& t, bool average, int size, double postscale) {
  if (!average) {
    Scale(t, postscale);
  } else if (at::isFloatingType(t.scalar_type())) {
    t.div_(size);
    if (postscale != 1.0) t.mul_(postscale);
  } else {
    at::Tensor wide = t.to(at::kDouble).div_(size);
    if (postscale != 1.0) wide.mul_(postscale);
    t.copy_(wide);
  }
}

// Views a flat slice with the entry's shape (0-d tensors have one element).
at::Tensor Shaped(const at::Tensor& flat, int64_t offset, const at::Tensor& like) {
  return flat.narrow(0, offset, like.numel()).view(like.sizes());
}

}  // namespace

Executor::Executor(int rank, int size, CollectiveBackend* cpu, CollectiveBackend* cuda,
                   TensorQueue* queue, HandleTable* handles)
    : rank_(rank), size_(size), cpu_(cpu), cuda_(cuda), queue_(queue), handles_(handles) {}

CollectiveBackend* Executor::BackendFor(c10::Device device) {
  return device.is_cpu() ? cpu_ : cuda_;
}

c10::Stream Executor::EngineStream(c10::Device device) {
  auto key = std::make_pair(static_cast<int>(device.type()), static_cast<int>(device.index()));
  auto it = streams_.find(key);
  if (it == streams_.end()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    it = streams_.emplace(key, impl.getStreamFromGlobalPool(device)).first;
  }
  return it->second;
}

void Executor::Execute(const Batch& batch) {
  std::vector<Local> locals;
  for (const ReadyItem& item : batch.items) {
    Local local{&item, Entry()};
    // A rank that never submitted a stalled tensor has no entry for it: nothing to complete.
    if (!queue_->TakeEntry(item.request.name, &local.entry)) continue;
    if (!item.status.ok()) {
      handles_->Complete(local.entry.handle, Completion{item.status, at::Tensor(), nullptr});
      continue;
    }
    locals.push_back(std::move(local));
  }
  if (locals.empty()) return;

  const c10::Device device = locals.front().entry.input.device();
  CollectiveBackend* backend = BackendFor(device);
  if (backend == nullptr) {
    Status status(StatusCode::kInvalidArgument,
                  std::string(KindName(locals.front().item->request.kind)) + " of '" +
                      locals.front().item->request.name + "': no process group serves " +
                      device.str() + " tensors in this job");
    for (Local& local : locals) handles_->Complete(local.entry.handle, Completion{status, {}, nullptr});
    return;
  }

  // Note [Device streams]: for device tensors everything below runs on the engine's own stream,
  // after the events recorded on the callers' streams at enqueue; c10d's device backends order
  // their work after the current stream. CPU tensors need none of this.
  std::optional<c10::StreamGuard> stream_guard;
  std::shared_ptr<c10::Event> done_event;
  if (!device.is_cpu()) {
    c10::Stream stream = EngineStream(device);
    for (Local& local : locals) {
      if (local.entry.ready_event) local.entry.ready_event->block(stream);
    }
    stream_guard.emplace(stream);
  }

  try {
    switch (batch.items.front().request.kind) {
      case CollectiveKind::kAllreduce:
        Allreduce(locals, backend);
        break;
      case CollectiveKind::kBroadcast:
        Broadcast(locals, backend);
        break;
      case CollectiveKind::kAllgather:
        locals.front().entry.output = Allgather(locals.front(), backend);
        break;
    }
  } catch (const std::exception& e) {
    Status status(StatusCode::kRankFailure,
                  std::string(KindName(locals.front().item->request.kind)) + " of '" +
                      locals.front().item->request.name + "' failed in " + backend->name() +
                      ": " + e.what());
    for (Local& local : locals) handles_->Complete(local.entry.handle, Completion{status, {}, nullptr});
    throw;
  }

  if (!device.is_cpu()) {
    c10::Stream stream = EngineStream(device);
    done_event = std::make_shared<c10::Event>(device.type());
    done_event->record(stream);
    for (Local& local : locals) {
      // The caching allocator must not hand these blocks out again before our stream is done.
      local.entry.input.record_stream(stream);
      if (local.entry.output.defined()) local.entry.output.record_stream(stream);
    }
  }
  for (Local& local : locals) {
    handles_->Complete(local.entry.handle, Completion{Status::Ok(), local.entry.output, done_event});
  }
  // `locals` dies here, outside every lock (Note [GIL and tensor references]).
}

void Executor::Allreduce(std::vector<Local>& locals, CollectiveBackend* backend) {
  const Request& request = locals.front().item->request;
  const bool average = request.op == ReduceOp::kAverage;
  const ReduceOp wire_op = average ? ReduceOp::kSum : request.op;
  int64_t total = 0;
  for (Local& local : locals) total += local.entry.input.numel();
  if (total == 0) return;

  Entry& first = locals.front().entry;
  if (locals.size() == 1 && first.output.is_contiguous()) {
    // One tensor: reduce straight in the output, no fusion buffer.
    if (!first.output.is_same(first.input)) first.output.copy_(first.input);
    Scale(first.output, request.prescale);
    backend->Allreduce(first.output, wire_op);
    Postprocess(first.output, average, size_, request.postscale);
    return;
  }
  at::Tensor buffer = buffers_.Get(first.input.device(), first.input.scalar_type(), total);
  int64_t offset = 0;
  for (Local& local : locals) {
    Shaped(buffer, offset, local.entry.input).copy_(local.entry.input);
    offset += local.entry.input.numel();
  }
  Scale(buffer, request.prescale);
  backend->Allreduce(buffer, wire_op);
  Postprocess(buffer, average, size_, request.postscale);
  offset = 0;
  for (Local& local : locals) {
    local.entry.output.copy_(Shaped(buffer, offset, local.entry.output));
    offset += local.entry.output.numel();
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
    backend->Broadcast(first.output, root);
    return;
  }
  at::Tensor buffer = buffers_.Get(first.input.device(), first.input.scalar_type(), total);
  int64_t offset = 0;
  if (is_root) {
    for (Local& local : locals) {
      Shaped(buffer, offset, local.entry.input).copy_(local.entry.input);
      offset += local.entry.input.numel();
    }
  }
  backend->Broadcast(buffer, root);
  offset = 0;
  for (Local& local : locals) {
    if (!(is_root && local.entry.output.is_same(local.entry.input))) {
      local.entry.output.copy_(Shaped(buffer, offset, local.entry.output));
    }
    offset += local.entry.output.numel();
  }
}

at::Tensor Executor::Allgather(Local& local, CollectiveBackend* backend) {
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
  at::Tensor output = at::empty(out_shape, input.options().memory_format(at::MemoryFormat::Contiguous));
  if (output.numel() == 0) return output;

  const int64_t slot = max_rows * row;
  const bool even = std::all_of(dims.begin(), dims.end(), [&](int64_t d) { return d == max_rows; });
  at::Tensor flat_output = output.view({-1});
  // Even sizes: gather straight into the output. Uneven: Gloo needs equal sizes, so every rank
  // sends a slot of the largest size and the rows that matter are copied out afterwards.
  at::Tensor receive = even ? flat_output : at::empty({slot * size_}, input.options());
  at::Tensor send = at::empty({slot}, input.options());
  send.narrow(0, 0, input.numel()).view(input.sizes()).copy_(input);
  std::vector<at::Tensor> slots;
  for (int r = 0; r < size_; ++r) slots.push_back(receive.narrow(0, r * slot, slot));
  backend->Allgather(send, slots);
  if (!even) {
    int64_t offset = 0;
    for (int r = 0; r < size_; ++r) {
      flat_output.narrow(0, offset, dims[r] * row).copy_(slots[r].narrow(0, 0, dims[r] * row));
      offset += dims[r] * row;
    }
  }
  return output;
}

}  // namespace hvdlite
