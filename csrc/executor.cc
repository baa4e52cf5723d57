#include "executor.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <optional>

#include "kernels.h"

namespace hvdlite {
namespace {

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

}  // namespace

Executor::Executor(int rank, int size, CollectiveBackend* cpu, std::unique_ptr<CpuRoute> cpu_route,
                   CollectiveBackend* cuda, TensorQueue* queue, HandleTable* handles, Timeline* timeline)
    : rank_(rank),
      size_(size),
      cpu_(cpu),
      cpu_route_(std::move(cpu_route)),
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

std::string Executor::RouteName(CollectiveKind kind, c10::Device device, CollectiveBackend* backend) const {
  const bool reduction = kind == CollectiveKind::kAllreduce || kind == CollectiveKind::kReducescatter;
  const bool moved = (kind == CollectiveKind::kAllgather || kind == CollectiveKind::kBroadcast) &&
                     cpu_route_->MovesData();
  return (reduction || moved) && device.is_cpu() ? cpu_route_->name() : backend->name();
}

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

std::vector<Executor::Local> Executor::TakeLocals(const Batch& batch) {
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
  return locals;
}

void Executor::Execute(const Batch& batch) {
  std::vector<Local> locals = TakeLocals(batch);
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
    Fail(locals, Status::Of(StatusCode::kInvalidArgument, KindName(kind), locals.front().item->request.name,
                            "no process group serves " + device.str() + " tensors in this job"));
    return;
  }

  // Note [Device streams]: for device tensors everything below runs on the engine's own stream,
  // after the events recorded on the callers' streams at enqueue; c10d's device backends order
  // their work after the current stream. CPU tensors need none of this.
  std::optional<c10::StreamGuard> stream_guard;
  if (!device.is_cpu()) {
    c10::Stream stream = EngineStream(device);
    for (Local& local : locals) {
      if (local.entry.ready_event) local.entry.ready_event->block(stream);
    }
    stream_guard.emplace(stream);
  }

  const int64_t start_us = timeline_->enabled() ? MonotonicMicros() : 0;
  RunOrFail(locals, backend, device);
  std::shared_ptr<c10::Event> done_event = RecordDone(locals, device);
  if (timeline_->enabled()) Trace(locals, start_us, MonotonicMicros());
  Complete(locals, done_event);
  // `locals` dies here, outside every lock (Note [GIL and tensor references]).
}

void Executor::RunOrFail(std::vector<Local>& locals, CollectiveBackend* backend, c10::Device device) {
  collective_start_us_ = collective_end_us_ = 0;
  collective_started_ = false;
  const CollectiveKind kind = locals.front().item->request.kind;
  const std::string& name = locals.front().item->request.name;
  try {
    Run(locals, backend);
  } catch (const std::exception& e) {
    if (!collective_started_) {
      // Note [Fatal errors]: this rank could not take part; the peers may already be waiting.
      Status status = Status::Of(StatusCode::kInternal, KindName(kind), name,
                                 "rank " + std::to_string(rank_) + " could not take part: " + ExceptionText(e) +
                                     "; hvdlite cannot continue on this rank",
                                 {rank_});
      Fail(locals, status);
      throw StatusError(status);
    }
    Fail(locals, Status::Of(StatusCode::kRankFailure, KindName(kind), name,
                            "failed in " + RouteName(kind, device, backend) + ": " + ExceptionText(e)));
    throw;
  }
}

std::shared_ptr<c10::Event> Executor::RecordDone(std::vector<Local>& locals, c10::Device device) {
  if (device.is_cpu()) return nullptr;
  c10::Stream stream = EngineStream(device);
  auto done_event = std::make_shared<c10::Event>(device.type());
  done_event->record(stream);
  for (Local& local : locals) {
    // The caching allocator must not hand these blocks out again before our stream is done.
    local.entry.input.record_stream(stream);
    if (local.entry.output.defined()) local.entry.output.record_stream(stream);
  }
  return done_event;
}

void Executor::Complete(std::vector<Local>& locals, const std::shared_ptr<c10::Event>& done_event) {
  std::vector<std::pair<int64_t, Completion>> done;  // Note [Completing in one step]
  done.reserve(locals.size());
  for (Local& local : locals) {
    if (local.neutral) continue;
    done.emplace_back(local.entry.handle,
                      Completion{Status::Ok(), local.entry.output, done_event, std::move(local.aux),
                                 std::move(local.entry.write_back)});
  }
  handles_->CompleteAll(&done);
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

}  // namespace hvdlite
