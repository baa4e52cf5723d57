// Executor: runs one planned Batch on this rank: takes the local entries out of the queue,
// copies inputs into the fusion buffer, runs one collective through the backend for the
// tensors' device type, copies results out, applies averaging and scale factors, and completes
// the handles. Called on whichever thread runs the round: the background thread, or a waiting
// caller that holds the engine's round lock (Note [A waiting caller runs the round] in
// round_driver.h), so one batch at a time. It has no lock of its own: it takes the queue's and the
// handle table's mutexes only to take its entries and to complete their handles.
//
// A failed item (mismatch, stall) completes its handle with the item's status. A rank that has
// joined takes part in the others' collectives with a neutral input (Note [Join] in
// controller.h). An exception while running a batch completes the batch's handles with the
// error and is thrown on to the engine, which stops (Note [Fatal errors] in engine.h): as a
// StatusError (kInternal) when it came before the collective started, i.e. this rank could
// not take part (out of memory for a fusion buffer), else unchanged (the transport failed).
//
// The code is split by concept: executor.cc dispatches a batch and completes its handles,
// executor_reduce.cc runs reductions (fusion, then the route: cpu_route.cc), executor_data.cc the
// collectives that only move data, inline_payloads.cc the results computed from payloads.
//
// Note [Casting on the wire]
// Compression.fp16 and bf16 send floating-point tensors as a narrower dtype. Cast in Python,
// that cost a fresh tensor and a pass over the data on each side of the collective (measured:
// docs/performance.md, Design measurements). So the caller may give a wire dtype at enqueue
// (allreduce only), the request carries it as its dtype, and the executor casts as it copies
// each member into the fusion buffer, which is of the wire dtype, and back out into the
// member's own dtype; over the channels the pipelined copies (Note [Pipelined fusion over
// channels] in cpu_route.h) cast chunk by chunk while other chunks travel, and an inlined
// tensor sends its bytes cast. Everything negotiated, the
// agreement, the fusion and its byte threshold, is about the wire dtype, as when Python casts,
// so a rank that passes float16 tensors fuses and agrees with one that casts float32 ones. The
// prescale, the reduction, the average and the postscale all happen in the wire dtype and only
// then is the result cast back: on two ranks bit for bit what casting in Python gives (on more,
// a ring's summation order follows how the buffer is cut, as it does for any dtype). A batch
// that casts fuses straight into shared memory too, cast on the copies into and out of the
// segment (ShmChannel::Piece), except where the single-copy path would take it: peers there
// read each rank's memory as it is, so it goes through the fusion buffer. It never reduces a
// lone tensor in place.
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
#include "cpu_route.h"
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
  // `cpu` moves CPU data (broadcast, allgather, alltoall); `cpu_route` carries CPU
  // reductions (Note [CPU routes] in cpu_route.h); `cuda` may be null when the job has no
  // CUDA process group.
  Executor(int rank, int size, CollectiveBackend* cpu, std::unique_ptr<CpuRoute> cpu_route,
           CollectiveBackend* cuda, TensorQueue* queue, HandleTable* handles, Timeline* timeline);

  void Execute(const Batch& batch);
  // Note [Streaming a batch through its buffer] (cpu_route.h): the fusion threshold this round
  // plans with (it sizes the buffer that larger CPU batches stream through), and whether the
  // CPU route streams through a buffer of that size.
  void SetFusionThreshold(int64_t bytes) { fusion_threshold_bytes_ = bytes; }
  bool StreamsCpuBatches() const { return cpu_route_->StreamsThrough(fusion_threshold_bytes_); }
  void ReleaseBuffers() { buffers_.Clear(); }
  // The way CPU reductions travel (Note [CPU routes]), for logs and the timeline.
  std::string CpuRouteName() const { return cpu_route_->name(); }

 private:
  struct Local {
    const ReadyItem* item;
    Entry entry;
    bool neutral = false;  // synthesized for a joined rank: nothing to complete
    std::vector<int64_t> aux;
  };
  CollectiveBackend* BackendFor(c10::Device device);
  // Every member's input and output can be copied by byte range.
  static bool AllMemcpyable(const std::vector<Local>& locals);
  // The members' memory as pieces (empty members left out): the shared-memory route fuses them
  // straight (Note [Fusing straight into shared memory]), and any overlap among them keeps a
  // batch out of slots reused (Note [Streaming a batch through its buffer]).
  static std::vector<ShmChannel::Piece> PiecesOf(const std::vector<Local>& locals, c10::ScalarType wire);
  // The fusion buffer for a batch of `total` elements staged whole: the pooled one, or one of
  // its own for a batch planned past the threshold.
  at::Tensor BatchBuffer(const std::vector<Local>& locals, c10::ScalarType wire, int64_t total);
  // What a failed collective of `kind` on `device` went through, for the error.
  std::string RouteName(CollectiveKind kind, c10::Device device, CollectiveBackend* backend) const;
  // Execute's steps: the entries this rank takes part with; the collective and its errors;
  // the device bookkeeping after it; the handles' completion.
  std::vector<Local> TakeLocals(const Batch& batch);
  void RunOrFail(std::vector<Local>& locals, CollectiveBackend* backend, c10::Device device);
  std::shared_ptr<c10::Event> RecordDone(std::vector<Local>& locals, c10::Device device);
  void Complete(std::vector<Local>& locals, const std::shared_ptr<c10::Event>& done_event);
  Entry NeutralEntry(const ReadyItem& item);
  // Note [Reduce paths] (executor_reduce.cc): a reduction batch as every path sees it, the
  // paths in order of preference, and each path's test and run.
  struct ReduceBatch {
    std::vector<Local>& locals;
    CollectiveBackend* backend;
    const Request& request;
    c10::ScalarType wire;  // Note [Casting on the wire]
    ReduceOp wire_op;      // kSum for an average (divided by `finish`)
    int64_t total = 0;     // elements, all members
    bool casts = false;    // some member is of another dtype than `wire`
    bool scatter = false;  // a reducescatter
    bool cpu = false;      // the members are CPU tensors
    std::function<void(at::Tensor&)> finish;  // the average and postscale of a reduced part
    std::vector<ShmChannel::Piece> pieces;    // set by IntoRouteEnabled
  };
  struct ReducePath {
    const char* name;
    bool (Executor::*enabled)(ReduceBatch&) const;
    void (Executor::*run)(ReduceBatch&);
  };
  static const ReducePath kReducePaths[];
  void Reduce(std::vector<Local>& locals, CollectiveBackend* backend);
  bool IntoRouteEnabled(ReduceBatch& batch) const;
  void ReduceIntoRoute(ReduceBatch& batch);
  bool LoneStagedEnabled(ReduceBatch& batch) const;
  void ReduceLoneStaged(ReduceBatch& batch);
  bool LoneInPlaceEnabled(ReduceBatch& batch) const;
  void ReduceLoneInPlace(ReduceBatch& batch);
  bool ByRangeEnabled(ReduceBatch& batch) const;
  void ReduceByRange(ReduceBatch& batch);
  bool ThroughBufferEnabled(ReduceBatch& batch) const;
  void ReduceThroughBuffer(ReduceBatch& batch);
  // Allreduces a flat contiguous tensor (a CPU one through the CPU route) and applies
  // `finish` to each part as soon as that part is reduced (CpuRoute::AllreduceFlat).
  void AllreduceFlat(at::Tensor& flat, ReduceOp op, CollectiveBackend* backend,
                     const std::function<void(at::Tensor&)>& finish);
  void Broadcast(std::vector<Local>& locals, CollectiveBackend* backend);
  // One broadcast of a contiguous tensor, through the CPU route where it moves data.
  void BroadcastOn(at::Tensor& tensor, int root, CollectiveBackend* backend);
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
  CollectiveBackend* cpu_;
  std::unique_ptr<CpuRoute> cpu_route_;
  CollectiveBackend* cuda_;
  TensorQueue* queue_;
  HandleTable* handles_;
  FusionBufferPool buffers_;
  int64_t fusion_threshold_bytes_ = 0;  // SetFusionThreshold
  std::map<std::pair<int, int>, c10::Stream> streams_;
  Timeline* timeline_;
  bool collective_started_ = false;  // the current batch reached its collective
  int64_t collective_start_us_ = 0;
  int64_t collective_end_us_ = 0;
};

}  // namespace hvdlite
