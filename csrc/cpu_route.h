// CpuRoute: the way this engine's CPU allreduces and reducescatters travel, chosen once at
// init() (MakeCpuRoute) and held by the executor for the engine's life. The executor calls it on
// whichever thread runs the round: the background thread, or a waiting caller that holds the
// engine's round lock (Note [A waiting caller runs the round] in round_driver.h), so one call at a time;
// a route takes no lock of its own. Each collective returns once it has ended on this rank
// and throws std::exception when it fails (a peer that died, a broken connection).
//
// Note [CPU routes]
// A CPU reduction can travel three ways; the job takes the first of these candidates that it
// can use (Note [Transport plan] in hvdlite/_runtime/groups.py makes the choice, once, and
// MakeCpuRoute builds what it chose):
//   1. hierarchical: HVDLITE_HIERARCHICAL_ALLREDUCE=1 and the ranks span hosts (Python then
//      passes a cross-host group and, where a host has several ranks, their channel; Note
//      [Hierarchical allreduce] below);
//   2. shared memory: every rank on one host, with the channel open (Note [Shared-memory
//      allreduce] in shm_channel.h);
//   3. Gloo channels: everything else, striped over the CPU process groups (Note [CPU
//      channels] below).
// Its inputs are agreed at init() (Python opens the channel on every rank or on none), so
// every rank takes the same route for the engine's life. The executor calls the route and
// never asks which one it holds. Of the collectives that only move data, the shared-memory
// route carries allgather and broadcast (Note [Shared-memory allgather and broadcast] in
// shm_channel.h); every other route, and alltoall on every route, leaves them to Gloo.
//
// Note [Hierarchical allreduce]
// HVDLITE_HIERARCHICAL_ALLREDUCE=1, in a job whose ranks span several hosts: each host's ranks
// reduce through their shared-memory channel, the first rank of each host allreduces that sum
// with the other hosts' first ranks over a Gloo group of its own ("cross"), and the host's
// ranks copy the result out of the channel (ShmChannel::Allreduce with `across`), chunk by
// chunk. Only one rank per host sends across the network, once per byte, where the flat ring
// over every rank crosses hosts at several places. CPU allreduces and reducescatters only.
// The chunks are pipelined: the first rank starts chunk k's cross-host allreduce and, while it
// travels, the host's ranks copy chunk k - 1 out and chunk k + 1 in and reduce it, so the link
// is not idle while the host works (at most two chunks in flight; ShmChannel::Run).
//
// Note [CPU channels]
// A Gloo allreduce of one large buffer does not keep loopback TCP busy: the same buffer split
// over several process groups at once finishes sooner, while for small buffers the extra waits
// cost more than they save (measured: docs/performance.md, Design measurements). So the engine
// holds HVDLITE_CPU_CHANNELS Gloo groups for CPU data (rank 0's value, agreed at init), and an
// allreduce of at least 2 x kStripeBytes is cut into chunks spread over the channels (Note
// [Pipelined fusion over channels]; it was first cut into one equal stripe per channel). The
// cut depends only on the element count and the channel count, so every rank cuts the same
// way. Only this route uses more than the first group, so where the plan takes another
// (hierarchical, shared memory) only the first is made (Note [Transport plan]): it carries what
// that route does not run.
//
// Note [Pipelined fusion over channels]
// A fused batch on the channels used to be copied into its fusion buffer whole, allreduced,
// and copied out whole: two passes over the buffer around the transfer, while the link
// carried nothing (measured: docs/performance.md, Design measurements). So the channels take a
// batch of at least 2 x kStripeBytes by element range instead (AllreduceStaged): the buffer is
// cut into chunks, about kChunksPerChannel per channel, of kStripeBytes to kMaxChunkBytes;
// chunk c travels on channel c % channels, at most one chunk per channel at a time (a Gloo
// group runs two works at once, which would finish the chunks in waves rather than in order).
// The first chunk starts as soon as it is copied in, the rest are copied in while it travels,
// and each chunk is finished and copied out as soon as it is reduced, while the next ones
// travel. In a buffer that holds the whole batch, every chunk is copied in before the first is
// copied out, so a batch whose members share memory stays exact (a batch streamed through a
// smaller buffer has members that share none). The cut depends only on the element count and
// the channel count. The link idles until the first chunk is copied in, so it is a quarter of
// the others; and chunks are copied out in order, but a channel whose chunk ended starts its
// next one at once: the thread looks for ended chunks (WorkWindow::Poll in pipeline.h) after
// every chunk it copies in and every megabyte it copies out. The short first chunk and the early
// starts shortened the link's idle time inside a call (measured: docs/performance.md, Design
// measurements).
// AllreduceFlat takes the same chunks (with nothing to copy): Note [Every path sends the same
// chunks] in pipeline.h. A lone tensor reduced out of place goes this way with its output as
// the buffer: the copy from its input is the copy in, and nothing is copied out (it used to be
// copied whole before the first byte left; measured: docs/performance.md, Design measurements).
//
// Note [Prefaulting outputs while the link works]
// An out-of-place allreduce writes its results into fresh tensors, whose pages the kernel maps
// on first write. That makes copying a chunk out into new outputs several times slower than
// copying it in place, and the chunks that end last are copied out after the link has gone
// quiet, so the mapping lengthens the call past its last byte (measured: docs/performance.md,
// Design measurements). So while the thread would block on the chunk it copies out next, it
// maps the outputs of the chunks ahead (madvise MADV_POPULATE_WRITE, which keeps what the pages
// hold), a megabyte at a time, looking for ended chunks between steps. The executor maps only
// outputs that are not the inputs' own memory; a kernel without MADV_POPULATE_WRITE (before
// Linux 5.14) skips this.
//
// Note [Streaming a batch through its buffer]
// The fusion threshold cut ResNet-50's 102 MB of gradients into a 64 MB batch and a 38 MB one,
// and the link drained between them: the first batch's last chunks ended and were copied out
// before the second's first chunk was copied in, so the two batches took longer than one and
// left the link idle longer than one tensor of the same bytes (measured: docs/performance.md,
// Design measurements). The threshold is there to bound the fusion buffer, and on the channels
// a batch needs no more buffer than the chunks in flight and ready to go: chunk c is staged in
// slot c % slots of the buffer, and is copied in once the chunk that used the slot before it is
// copied out. So where the buffer holds two of the largest chunks (kMaxChunkBytes), CPU
// allreduces fuse into batches of up to kStreamedBatches thresholds (fusion.h) and stream
// through a buffer of the threshold's size; the cut is the same as for a buffer that holds
// everything (Note [Every path sends the same chunks] in pipeline.h). A slot is reused only
// after its chunk is copied out, so members must not share memory with each other: the
// executor checks, and stages such a batch in a buffer of its own size, allocated for the call,
// as it does where a member is no memcpy, so that the pooled buffer stays within the threshold.
// A buffer of fewer slots than channels keeps fewer chunks in flight (a 32 MiB threshold with
// 16 MiB chunks: two); the default 64 MiB holds four or more.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend.h"
#include "shm_channel.h"
#include "types.h"

namespace hvdlite {

class CpuRoute {
 public:
  using Hook = ShmChannel::Hook;
  virtual ~CpuRoute() = default;
  // Named in errors: "failed in <name>: ...".
  virtual std::string name() const = 0;
  // Note [Fusing straight into shared memory] (shm_channel.h): whether the route has memory of
  // its own that a batch can be fused into; if not, the executor fuses through a buffer.
  // `bytes`: the batch's, on the wire; `casts`: some member is of another dtype (Note [Casting
  // on the wire] in executor.h), which the single-copy path cannot take in place.
  virtual bool FusesInPlace(int64_t bytes, bool casts) const { return false; }
  // Only where FusesInPlace(): reduces the pieces in the route's memory and writes each result
  // to its output.
  virtual void AllreducePieces(const std::vector<ShmChannel::Piece>& pieces, c10::ScalarType dtype,
                               ReduceOp op, const Hook& prescale, const Hook& finish) {}
  // Allreduces a flat contiguous tensor (already prescaled) and applies `finish` to each part
  // as soon as that part is reduced (the others may still be in flight), so averaging and
  // postscaling overlap the rest of the collective.
  virtual void AllreduceFlat(at::Tensor& flat, ReduceOp op, const Hook& finish) = 0;
  // Note [Pipelined fusion over channels]: allreduces `n` elements that the caller fills and
  // empties by element range, staged in `buffer`: n elements, or fewer where StreamsThrough()
  // (Note [Streaming a batch through its buffer]). `part` is where [begin, end) is staged.
  // By default: everything in, AllreduceFlat, everything out.
  using Range = std::function<void(int64_t begin, int64_t end)>;
  using PartRange = std::function<void(int64_t begin, int64_t end, at::Tensor& part)>;
  struct Staging {
    PartRange copy_in;   // fills (and prescales) [begin, end) into `part`
    Hook finish;         // applied to each reduced part before it is copied out
    PartRange copy_out;  // writes [begin, end) from `part` back to the members
    Range prefault;      // may be empty: Note [Prefaulting outputs while the link works]
  };
  virtual void AllreduceStaged(at::Tensor& buffer, int64_t n, ReduceOp op, const Staging& staging) {
    at::Tensor all = CoverAll(buffer, n);
    staging.copy_in(0, n, all);
    AllreduceFlat(all, op, staging.finish);
    staging.copy_out(0, n, all);
  }
  // Note [Streaming a batch through its buffer]: whether AllreduceStaged takes more elements
  // than a buffer of `buffer_bytes` holds.
  virtual bool StreamsThrough(int64_t buffer_bytes) const { return false; }
  // Data movement (Note [CPU routes]): whether the route carries allgather and broadcast; if
  // not, the executor sends them through Gloo. outputs[r] receives rank r's `input`.
  virtual bool MovesData() const { return false; }
  virtual void Allgather(const at::Tensor& input, std::vector<at::Tensor>& outputs) {}
  virtual void Broadcast(at::Tensor& tensor, int root) {}

 protected:
  // The first n elements of a buffer that must hold them all.
  static at::Tensor CoverAll(at::Tensor& buffer, int64_t n);
  // A staging buffer too small for n elements on this route, and why.
  static std::logic_error TooSmall(const at::Tensor& buffer, int64_t n, const char* why);
};

// Note [Transport plan]: the route Python chose at init() (hvdlite/_runtime/groups.py,
// TransportPlan), by the candidates of Note [CPU routes] in that order.
enum class CpuRouteKind { kHierarchical, kSharedMemory, kGlooChannels };
// The plan's route names, as Python spells them; false for any other.
bool ParseCpuRouteKind(const std::string& name, CpuRouteKind* kind);

// What the engine was given; the pointers stay owned by the engine.
struct CpuRouteInputs {
  CpuRouteKind kind = CpuRouteKind::kGlooChannels;
  std::vector<CollectiveBackend*> channels;  // the Gloo groups for CPU data, at least one
  ShmChannel* shm = nullptr;                 // this host's ranks' channel, if open
  CollectiveBackend* cross = nullptr;        // hierarchical only: the hosts' first ranks
};

// The route of `inputs.kind`; std::invalid_argument where the inputs lack what it needs (a
// shared-memory route without a channel, a hierarchical one with neither a channel nor a
// cross-host group, no Gloo group).
std::unique_ptr<CpuRoute> MakeCpuRoute(const CpuRouteInputs& inputs);

}  // namespace hvdlite
