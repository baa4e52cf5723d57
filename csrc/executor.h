// Executor: runs one planned Batch on this rank: takes the local entries out of the queue,
// copies inputs into the fusion buffer, runs one collective through the backend for the
// tensors' device type, copies results out, applies averaging and scale factors, and completes
// the handles. Background thread only.
//
// A failed item (mismatch, stall) completes its handle with the item's status. A rank that has
// joined takes part in the others' collectives with a neutral input (Note [Join] in
// controller.h). An exception while running a batch completes the batch's handles with the
// error and is thrown on to the engine, which stops (Note [Fatal errors] in engine.h): as a
// StatusError (kInternal) when it came before the collective started, i.e. this rank could
// not take part (out of memory for a fusion buffer), else unchanged (the transport failed).
//
// The code is split by concept: executor.cc dispatches a batch and completes its handles,
// executor_reduce.cc runs reductions (fusion, striping over channels), executor_data.cc the
// collectives that only move data, inline_payloads.cc the results computed from payloads.
//
// Note [Hierarchical allreduce]
// HVDLITE_HIERARCHICAL_ALLREDUCE=1, in a job whose ranks span several hosts: each host's ranks
// reduce through their shared-memory channel, the first rank of each host allreduces that sum
// with the other hosts' first ranks over a Gloo group of its own ("cross"), and the host's
// ranks copy the result out of the channel (ShmChannel::Allreduce with `across`), chunk by
// chunk. Only one rank per host sends across the network, once per byte, where the flat ring
// over every rank crosses hosts at several places. CPU allreduces and reducescatters only.
//
// Note [CPU channels]
// A Gloo allreduce of one large buffer does not keep loopback TCP busy: on the 2-rank
// reference machine a 64 MB allreduce took 49-51 ms through one process group, 42-48 ms split
// in two halves over two groups at once, and 37-44 ms in four quarters over four; at 16 MB two
// groups took 10.5 ms against 13.7 ms, while below ~4 MB the extra waits cost more than they
// save. So the engine holds HVDLITE_CPU_CHANNELS Gloo groups for CPU data (rank 0's value,
// agreed at init), and an allreduce of at least 2 x kStripeBytes is cut into equal stripes of
// at least kStripeBytes, one per channel, started together and waited for together. The cut
// depends only on the element count and the channel count, so every rank cuts the same way.
#pragma once

#include <c10/core/Stream.h>
#include <c10/util/Exception.h>

#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"
#include "fusion.h"
#include "shm_channel.h"
#include "status_error.h"
#include "tensor_queue.h"
#include "timeline.h"

namespace hvdlite {

// An exception's message without c10's backtrace, for statuses that users read.
inline std::string ExceptionText(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

class Executor {
 public:
  // `cpu` holds at least one backend (Note [CPU channels]); `cuda` may be null when the job
  // has no CUDA process group.
  Executor(int rank, int size, std::vector<CollectiveBackend*> cpu, CollectiveBackend* cuda,
           TensorQueue* queue, HandleTable* handles, Timeline* timeline);

  void Execute(const Batch& batch);
  void ReleaseBuffers() { buffers_.Clear(); }
  // Note [Shared-memory allreduce]: from now on every CPU allreduce goes through `shm`.
  void UseSharedMemory(ShmChannel* shm) { shm_ = shm; }
  // Note [Hierarchical allreduce]: CPU allreduces go through `local` (this host's ranks; null
  // when this rank is alone on its host) and, on each host's first rank, `cross`.
  void UseHierarchical(ShmChannel* local, CollectiveBackend* cross) {
    hierarchical_ = true;
    shm_ = local;
    cross_ = cross;
  }

 private:
  struct Local {
    const ReadyItem* item;
    Entry entry;
    bool neutral = false;  // synthesized for a joined rank: nothing to complete
    std::vector<int64_t> aux;
  };
  CollectiveBackend* BackendFor(c10::Device device);
  bool UsesSharedMemory(CollectiveKind kind, c10::Device device) const;
  Entry NeutralEntry(const ReadyItem& item);
  void Reduce(std::vector<Local>& locals, CollectiveBackend* backend);
  // Allreduces a flat contiguous tensor, striped over the CPU channels when it is large, and
  // applies `finish` to each part as soon as that part is reduced (the others may still be in
  // flight): averaging and postscaling overlap the rest of the collective.
  void AllreduceFlat(at::Tensor& flat, ReduceOp op, CollectiveBackend* backend,
                     const std::function<void(at::Tensor&)>& finish);
  void Broadcast(std::vector<Local>& locals, CollectiveBackend* backend);
  void Allgather(Local& local, CollectiveBackend* backend);
  void Alltoall(Local& local, CollectiveBackend* backend);
  void FromPayloads(Local& local);
  void Run(std::vector<Local>& locals, CollectiveBackend* backend);
  void Fail(std::vector<Local>& locals, const Status& status);
  c10::Stream EngineStream(c10::Device device);
  // Timeline: brackets the collective itself inside a batch's execution.
  void CollectiveStarts() {
    collective_started_ = true;
    collective_start_us_ = timeline_->enabled() ? MonotonicMicros() : 0;
  }
  void CollectiveEnds() { collective_end_us_ = timeline_->enabled() ? MonotonicMicros() : 0; }
  void Trace(const std::vector<Local>& locals, int64_t start_us, int64_t end_us);

  int rank_;
  int size_;
  std::vector<CollectiveBackend*> cpu_;  // cpu_[0] serves everything that is not striped
  CollectiveBackend* cuda_;
  ShmChannel* shm_ = nullptr;  // owned by the engine
  bool hierarchical_ = false;
  CollectiveBackend* cross_ = nullptr;  // owned by the engine; hierarchical, first rank of a host
  TensorQueue* queue_;
  HandleTable* handles_;
  FusionBufferPool buffers_;
  std::map<std::pair<int, int>, c10::Stream> streams_;
  Timeline* timeline_;
  bool collective_started_ = false;  // the current batch reached its collective
  int64_t collective_start_us_ = 0;
  int64_t collective_end_us_ = 0;
};

}  // namespace hvdlite
