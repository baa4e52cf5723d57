// TorchBackend: hvdlite's engine behind a torch.distributed process group, so that code written
// for torch.distributed (DDP, FSDP2, ZeroRedundancyOptimizer, torch.distributed.checkpoint)
// runs its collectives through the engine after init_process_group("hvdlite").
// Its collectives may be called from any thread: each enqueues into the engine and returns a
// TorchWork at once. A completion thread and a pool of delivery threads finish the works (Note
// [Engine behind a process group]); one mutex, mu_, guards what they share, and no lock is held
// while a callback runs.
//
// Note [Engine behind a process group]
// hvdlite/torch_backend.py registers the backend "hvdlite" with torch.distributed; for every
// process group torch creates with it, the creator builds an engine of its own from the store,
// rank and size torch hands over (the same start_engine as hvd.init(), so the group gets the
// agreement checks, fusion, shared memory, the stall check and named dead peers), and wraps it
// in a TorchBackend. Each c10d call becomes one enqueue of engine requests, under names drawn
// in call order from the engine (c10d requires every rank to issue the same collectives in
// the same order, so the n-th call has the same name everywhere: Note [Generated names]), and
// returns a TorchWork at once. One completion thread per backend waits for the works in the
// order they were submitted and copies results into the caller's tensors where the engine's
// output is its own (allgather, reducescatter, alltoall). Completing the work's future runs
// the callbacks chained on it (DDP chains its bucket callbacks there, so a future must
// complete by itself, not only when someone calls wait()), and a callback may itself start a
// collective and wait for it: PowerSGD's hook does. So the completion thread never runs
// callbacks; it hands each completion to a pool of delivery threads, which take them in order,
// and the pool grows by a thread when every thread it has is inside an earlier callback
// (perhaps waiting for this very work). The pool's threads live until shutdown() joins them: as many
// as callbacks were ever nested, one in a job whose callbacks start no collective.
// No lock and no GIL is held while callbacks run. A failed operation completes the future
// with a DistBackendError that carries the engine's message (the operation, the ranks, what
// differs or who was lost). The process group's timeout is the group engine's stall shutdown
// time (HVDLITE_STALL_SHUTDOWN_TIME_SECONDS, rank 0's timeout, unless that variable is set):
// an operation some rank has not submitted by then fails on every rank naming that rank, as
// hvdlite's own stalled operations do; a lost peer fails at once, whatever the timeout.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"
#include "point_to_point.h"
#include "shm_point_to_point.h"

namespace hvdlite {

// Turns the engine's outputs (one per request, in order) into the work's result, writing into
// the caller's tensors where the engine allocated its own.
using WorkFinish = std::function<std::vector<at::Tensor>(std::vector<at::Tensor>& outputs)>;

class TorchWork : public c10d::Work {
 public:
  TorchWork(std::shared_ptr<Engine> engine, int rank, c10d::OpType type, std::string what,
            std::vector<int64_t> handles, WorkFinish finish, std::vector<c10::Device> devices);
  bool isCompleted() override;
  bool isSuccess() const override;
  // Blocks until the work completes; rethrows its failure (a DistBackendError).
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override;

 private:
  friend class TorchBackend;
  std::shared_ptr<Engine> engine_;
  const std::string what_;  // "allreduce", ... for errors
  std::vector<int64_t> handles_;
  WorkFinish finish_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class TorchBackend : public c10d::Backend {
 public:
  // `link`: the Gloo group point-to-point messages travel through (Note [Point-to-point
  // messages] in point_to_point.h), `timeout` the process group's.
  // `messages`: the group's segment, when point-to-point may go through it (Note
  // [Point-to-point through shared memory] in shm_point_to_point.h); `cuda_link`: the engine's
  // NCCL group, which carries CUDA tensors' sends and receives (Note [CUDA point-to-point]).
  TorchBackend(std::shared_ptr<Engine> engine, c10::intrusive_ptr<c10d::Backend> link,
               std::chrono::milliseconds timeout, std::shared_ptr<ShmChannel> messages = nullptr,
               c10::intrusive_ptr<c10d::Backend> cuda_link = {});
  ~TorchBackend() override;
  const std::string getBackendName() const override { return "hvdlite"; }
  // Stops the engine and fails every pending operation; later calls raise.
  void shutdown() override;
  // As shutdown(), never waiting for a peer: what a fault-tolerance layer calls on a failure.
  void abort() override;
  // SUCCESS, or COMM_ERROR once an operation failed because a peer was lost or the group was
  // aborted (TIMEOUT when it was a stall).
  c10d::ErrorType getError() override;
  // The point-to-point operations in flight, one line each (who waits for whom).
  std::vector<std::string> pendingPointToPoint() const;
  // Sequence numbers, which torch's debug wrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL) reads: the
  // number of operations this group has started since set.
  void setSequenceNumberForGroup() override { sequence_.store(0); }
  uint64_t getSequenceNumberForGroup() override { return sequence_.load(); }
  // "shared_memory", "gloo", or "" after shutdown: what carries send and recv.
  std::string pointToPointPath() const;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  // Enqueues `args` (named here, in call order) and hands the work to the completion thread.
  c10::intrusive_ptr<c10d::Work> Submit(c10d::OpType type, const std::string& what, std::vector<EnqueueArgs> args,
                                        WorkFinish finish);
  // One request of `kind` on `input`, `output` (undefined: the engine allocates it).
  EnqueueArgs Request(CollectiveKind kind, const at::Tensor& input, const at::Tensor& output) const;
  void CompleteLoop();
  // The point-to-point half, or a clear error (after shutdown, or a group made without one).
  std::shared_ptr<MessagePath> Messages(const char* what);
  // Note [CUDA point-to-point]
  // A CUDA tensor's send and receive go to the engine's NCCL group as they are: NCCL matches
  // a pair's messages in order (tags are not matched), orders them on its own streams after the
  // caller's, and cannot receive from any source (refused with a clear error). The header and
  // verdict of the CPU paths, which name a mismatch on both ranks, are not sent: a mismatched
  // receive is NCCL's error. Written against ProcessGroupNCCL's send/recv; tests/cuda runs it
  // where two GPUs are present.
  c10::intrusive_ptr<c10d::Backend> CudaMessages(const char* what);
  // Note [Engine behind a process group]: runs `complete` on an idle delivery thread, or on a
  // new one where every delivery thread is inside a callback.
  void Deliver(std::function<void()> complete);
  void DeliverLoop();

  std::shared_ptr<Engine> engine_;
  std::shared_ptr<MessagePath> p2p_;  // null after shutdown
  c10::intrusive_ptr<c10d::Backend> cuda_link_;  // under mu_; null without CUDA and after shutdown
  std::atomic<int> error_{0};          // a c10d::ErrorType: the first failure's kind
  std::atomic<uint64_t> sequence_{0};  // operations started (getSequenceNumberForGroup)
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<TorchWork>> pending_;  // under mu_, in submission order
  bool stopping_ = false;                              // under mu_
  bool completer_running_ = true;                      // under mu_
  std::thread completer_;
  std::deque<std::function<void()>> deliveries_;  // under mu_
  size_t busy_deliverers_ = 0;                    // under mu_: delivery threads inside a callback
  std::condition_variable delivery_cv_;
  std::vector<std::thread> deliverers_;           // grows under mu_, never after stopping_
};

}  // namespace hvdlite
