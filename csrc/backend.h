// CollectiveBackend: the few collectives the core needs, for one kind of device. The real
// implementation (MakeC10dBackend, backend_c10d.h and backend_c10d.cc) is a thin layer over a
// c10d::Backend that Python created (Gloo for CPU tensors, NCCL for CUDA tensors); keeping this
// interface free of c10d headers keeps the rest of the core quick to compile and testable.
//
// Called on whichever thread runs the engine's rounds (the background thread, or a waiting
// caller that holds the engine's round lock: Note [A waiting caller runs the round] in
// round_driver.h), one call at a time (several started allreduces may be in flight at once), so an
// implementation needs no lock. StartAllreduce does not wait: it returns the allreduce in
// flight as a PendingWork (pipeline.h), whose Wait blocks until the collective is complete and
// rethrows its failure, and whose Done says without blocking whether it has ended. Allreduce is
// StartAllreduce followed by Wait. Broadcast, Allgather and Alltoall block until the collective
// is complete. For device backends, complete means ordered on the current stream. A failure
// (e.g. a peer that died) is thrown as a std::exception, by the call or by the pending work's
// Wait.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "pipeline.h"
#include "types.h"

namespace hvdlite {

class CollectiveBackend {
 public:
  virtual ~CollectiveBackend() = default;
  // op is kSum, kMin, kMax or kProduct (averaging is done by the executor).
  void Allreduce(at::Tensor& tensor, ReduceOp op) { StartAllreduce(tensor, op).Wait(); }
  // Starts an allreduce and returns it in flight (pipeline.h), so that a WorkWindow can run
  // parts of one buffer on several backends at once (Note [CPU channels] in cpu_route.h).
  virtual PendingWork StartAllreduce(at::Tensor& tensor, ReduceOp op) = 0;
  virtual void Broadcast(at::Tensor& tensor, int root) = 0;
  // outputs[r] receives rank r's input; all have the input's size.
  virtual void Allgather(at::Tensor& input, std::vector<at::Tensor>& outputs) = 0;
  // Rows of dimension 0: input rows input_splits[r] go to rank r, output_splits[r] come from it.
  virtual void Alltoall(at::Tensor& output, at::Tensor& input,
                        const std::vector<int64_t>& output_splits,
                        const std::vector<int64_t>& input_splits) = 0;
  // Point-to-point, bytes only: `bytes` (contiguous uint8) goes to `peer` under `tag`, or a
  // message from `peer` under `tag` lands in it (one shorter than `bytes` fills its front).
  // Messages of one (peer, tag) arrive in the order sent. Used by the control plane's
  // hypercube (hypercube.h); a backend without them throws.
  virtual PendingWork StartSend(at::Tensor& bytes, int peer, int tag) { return NoPointToPoint(); }
  virtual PendingWork StartRecv(at::Tensor& bytes, int peer, int tag) { return NoPointToPoint(); }
  // Whether only StartSend and StartRecv work (the control link: Note [Control link] in
  // control_link.h): the control channel then sends every round by its hypercube.
  virtual bool point_to_point_only() const { return false; }
  virtual std::string name() const = 0;

 private:
  PendingWork NoPointToPoint() const { throw std::logic_error(name() + " backend: no point-to-point"); }
};

}  // namespace hvdlite
