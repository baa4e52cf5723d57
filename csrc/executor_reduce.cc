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
namespace {

// Rows of dimension 0 that `rank` keeps in a reducescatter: as even as possible, the first
// (rows % size) ranks get one more.
std::pair<int64_t, int64_t> ScatterRange(int64_t rows, int rank, int size) {
  const int64_t base = rows / size, extra = rows % size;
  return {rank * base + std::min<int64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

}  // namespace

bool Executor::AllMemcpyable(const std::vector<Local>& locals) {
  return std::all_of(locals.begin(), locals.end(),
                     [](const Local& l) { return Memcpyable(l.entry.input) && Memcpyable(l.entry.output); });
}

std::vector<ShmChannel::Piece> Executor::PiecesOf(const std::vector<Local>& locals, c10::ScalarType wire) {
  std::vector<ShmChannel::Piece> pieces;
  pieces.reserve(locals.size());
  for (const Local& local : locals) {
    if (local.entry.input.numel() == 0) continue;
    pieces.push_back({static_cast<const char*>(local.entry.input.data_ptr()),
                      static_cast<char*>(local.entry.output.data_ptr()),
                      local.entry.input.numel() * static_cast<int64_t>(c10::elementSize(wire)),
                      local.entry.input.scalar_type()});
  }
  return pieces;
}

at::Tensor Executor::BatchBuffer(const std::vector<Local>& locals, c10::ScalarType wire, int64_t total) {
  // Note [Streaming a batch through its buffer]: a batch planned past the threshold that this
  // rank stages whole gets a buffer for this call only, so the pool stays within the threshold.
  const c10::Device device = locals.front().entry.input.device();
  if (locals.size() > 1 && total * static_cast<int64_t>(c10::elementSize(wire)) > fusion_threshold_bytes_) {
    return at::empty({total}, at::TensorOptions().device(device).dtype(wire));
  }
  return buffers_.Get(device, wire, total);
}

// Note [Reduce paths]
// A reduction batch takes the first of these paths whose Enabled holds (kReducePaths, in order):
//   1. into the route's memory: dense CPU members fused straight into shared memory (Note
//      [Fusing straight into shared memory] in shm_channel.h), no fusion buffer;
//   2. a lone tensor staged from its input: one out-of-place CPU tensor, reduced in its output,
//      which the route fills from the input chunk by chunk while earlier chunks travel;
//   3. a lone tensor in place: one contiguous tensor reduced in its output, no fusion buffer;
//   4. staged by element range: memcpy-able CPU members copied into and out of a fusion buffer
//      by the route, chunk by chunk (Note [Pipelined fusion over channels] in cpu_route.h),
//      streamed through a threshold-sized buffer where the route allows it;
//   5. through a fusion buffer: everything else (reducescatter, non-dense or CUDA members):
//      copy in, one flat allreduce, copy out.
// Which path a rank takes depends on its own tensors, so ranks may take different paths for
// the same batch; they agree on the wire by Note [Every path sends the same chunks]
// (pipeline.h). A new path goes into the list at the place of its preference.
const Executor::ReducePath Executor::kReducePaths[] = {
    {"into the route's memory", &Executor::IntoRouteEnabled, &Executor::ReduceIntoRoute},
    {"a lone tensor staged from its input", &Executor::LoneStagedEnabled, &Executor::ReduceLoneStaged},
    {"a lone tensor in place", &Executor::LoneInPlaceEnabled, &Executor::ReduceLoneInPlace},
    {"staged by element range", &Executor::ByRangeEnabled, &Executor::ReduceByRange},
    {"through a fusion buffer", &Executor::ThroughBufferEnabled, &Executor::ReduceThroughBuffer},
};

void Executor::Reduce(std::vector<Local>& locals, CollectiveBackend* backend) {
  const ReadyItem& item = *locals.front().item;
  const Request& request = item.request;
  const bool average = request.op == ReduceOp::kAverage;
  // Note [Casting on the wire]: the buffer and the collective take the request's dtype; a
  // member whose input is of another dtype is cast as it is copied in and out.
  ReduceBatch batch{locals, backend, request, static_cast<c10::ScalarType>(request.dtype),
                    average ? ReduceOp::kSum : request.op};
  batch.scatter = request.kind == CollectiveKind::kReducescatter;
  batch.cpu = locals.front().entry.input.device().is_cpu();
  for (Local& local : locals) {
    batch.total += local.entry.input.numel();
    batch.casts = batch.casts || local.entry.input.scalar_type() != batch.wire;
  }
  batch.finish = [&item](at::Tensor& part) {  // one pointer: fits std::function without an allocation
    Postprocess(part, item.request.op == ReduceOp::kAverage, item.average_divisor, item.request.postscale);
  };
  for (const ReducePath& path : kReducePaths) {
    if ((this->*path.enabled)(batch)) {
      (this->*path.run)(batch);
      return;
    }
  }
}

bool Executor::IntoRouteEnabled(ReduceBatch& batch) const {
  if (batch.scatter || batch.total == 0 || !batch.cpu ||
      !cpu_route_->FusesInPlace(batch.total * static_cast<int64_t>(c10::elementSize(batch.wire)), batch.casts) ||
      !AllMemcpyable(batch.locals)) {
    return false;
  }
  batch.pieces = PiecesOf(batch.locals, batch.wire);
  return !batch.pieces.empty() && !ShmChannel::PiecesOverlap(batch.pieces, batch.wire);
}

void Executor::ReduceIntoRoute(ReduceBatch& batch) {
  const double prescale = batch.request.prescale;
  CollectiveStarts();
  cpu_route_->AllreducePieces(batch.pieces, batch.wire, batch.wire_op,
                              prescale == 1.0 ? CpuRoute::Hook() : [prescale](at::Tensor& t) { Scale(t, prescale); },
                              batch.finish);
  CollectiveEnds();
}

bool Executor::LoneInPlaceEnabled(ReduceBatch& batch) const {
  const Entry& first = batch.locals.front().entry;
  return !batch.scatter && !batch.casts && batch.locals.size() == 1 && first.output.is_contiguous() && batch.total > 0;
}

bool Executor::LoneStagedEnabled(ReduceBatch& batch) const {
  const Entry& first = batch.locals.front().entry;
  return LoneInPlaceEnabled(batch) && batch.cpu && !first.output.is_alias_of(first.input) &&
         Memcpyable(first.input) && Memcpyable(first.output);
}

void Executor::ReduceLoneStaged(ReduceBatch& batch) {
  // Rather than copying the input whole, page faults included, before the first byte leaves.
  Entry& first = batch.locals.front().entry;
  at::Tensor flat = first.output.view({-1});
  const double prescale = batch.request.prescale;
  CpuRoute::Staging staging{[&](int64_t begin, int64_t stop, at::Tensor& part) {
                              CopyRange(first.input, begin, part, 0, stop - begin);
                              Scale(part, prescale);
                            },
                            batch.finish, [](int64_t, int64_t, at::Tensor&) {}, {}};
  CollectiveStarts();
  cpu_route_->AllreduceStaged(flat, flat.numel(), batch.wire_op, staging);
  CollectiveEnds();
}

void Executor::ReduceLoneInPlace(ReduceBatch& batch) {
  Entry& first = batch.locals.front().entry;
  at::Tensor flat = first.output.view({-1});
  if (!first.output.is_same(first.input)) first.output.copy_(first.input);
  Scale(first.output, batch.request.prescale);
  CollectiveStarts();
  AllreduceFlat(flat, batch.wire_op, batch.backend, batch.finish);
  CollectiveEnds();
}

bool Executor::ByRangeEnabled(ReduceBatch& batch) const {
  return !batch.scatter && batch.total > 0 && batch.cpu && AllMemcpyable(batch.locals);
}

void Executor::ReduceByRange(ReduceBatch& batch) {
  // The route copies by element range, through a buffer of the threshold's size where it
  // streams (Note [Streaming a batch through its buffer] in cpu_route.h) and no member's memory
  // overlaps another's (or its own output, partly).
  std::vector<Local>& locals = batch.locals;
  const int64_t total = batch.total;
  const int64_t element = static_cast<int64_t>(c10::elementSize(batch.wire));
  const int64_t slots = fusion_threshold_bytes_ / element;
  const c10::Device device = locals.front().entry.input.device();
  const bool streams = total > slots && cpu_route_->StreamsThrough(slots * element) &&
                       !ShmChannel::PiecesOverlap(PiecesOf(locals, batch.wire), batch.wire);
  at::Tensor buffer = streams ? buffers_.Get(device, batch.wire, slots) : BatchBuffer(locals, batch.wire, total);
  std::vector<int64_t> starts;  // each member's first element in the batch
  int64_t end = 0;
  for (Local& local : locals) {
    starts.push_back(end);
    end += local.entry.input.numel();
  }
  // Calls move(member, its first element, the buffer's element, elements) for the part of
  // every member in [begin, end).
  auto each = [&](int64_t begin, int64_t stop, auto&& move) {
    // the last member that starts at or before `begin` (starts[0] is 0)
    size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (; i < locals.size() && starts[i] < stop; ++i) {
      const int64_t from = std::max(begin, starts[i]);
      const int64_t to = std::min(stop, starts[i] + locals[i].entry.input.numel());
      if (from < to) move(locals[i].entry, from - starts[i], from, to - from);
    }
  };
  const double prescale = batch.request.prescale;
  auto copy_in = [&](int64_t begin, int64_t stop, at::Tensor& part) {
    each(begin, stop, [&](Entry& e, int64_t at, int64_t to, int64_t n) { CopyRange(e.input, at, part, to - begin, n); });
    Scale(part, prescale);
  };
  auto copy_out = [&](int64_t begin, int64_t stop, at::Tensor& part) {
    each(begin, stop, [&](Entry& e, int64_t at, int64_t from, int64_t n) { CopyRange(part, from - begin, e.output, at, n); });
  };
  CpuRoute::Staging staging{copy_in, batch.finish, copy_out, {}};
  // Note [Prefaulting outputs while the link works] (cpu_route.h): outputs of their own only.
  auto own_output = [](const Entry& e) { return !e.output.is_alias_of(e.input); };
  if (std::any_of(locals.begin(), locals.end(), [&](const Local& l) { return own_output(l.entry); })) {
    staging.prefault = [&](int64_t begin, int64_t stop) {
      each(begin, stop, [&](Entry& e, int64_t at, int64_t, int64_t n) {
        if (!own_output(e)) return;
        const int64_t size = static_cast<int64_t>(e.output.element_size());
        PrefaultForWrite(static_cast<char*>(e.output.data_ptr()) + at * size, n * size);
      });
    };
  }
  CollectiveStarts();
  cpu_route_->AllreduceStaged(buffer, total, batch.wire_op, staging);
  CollectiveEnds();
}

bool Executor::ThroughBufferEnabled(ReduceBatch&) const { return true; }

void Executor::ReduceThroughBuffer(ReduceBatch& batch) {
  // Note [Reducescatter over Gloo]: a reducescatter reduces the whole (fused) buffer and keeps
  // this rank's rows; it fuses like allreduce and handles uneven row counts.
  std::vector<Local>& locals = batch.locals;
  at::Tensor buffer = BatchBuffer(locals, batch.wire, batch.total);
  int64_t offset = 0;
  for (Local& local : locals) {
    CopyIn(buffer, offset, local.entry.input);  // Note [Copies into fusion buffers]
    offset += local.entry.input.numel();
  }
  if (batch.total > 0) {
    Scale(buffer, batch.request.prescale);
    CollectiveStarts();
    AllreduceFlat(buffer, batch.wire_op, batch.backend, batch.finish);
    CollectiveEnds();
  }
  offset = 0;
  for (Local& local : locals) {
    if (batch.scatter) {
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
  if (flat.device().is_cpu()) {
    cpu_route_->AllreduceFlat(flat, op, finish);  // Note [CPU routes]
    return;
  }
  backend->Allreduce(flat, op);
  finish(flat);
}

}  // namespace hvdlite
