#include "torch_backend.h"

#include <ATen/core/ivalue.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <exception>
#include <utility>

namespace hvdlite {
namespace {

std::exception_ptr DistError(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

// c10d's reduce op as the engine's, with PREMUL_SUM's constant as a prescale factor.
std::pair<ReduceOp, double> EngineOp(const c10d::ReduceOp& op, const char* what) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return {ReduceOp::kSum, 1.0};
    case c10d::ReduceOp::AVG: return {ReduceOp::kAverage, 1.0};
    case c10d::ReduceOp::PRODUCT: return {ReduceOp::kProduct, 1.0};
    case c10d::ReduceOp::MIN: return {ReduceOp::kMin, 1.0};
    case c10d::ReduceOp::MAX: return {ReduceOp::kMax, 1.0};
    case c10d::ReduceOp::PREMUL_SUM: {
      const auto* factor = dynamic_cast<const c10d::PreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK_NOT_IMPLEMENTED(factor != nullptr && !factor->tensor_factor.defined(),
                                  "hvdlite backend: ", what,
                                  " with PREMUL_SUM takes a Python number as its factor, not a tensor");
      return {ReduceOp::kSum, factor->double_factor};
    }
    default:
      C10_THROW_ERROR(NotImplementedError, std::string("hvdlite backend: ") + what +
                                               " does not support bitwise reduce ops (use a gloo group for "
                                               "BAND, BOR and BXOR)");
  }
}

std::vector<c10::Device> DevicesOf(const std::vector<EnqueueArgs>& args) {
  std::vector<c10::Device> devices;
  for (const EnqueueArgs& a : args) {
    if (a.input.defined() && !a.input.device().is_cpu()) {
      devices.push_back(a.input.device());
      break;
    }
  }
  return devices;
}

// Rows of one rank's part: the tensor as [1, numel] (its data moves as one row).
at::Tensor AsRow(const at::Tensor& t) { return t.reshape({1, t.numel()}); }

}  // namespace

TorchWork::TorchWork(std::shared_ptr<Engine> engine, int rank, c10d::OpType type, std::string what,
                     std::vector<int64_t> handles, WorkFinish finish, std::vector<c10::Device> devices)
    : c10d::Work(rank, type),
      engine_(std::move(engine)),
      what_(std::move(what)),
      handles_(std::move(handles)),
      finish_(std::move(finish)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                         std::move(devices))) {}

bool TorchWork::isCompleted() { return future_->completed(); }

bool TorchWork::isSuccess() const { return future_->completed() && !future_->hasError(); }

bool TorchWork::wait(std::chrono::milliseconds timeout) {
  // The engine fails a stalled or lost operation by itself (the stall check, which the
  // creator sets to the process group's timeout, and a dead peer at once), so a plain wait
  // needs no timer. A wait with a timeout of its own (work.wait(timeout), monitored_barrier)
  // gives up after it, as c10d's other backends do; the operation stays with the engine. A
  // caller blocks here: the engine may spin for it.
  if (!future_->completed()) {
    engine_->AddWaiter();
    const bool done = WaitFutureFor(future_, timeout);
    engine_->RemoveWaiter();
    if (!done) {
      C10_THROW_ERROR(DistBackendError, "hvdlite backend: " + what_ + " did not complete within " +
                                            std::to_string(timeout.count()) +
                                            " ms (the wait's timeout); the engine's stall check names the "
                                            "ranks that have not submitted it");
    }
  }
  if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  return true;
}

std::vector<at::Tensor> TorchWork::result() {
  future_->wait();
  if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  return future_->value().toTensorVector();
}

TorchBackend::TorchBackend(std::shared_ptr<Engine> engine, c10::intrusive_ptr<c10d::Backend> link,
                           std::chrono::milliseconds timeout, std::shared_ptr<ShmChannel> messages,
                           c10::intrusive_ptr<c10d::Backend> cuda_link)
    : c10d::Backend(engine->rank(), engine->size()), engine_(std::move(engine)), cuda_link_(std::move(cuda_link)) {
  if (messages && ShmPointToPoint::Usable(*messages)) {
    p2p_ = ShmPointToPoint::Make(std::move(messages), timeout);
  } else if (link) {
    p2p_ = std::make_shared<PointToPoint>(std::move(link), rank_, size_, timeout);
  }
  completer_ = std::thread([this] { CompleteLoop(); });
  {
    std::lock_guard<std::mutex> lock(mu_);
    deliverers_.emplace_back([this] { DeliverLoop(); });
  }
}

TorchBackend::~TorchBackend() { shutdown(); }

void TorchBackend::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  std::shared_ptr<MessagePath> p2p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    p2p.swap(p2p_);
  }
  p2p.reset();  // fails its pending operations and joins its threads (unless a call still holds it)
  {
    std::lock_guard<std::mutex> lock(mu_);
    cuda_link_.reset();  // the engine holds the NCCL group itself
  }
  engine_->Shutdown();  // fails what is pending, so the completion thread is not blocked
  cv_.notify_all();
  if (completer_.joinable()) completer_.join();  // it delivers everything it took
  delivery_cv_.notify_all();
  for (std::thread& deliverer : deliverers_) {  // no thread is added once stopping_ is set
    if (deliverer.joinable()) deliverer.join();
  }
  // Let go of the engine (its process groups, their sockets); works still held elsewhere keep
  // it until they go.
  engine_.reset();
}

void TorchBackend::Deliver(std::function<void()> complete) {
  std::lock_guard<std::mutex> lock(mu_);
  deliveries_.push_back(std::move(complete));
  // Every thread is inside a callback, which may be waiting for this work (one that a callback
  // starts and waits for completes while its thread is busy, so it gets a thread).
  if (busy_deliverers_ == deliverers_.size() && !stopping_) deliverers_.emplace_back([this] { DeliverLoop(); });
  delivery_cv_.notify_one();
}

void TorchBackend::DeliverLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    delivery_cv_.wait(lock, [this] { return !deliveries_.empty() || (stopping_ && !completer_running_); });
    if (deliveries_.empty()) return;
    std::function<void()> complete = std::move(deliveries_.front());
    deliveries_.pop_front();
    ++busy_deliverers_;
    lock.unlock();
    complete();
    lock.lock();
    --busy_deliverers_;
  }
}

void TorchBackend::CompleteLoop() {
  for (;;) {
    c10::intrusive_ptr<TorchWork> work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
      if (pending_.empty()) {  // stopping, nothing left
        completer_running_ = false;
        delivery_cv_.notify_all();
        return;
      }
      work = std::move(pending_.front());
      pending_.pop_front();
    }
    std::vector<at::Tensor> outputs;
    std::vector<std::vector<int64_t>> aux;
    std::vector<Status> statuses;
    engine_->WaitAll(work->handles_, &outputs, &aux, &statuses, /*as_caller=*/false);
    const Status* failed = nullptr;
    for (const Status& s : statuses) {
      if (!s.ok()) {
        failed = &s;
        break;
      }
    }
    if (failed != nullptr) {
      if (failed->code() == StatusCode::kRankFailure || failed->code() == StatusCode::kStall) {
        int none = 0;
        error_.compare_exchange_strong(none, static_cast<int>(failed->code() == StatusCode::kStall
                                                                  ? c10d::ErrorType::TIMEOUT
                                                                  : c10d::ErrorType::COMM_ERROR));
      }
      std::exception_ptr error = DistError("hvdlite backend: " + failed->message());
      Deliver([work, error] { work->future_->setError(error); });
      continue;
    }
    std::vector<at::Tensor> result;
    try {
      result = work->finish_(outputs);
    } catch (const std::exception& e) {
      std::exception_ptr error = DistError("hvdlite backend: " + work->what_ + ": " + e.what());
      Deliver([work, error] { work->future_->setError(error); });
      continue;
    }
    Deliver([work, result = std::move(result)]() mutable { work->future_->markCompleted(c10::IValue(std::move(result))); });
  }
}

EnqueueArgs TorchBackend::Request(CollectiveKind kind, const at::Tensor& input, const at::Tensor& output) const {
  EnqueueArgs a;
  a.kind = kind;
  a.input = input;
  a.output = output;
  return a;
}

c10::intrusive_ptr<c10d::Work> TorchBackend::Submit(c10d::OpType type, const std::string& what,
                                                    std::vector<EnqueueArgs> args, WorkFinish finish) {
  std::shared_ptr<Engine> engine;  // shutdown() lets go of engine_; this call keeps its own
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!stopping_, "hvdlite backend: ", what, " after the process group was shut down");
    engine = engine_;
  }
  sequence_.fetch_add(1);
  // Note [Engine behind a process group]: names in call order; a call of several tensors is
  // one group, which the engine runs as one (fused) operation.
  if (args.size() == 1) {
    args[0].name = engine->NewName("c10d." + what);
  } else {
    const std::string group = engine->NewName("c10d." + what);
    for (size_t i = 0; i < args.size(); ++i) {
      args[i].group = group;
      args[i].name = group + "." + std::to_string(i);
    }
  }
  std::vector<c10::Device> devices = DevicesOf(args);
  std::vector<int64_t> handles;
  Status status = engine->Enqueue(std::move(args), &handles);
  if (!status.ok()) C10_THROW_ERROR(DistBackendError, "hvdlite backend: " + status.message());
  auto work = c10::make_intrusive<TorchWork>(engine, rank_, type, what, std::move(handles), std::move(finish),
                                             std::move(devices));
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!stopping_, "hvdlite backend: ", what, " after the process group was shut down");
    pending_.push_back(work);
  }
  cv_.notify_one();
  return work;
}

// ---- reductions -----------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> TorchBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  const auto [op, prescale] = EngineOp(opts.reduceOp, "allreduce");
  std::vector<EnqueueArgs> args;
  for (at::Tensor& t : tensors) {
    args.push_back(Request(CollectiveKind::kAllreduce, t, t));  // in place: no copy
    args.back().op = op;
    args.back().prescale = prescale;
  }
  std::vector<at::Tensor> results = tensors;
  return Submit(c10d::OpType::ALLREDUCE, "allreduce", std::move(args),
                [results](std::vector<at::Tensor>&) { return results; });
}

c10::intrusive_ptr<c10d::Work> TorchBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                 const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::reduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::ReduceOptions& opts) {
  TORCH_CHECK(tensors.size() == 1, "hvdlite backend: reduce takes one tensor");
  const auto [op, prescale] = EngineOp(opts.reduceOp, "reduce");
  at::Tensor target = tensors[0];
  const bool root = opts.rootRank == rank_;
  // Only the root's tensor receives the result; the others keep theirs.
  at::Tensor work_tensor = root ? target : target.clone();
  std::vector<EnqueueArgs> args{Request(CollectiveKind::kAllreduce, work_tensor, work_tensor)};
  args[0].op = op;
  args[0].prescale = prescale;
  return Submit(c10d::OpType::REDUCE, "reduce", std::move(args),
                [target](std::vector<at::Tensor>&) { return std::vector<at::Tensor>{target}; });
}

c10::intrusive_ptr<c10d::Work> TorchBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(input.numel() == output.numel() * size_,
              "hvdlite backend: reduce_scatter_tensor: the input has ", input.numel(),
              " elements, expected the output's ", output.numel(), " times the group's size ", size_);
  const auto [op, prescale] = EngineOp(opts.reduceOp, "reduce_scatter_tensor");
  // One row per rank: the engine's reducescatter hands rank r row r of the reduced input.
  std::vector<EnqueueArgs> args{Request(CollectiveKind::kReducescatter, input.reshape({size_, output.numel()}),
                                        at::Tensor())};
  args[0].op = op;
  args[0].prescale = prescale;
  at::Tensor target = output;
  return Submit(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", std::move(args),
                [target](std::vector<at::Tensor>& out) {
                  target.copy_(out[0].view(target.sizes()));
                  return std::vector<at::Tensor>{target};
                });
}

c10::intrusive_ptr<c10d::Work> TorchBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == 1 && inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
              "hvdlite backend: reduce_scatter takes one output and one input per rank");
  std::vector<at::Tensor> rows;
  for (const at::Tensor& t : inputs[0]) {
    TORCH_CHECK(t.numel() == outputs[0].numel(), "hvdlite backend: reduce_scatter: input of ", t.numel(),
                " elements for an output of ", outputs[0].numel());
    rows.push_back(AsRow(t));
  }
  at::Tensor stacked = at::cat(rows, 0);
  return _reduce_scatter_base(outputs[0], stacked, opts);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "hvdlite backend: reduce_scatter_tensor_coalesced: ",
              outputs.size(), " outputs for ", inputs.size(), " inputs");
  const auto [op, prescale] = EngineOp(opts.reduceOp, "reduce_scatter_tensor_coalesced");
  std::vector<EnqueueArgs> args;
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].numel() == outputs[i].numel() * size_,
                "hvdlite backend: reduce_scatter_tensor_coalesced: input ", i, " has ", inputs[i].numel(),
                " elements, expected ", outputs[i].numel() * size_);
    args.push_back(Request(CollectiveKind::kReducescatter, inputs[i].reshape({size_, outputs[i].numel()}),
                           at::Tensor()));
    args.back().op = op;
    args.back().prescale = prescale;
  }
  std::vector<at::Tensor> targets = outputs;
  return Submit(c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED, "reduce_scatter_tensor_coalesced",
                std::move(args), [targets](std::vector<at::Tensor>& out) {
                  for (size_t i = 0; i < targets.size(); ++i) targets[i].copy_(out[i].view(targets[i].sizes()));
                  return targets;
                });
}

// ---- data movement ----------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> TorchBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  std::vector<EnqueueArgs> args;
  for (at::Tensor& t : tensors) {
    args.push_back(Request(CollectiveKind::kBroadcast, t, t));
    args.back().root = static_cast<int>(opts.rootRank);
  }
  std::vector<at::Tensor> results = tensors;
  return Submit(c10d::OpType::BROADCAST, "broadcast", std::move(args),
                [results](std::vector<at::Tensor>&) { return results; });
}

c10::intrusive_ptr<c10d::Work> TorchBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                             const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(output.numel() == input.numel() * size_,
              "hvdlite backend: allgather_into_tensor: the output has ", output.numel(),
              " elements, expected the input's ", input.numel(), " times the group's size ", size_);
  // The engine writes straight into a contiguous output (no copy afterwards).
  std::vector<EnqueueArgs> args{Request(CollectiveKind::kAllgather, AsRow(input),
                                        output.is_contiguous() ? output : at::Tensor())};
  at::Tensor target = output;
  return Submit(c10d::OpType::_ALLGATHER_BASE, "allgather_into_tensor", std::move(args),
                [target](std::vector<at::Tensor>& out) {
                  if (out[0].data_ptr() != target.data_ptr()) target.copy_(out[0].view(target.sizes()));
                  return std::vector<at::Tensor>{target};
                });
}

c10::intrusive_ptr<c10d::Work> TorchBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                             std::vector<at::Tensor>& inputs,
                                                                             const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "hvdlite backend: allgather_into_tensor_coalesced: ",
              outputs.size(), " outputs for ", inputs.size(), " inputs");
  std::vector<EnqueueArgs> args;
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(outputs[i].numel() == inputs[i].numel() * size_,
                "hvdlite backend: allgather_into_tensor_coalesced: output ", i, " has ", outputs[i].numel(),
                " elements, expected ", inputs[i].numel() * size_);
    args.push_back(Request(CollectiveKind::kAllgather, AsRow(inputs[i]), at::Tensor()));
  }
  std::vector<at::Tensor> targets = outputs;
  return Submit(c10d::OpType::COALESCED, "allgather_into_tensor_coalesced", std::move(args),
                [targets](std::vector<at::Tensor>& out) {
                  for (size_t i = 0; i < targets.size(); ++i) targets[i].copy_(out[i].view(targets[i].sizes()));
                  return targets;
                });
}

c10::intrusive_ptr<c10d::Work> TorchBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "hvdlite backend: allgather: ", outputs.size(),
              " output lists for ", inputs.size(), " inputs");
  std::vector<EnqueueArgs> args;
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(static_cast<int>(outputs[i].size()) == size_, "hvdlite backend: allgather: ",
                outputs[i].size(), " outputs for a group of ", size_);
    args.push_back(Request(CollectiveKind::kAllgather, AsRow(inputs[i]), at::Tensor()));
  }
  std::vector<std::vector<at::Tensor>> targets = outputs;
  return Submit(c10d::OpType::ALLGATHER, "allgather", std::move(args),
                [targets](std::vector<at::Tensor>& out) {
                  std::vector<at::Tensor> flat;
                  for (size_t i = 0; i < targets.size(); ++i) {
                    for (size_t r = 0; r < targets[i].size(); ++r) {
                      targets[i][r].copy_(out[i][r].view(targets[i][r].sizes()));
                      flat.push_back(targets[i][r]);
                    }
                  }
                  return flat;
                });
}

c10::intrusive_ptr<c10d::Work> TorchBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) {
  // outputs[r][i] receives rank r's input i (the lists are per rank, unlike allgather's).
  TORCH_CHECK(static_cast<int>(outputs.size()) == size_, "hvdlite backend: all_gather_coalesced: ",
              outputs.size(), " output lists for a group of ", size_);
  std::vector<std::vector<at::Tensor>> per_input(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (int r = 0; r < size_; ++r) {
      TORCH_CHECK(outputs[r].size() == inputs.size() && outputs[r][i].numel() == inputs[i].numel(),
                  "hvdlite backend: all_gather_coalesced: the output list of rank ", r,
                  " does not match the inputs");
      per_input[i].push_back(outputs[r][i]);
    }
  }
  return allgather(per_input, inputs, opts);  // the same tensors, listed per input
}

c10::intrusive_ptr<c10d::Work> TorchBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::GatherOptions& opts) {
  TORCH_CHECK(inputs.size() == 1, "hvdlite backend: gather takes one input tensor");
  const bool root = opts.rootRank == rank_;
  TORCH_CHECK(!root || (outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_),
              "hvdlite backend: gather: the root needs one output per rank");
  std::vector<EnqueueArgs> args{Request(CollectiveKind::kAllgather, AsRow(inputs[0]), at::Tensor())};
  std::vector<at::Tensor> targets = root ? outputs[0] : std::vector<at::Tensor>{};
  return Submit(c10d::OpType::GATHER, "gather", std::move(args), [targets](std::vector<at::Tensor>& out) {
    for (size_t r = 0; r < targets.size(); ++r) targets[r].copy_(out[0][r].view(targets[r].sizes()));
    return targets;
  });
}

c10::intrusive_ptr<c10d::Work> TorchBackend::scatter(std::vector<at::Tensor>& outputs,
                                                     std::vector<std::vector<at::Tensor>>& inputs,
                                                     const c10d::ScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == 1, "hvdlite backend: scatter takes one output tensor");
  const bool root = opts.rootRank == rank_;
  TORCH_CHECK(!root || (inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_),
              "hvdlite backend: scatter: the root needs one input per rank");
  const int64_t n = outputs[0].numel();
  // An alltoall in which only the root sends: one row to every rank.
  at::Tensor rows;
  std::vector<int64_t> splits(size_, root ? 1 : 0);
  if (root) {
    std::vector<at::Tensor> parts;
    for (const at::Tensor& t : inputs[0]) parts.push_back(AsRow(t));
    rows = at::cat(parts, 0);
  } else {
    rows = at::empty({0, n}, outputs[0].options());
  }
  std::vector<EnqueueArgs> args{Request(CollectiveKind::kAlltoall, rows, at::Tensor())};
  args[0].splits = std::move(splits);
  at::Tensor target = outputs[0];
  return Submit(c10d::OpType::SCATTER, "scatter", std::move(args), [target](std::vector<at::Tensor>& out) {
    target.copy_(out[0].view(target.sizes()));
    return std::vector<at::Tensor>{target};
  });
}

c10::intrusive_ptr<c10d::Work> TorchBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                           std::vector<int64_t>& output_splits,
                                                           std::vector<int64_t>& input_splits,
                                                           const c10d::AllToAllOptions& opts) {
  std::vector<int64_t> splits = input_splits;
  if (splits.empty()) {
    TORCH_CHECK(input.dim() > 0 && input.size(0) % size_ == 0, "hvdlite backend: all_to_all_single: ",
                "without splits, dimension 0 of the input (", input.dim() > 0 ? input.size(0) : 0,
                ") must divide by the group's size ", size_);
    splits.assign(size_, input.size(0) / size_);
  }
  std::vector<EnqueueArgs> args{Request(CollectiveKind::kAlltoall, input, at::Tensor())};
  args[0].splits = std::move(splits);
  at::Tensor target = output;
  return Submit(c10d::OpType::ALLTOALL_BASE, "all_to_all_single", std::move(args),
                [target](std::vector<at::Tensor>& out) {
                  TORCH_CHECK(out[0].numel() == target.numel(), "received ", out[0].numel(),
                              " elements for an output of ", target.numel());
                  target.copy_(out[0].view(target.sizes()));
                  return std::vector<at::Tensor>{target};
                });
}

c10::intrusive_ptr<c10d::Work> TorchBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllToAllOptions& opts) {
  TORCH_CHECK(static_cast<int>(outputs.size()) == size_ && static_cast<int>(inputs.size()) == size_,
              "hvdlite backend: all_to_all takes one input and one output per rank");
  // One row of elements per input, the rows of different lengths flattened into one column.
  std::vector<at::Tensor> parts;
  std::vector<int64_t> splits;
  for (const at::Tensor& t : inputs) {
    parts.push_back(t.reshape({t.numel(), 1}));
    splits.push_back(t.numel());
  }
  std::vector<EnqueueArgs> args{Request(CollectiveKind::kAlltoall, at::cat(parts, 0), at::Tensor())};
  args[0].splits = std::move(splits);
  std::vector<at::Tensor> targets = outputs;
  return Submit(c10d::OpType::ALLTOALL, "all_to_all", std::move(args), [targets](std::vector<at::Tensor>& out) {
    int64_t offset = 0;
    for (const at::Tensor& t : targets) {
      t.copy_(out[0].narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
    return targets;
  });
}

c10::intrusive_ptr<c10d::Work> TorchBackend::barrier(const c10d::BarrierOptions& opts) {
  std::vector<EnqueueArgs> args{Request(CollectiveKind::kBarrier, at::empty({0}), at::Tensor())};
  return Submit(c10d::OpType::BARRIER, "barrier", std::move(args),
                [](std::vector<at::Tensor>&) { return std::vector<at::Tensor>{}; });
}

void TorchBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool /*wait_all_ranks*/) {
  // The engine names the ranks a barrier waits for when they stall (at the group's timeout)
  // or die; the barrier's own timeout bounds the wait.
  barrier(opts)->wait(opts.timeout);
}

void TorchBackend::abort() {
  std::shared_ptr<MessagePath> p2p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    p2p = p2p_;
  }
  // not under mu_: failing the pending operations runs their callbacks, which may call in
  if (p2p) p2p->Abort("the process group was aborted");
  int none = 0;
  error_.compare_exchange_strong(none, static_cast<int>(c10d::ErrorType::COMM_ERROR));
  shutdown();
}

c10d::ErrorType TorchBackend::getError() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (p2p_ && p2p_->error() != c10d::ErrorType::SUCCESS && error_.load() == 0) {
      return p2p_->error();
    }
  }
  return static_cast<c10d::ErrorType>(error_.load());
}

}  // namespace hvdlite
