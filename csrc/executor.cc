#include "executor.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>
#include <ATen/ops/zeros.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
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

// Average's division (by the ranks that contributed) and the postscale factor, after the sum.
void Postprocess(at::Tensor& t, bool average, int contributors, double postscale) {
  if (!average) {
    Scale(t, postscale);
  } else if (at::isFloatingType(t.scalar_type())) {
    t.div_(contributors);
    if (postscale != 1.0) t.mul_(postscale);
  } else {
    at::Tensor wide = t.to(at::kDouble).div_(contributors);
    if (postscale != 1.0) wide.mul_(postscale);
    t.copy_(wide);
  }
}

// Views a flat slice with the entry's shape (0-d tensors have one element).
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
  if (Memcpyable(src) && buffer.device().is_cpu()) {
    std::memcpy(static_cast<char*>(buffer.data_ptr()) + offset * buffer.element_size(), src.data_ptr(),
                src.nbytes());
    return;
  }
  Shaped(buffer, offset, src).copy_(src);
}

void CopyOut(const at::Tensor& buffer, int64_t offset, at::Tensor& dst) {
  if (dst.numel() == 0) return;
  if (Memcpyable(dst) && buffer.device().is_cpu()) {
    std::memcpy(dst.data_ptr(), static_cast<const char*>(buffer.data_ptr()) + offset * buffer.element_size(),
                dst.nbytes());
    return;
  }
  dst.copy_(Shaped(buffer, offset, dst));
}

// The value a joined rank contributes to a reduction: it changes nothing.
at::Scalar Identity(ReduceOp op, c10::ScalarType dtype) {
  const bool floating = at::isFloatingType(dtype);
  auto highest = [&]() -> at::Scalar {
    if (floating) return std::numeric_limits<double>::infinity();
    switch (dtype) {
      case at::kByte: return static_cast<int64_t>(std::numeric_limits<uint8_t>::max());
      case at::kChar: return static_cast<int64_t>(std::numeric_limits<int8_t>::max());
      case at::kInt: return static_cast<int64_t>(std::numeric_limits<int32_t>::max());
      default: return std::numeric_limits<int64_t>::max();
    }
  };
  auto lowest = [&]() -> at::Scalar {
    if (floating) return -std::numeric_limits<double>::infinity();
    switch (dtype) {
      case at::kByte: return static_cast<int64_t>(0);
      case at::kChar: return static_cast<int64_t>(std::numeric_limits<int8_t>::min());
      case at::kInt: return static_cast<int64_t>(std::numeric_limits<int32_t>::min());
      default: return std::numeric_limits<int64_t>::min();
    }
  };
  switch (op) {
    case ReduceOp::kMin: return highest();
    case ReduceOp::kMax: return lowest();
    case ReduceOp::kProduct: return 1;
    default: return 0;
  }
}

// Rows of dimension 0 that `rank` keeps in a reducescatter: as even as possible, the first
// (rows % size) ranks get one more.
std::pair<int64_t, int64_t> ScatterRange(int64_t rows, int rank, int size) {
  const int64_t base = rows / size, extra = rows % size;
  return {rank * base + std::min<int64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

}  // namespace

Executor::Executor(int rank, int size, std::vector<CollectiveBackend*> cpu, CollectiveBackend* cuda,
                   TensorQueue* queue, HandleTable* handles, Timeline* timeline)
    : rank_(rank),
      size_(size),
      cpu_(std::move(cpu)),
      cuda_(cuda),
      queue_(queue),
      handles_(handles),
      timeline_(timeline) {}

void Executor::Trace(const std::vector<Local>& locals, int64_t start_us, int64_t end_us) {
  for (const Local& local : locals) {
    if (local.neutral) continue;
    const std::string& row = local.item->request.name;
    timeline_->Span(row, "NEGOTIATE", local.entry.enqueued_us, start_us);
    if (local.item->inlined) {
      timeline_->Span(row, "INLINE", start_us, end_us);
    } else if (collective_start_us_ == 0) {
      timeline_->Span(row, "EXECUTE", start_us, end_us);
    } else {
      timeline_->Span(row, "COPY_IN", start_us, collective_start_us_);
      timeline_->Span(row, "COLLECTIVE", collective_start_us_, collective_end_us_);
      timeline_->Span(row, "COPY_OUT", collective_end_us_, end_us);
    }
  }
}

CollectiveBackend* Executor::BackendFor(c10::Device device) {
  return device.is_cpu() ? cpu_.front() : cuda_;
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

Entry Executor::NeutralEntry(const ReadyItem& item) {
  const Request& r = item.request;
  const auto device_type = static_cast<c10::DeviceType>(r.device_type);
  c10::Device device(device_type);
  if (device_type != c10::DeviceType::CPU) device = c10::impl::VirtualGuardImpl(device_type).getDevice();
  auto options = at::TensorOptions().device(device).dtype(static_cast<c10::ScalarType>(r.dtype));
  std::vector<int64_t> shape = r.shape;
  Entry entry;
  entry.request = r;
  if (r.kind == CollectiveKind::kAllgather || r.kind == CollectiveKind::kAlltoall) {
    if (shape.empty()) shape.push_back(1);
    shape[0] = 0;  // a joined rank sends no rows
    entry.input = at::empty(shape, options);
  } else if (r.kind == CollectiveKind::kAllreduce || r.kind == CollectiveKind::kReducescatter) {
    entry.input = at::full(shape, Identity(r.op, options.dtype().toScalarType()), options);
    entry.output = entry.input;
  } else {
    entry.input = at::empty(shape, options);
    entry.output = entry.input;
  }
  return entry;
}

void Executor::Fail(std::vector<Local>& locals, const Status& status) {
  for (Local& local : locals) {
    if (!local.neutral) handles_->Complete(local.entry.handle, Completion{status, {}, nullptr, {}});
  }
}

void Executor::Execute(const Batch& batch) {
  std::vector<Local> locals;
  for (const ReadyItem& item : batch.items) {
    Local local{&item, Entry()};
    if (!queue_->TakeEntry(item.request.name, &local.entry)) {
      // No entry: either this rank has joined (it takes part with a neutral input), or it never
      // submitted a tensor that stalled elsewhere (nothing to do).
      const bool joined = std::find(item.joined.begin(), item.joined.end(), rank_) != item.joined.end();
      if (!item.status.ok() || !joined) continue;
      local.entry = NeutralEntry(item);
      local.neutral = true;
    } else if (!item.status.ok()) {
      handles_->Complete(local.entry.handle, Completion{item.status, {}, nullptr, {}});
      continue;
    }
    locals.push_back(std::move(local));
  }
  if (locals.empty()) return;

  const CollectiveKind kind = batch.items.front().request.kind;
  if (kind == CollectiveKind::kBarrier || kind == CollectiveKind::kJoin) {
    // Negotiation itself was the synchronization.
    for (Local& local : locals) {
      std::vector<int64_t> aux;
      if (kind == CollectiveKind::kJoin) aux.push_back(local.item->last_joined);
      handles_->Complete(local.entry.handle, Completion{Status::Ok(), {}, nullptr, std::move(aux)});
    }
    return;
  }

  const c10::Device device = locals.front().entry.input.device();
  CollectiveBackend* backend = BackendFor(device);
  if (backend == nullptr) {
    Fail(locals, Status(StatusCode::kInvalidArgument,
                        std::string(KindName(kind)) + " of '" + locals.front().item->request.name +
                            "': no process group serves " + device.str() + " tensors in this job"));
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

  const int64_t start_us = timeline_->enabled() ? MonotonicMicros() : 0;
  collective_start_us_ = collective_end_us_ = 0;
  try {
    Run(locals, backend);
  } catch (const std::exception& e) {
    Fail(locals, Status(StatusCode::kRankFailure,
                        std::string(KindName(kind)) + " of '" + locals.front().item->request.name +
                            "' failed in " + backend->name() + ": " + e.what()));
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
  if (timeline_->enabled()) Trace(locals, start_us, MonotonicMicros());
  for (Local& local : locals) {
    if (local.neutral) continue;
    handles_->Complete(local.entry.handle,
                       Completion{Status::Ok(), local.entry.output, done_event, std::move(local.aux)});
  }
  // `locals` dies here, outside every lock (Note [GIL and tensor references]).
}

void Executor::Run(std::vector<Local>& locals, CollectiveBackend* backend) {
  if (locals.front().item->inlined) {
    FromPayloads(locals.front());  // inlined items are never fused: one per batch
    return;
  }
  switch (locals.front().item->request.kind) {
    case CollectiveKind::kAllreduce:
    case CollectiveKind::kReducescatter:
      Reduce(locals, backend);
      return;
    case CollectiveKind::kBroadcast:
      Broadcast(locals, backend);
      return;
    case CollectiveKind::kAllgather:
      Allgather(locals.front(), backend);
      return;
    case CollectiveKind::kAlltoall:
      Alltoall(locals.front(), backend);
      return;
    default:
      return;
  }
}

// Note [Inline small tensors]: every rank computes the result from everyone's bytes, in rank
// order, so every rank gets the same result without a data collective.
void Executor::FromPayloads(Local& local) {
  const ReadyItem& item = *local.item;
  const Request& request = item.request;
  const at::Tensor& input = local.entry.input;
  auto rank_tensor = [&](int r) {
    const std::string& bytes = item.payloads[r];
    at::Tensor t = at::empty({static_cast<int64_t>(bytes.size()) / input.element_size()}, input.options());
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
      Postprocess(result, request.op == ReduceOp::kAverage, item.contributors, request.postscale);
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

void Executor::Reduce(std::vector<Local>& locals, CollectiveBackend* backend) {
  const ReadyItem& item = *locals.front().item;
  const Request& request = item.request;
  const bool scatter = request.kind == CollectiveKind::kReducescatter;
  const bool average = request.op == ReduceOp::kAverage;
  const ReduceOp wire_op = average ? ReduceOp::kSum : request.op;
  int64_t total = 0;
  for (Local& local : locals) total += local.entry.input.numel();

  auto finish = [&](at::Tensor& part) { Postprocess(part, average, item.contributors, request.postscale); };
  Entry& first = locals.front().entry;
  if (!scatter && locals.size() == 1 && first.output.is_contiguous() && total > 0) {
    // One tensor: reduce straight in the output, no fusion buffer.
    if (!first.output.is_same(first.input)) first.output.copy_(first.input);
    Scale(first.output, request.prescale);
    at::Tensor flat = first.output.view({-1});
    CollectiveStarts();
    AllreduceFlat(flat, wire_op, backend, finish);
    CollectiveEnds();
    return;
  }
  // Note [Reducescatter over Gloo]: a reducescatter reduces the whole (fused) buffer and keeps
  // this rank's rows; it fuses like allreduce and handles uneven row counts.
  at::Tensor buffer = buffers_.Get(first.input.device(), first.input.scalar_type(), total);
  int64_t offset = 0;
  for (Local& local : locals) {
    CopyIn(buffer, offset, local.entry.input);  // Note [Copies into fusion buffers]
    offset += local.entry.input.numel();
  }
  if (total > 0) {
    Scale(buffer, request.prescale);
    CollectiveStarts();
    AllreduceFlat(buffer, wire_op, backend, finish);
    CollectiveEnds();
  }
  offset = 0;
  for (Local& local : locals) {
    if (scatter) {
      at::Tensor result = Shaped(buffer, offset, local.entry.input);
      auto [start, rows] = ScatterRange(result.size(0), rank_, size_);
      local.entry.output = result.narrow(0, start, rows).clone();
    } else {
      CopyOut(buffer, offset, local.entry.output);
    }
    offset += local.entry.input.numel();
  }
}

void Executor::AllreduceFlat(at::Tensor& flat, ReduceOp op, CollectiveBackend* backend,
                             const std::function<void(at::Tensor&)>& finish) {
  // Note [CPU channels]
  constexpr int64_t kStripeBytes = 8LL << 20;
  const int64_t bytes = flat.numel() * static_cast<int64_t>(flat.element_size());
  const int64_t stripes =
      flat.device().is_cpu() ? std::min<int64_t>(static_cast<int64_t>(cpu_.size()), bytes / kStripeBytes) : 1;
  if (stripes <= 1) {
    backend->Allreduce(flat, op);
    finish(flat);
    return;
  }
  const int64_t per = (flat.numel() + stripes - 1) / stripes;
  std::vector<at::Tensor> parts;
  std::vector<std::function<void()>> waits;
  std::exception_ptr failure;
  for (int64_t i = 0; i < stripes && i * per < flat.numel(); ++i) {
    parts.push_back(flat.narrow(0, i * per, std::min(per, flat.numel() - i * per)));
    try {
      waits.push_back(cpu_[i]->StartAllreduce(parts.back(), op));
    } catch (...) {
      failure = std::current_exception();
      break;
    }
  }
  for (size_t i = 0; i < waits.size(); ++i) {  // every started stripe is waited for before anything is thrown
    try {
      waits[i]();
      if (!failure) finish(parts[i]);
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
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
    backend->Broadcast(first.output, root);
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
  backend->Broadcast(buffer, root);
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
  at::Tensor output = at::empty(out_shape, input.options().memory_format(at::MemoryFormat::Contiguous));
  local.entry.output = output;
  local.aux = dims;  // the differentiable allgather slices its gradient with these
  if (output.numel() == 0) return;

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
  CollectiveStarts();
  backend->Allgather(send, slots);
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
