#include "backend_c10d.h"

#include <ATen/ops/empty.h>

#include <stdexcept>

namespace hvdlite {

// Note [Tensors handed to c10d]: a backend's worker thread may drop its reference to a tensor
// after the collective reports completion. If that is the last reference to a tensor Python
// created, torch takes the GIL to free the Python object, and a thread that holds the GIL
// while waiting for that worker (a process group being destroyed from Python) deadlocks with
// it. So c10d only ever gets tensors without a Python object: a new tensor on the same storage
// (not a view: a view keeps a reference to its base, the Python tensor). ByteRows below makes
// such aliases too.
at::Tensor Unowned(const at::Tensor& t) {
  at::Tensor alias = at::empty({0}, t.options());
  alias.set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
  return alias;
}

namespace {

c10d::ReduceOp ToC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kProduct: return c10d::ReduceOp::PRODUCT;
    default: return c10d::ReduceOp::SUM;
  }
}

// Note [Collectives that move bytes]: broadcast, allgather and alltoall only move data, so
// they get an alias of the (contiguous) tensor as [rows, bytes per row] of uint8. Every dtype
// torch has then travels (Gloo itself refuses int16, uint16, float8, ...), and alltoall's
// splits, counted in rows, keep their meaning.
at::Tensor ByteRows(const at::Tensor& t) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  const int64_t row_bytes = rows == 0 ? 0 : bytes / rows;
  at::Tensor alias = at::empty({0}, t.options().dtype(at::kByte));
  alias.set_(t.storage(), t.storage_offset() * static_cast<int64_t>(t.element_size()), {rows, row_bytes},
             {row_bytes, 1});
  return alias;
}

std::vector<at::Tensor> ByteRows(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> aliases;
  aliases.reserve(tensors.size());
  for (const at::Tensor& t : tensors) aliases.push_back(ByteRows(t));
  return aliases;
}

class C10dBackend final : public CollectiveBackend {
 public:
  C10dBackend(c10::intrusive_ptr<c10d::Backend> backend, std::chrono::milliseconds timeout)
      : backend_(std::move(backend)), timeout_(timeout) {}

  PendingWork StartAllreduce(at::Tensor& tensor, ReduceOp op) override {
    std::vector<at::Tensor> tensors{Unowned(tensor)};
    c10d::AllreduceOptions options;
    options.reduceOp = ToC10d(op);
    options.timeout = timeout_;
    c10::intrusive_ptr<c10d::Work> work = backend_->allreduce(tensors, options);
    return PendingWork([work] { Finish(work); }, [work] { return work->isCompleted(); });
  }

  void Broadcast(at::Tensor& tensor, int root) override {
    std::vector<at::Tensor> tensors{ByteRows(tensor)};  // Note [Collectives that move bytes]
    c10d::BroadcastOptions options;
    options.rootRank = root;
    options.timeout = timeout_;
    Finish(backend_->broadcast(tensors, options));
  }

  void Allgather(at::Tensor& input, std::vector<at::Tensor>& outputs) override {
    std::vector<at::Tensor> inputs{ByteRows(input)};  // Note [Collectives that move bytes]
    std::vector<std::vector<at::Tensor>> output_lists{ByteRows(outputs)};
    c10d::AllgatherOptions options;
    options.timeout = timeout_;
    Finish(backend_->allgather(output_lists, inputs, options));
    // The backend wrote into the storage of `outputs`; nothing to copy back.
  }

  void Alltoall(at::Tensor& output, at::Tensor& input, const std::vector<int64_t>& output_splits,
                const std::vector<int64_t>& input_splits) override {
    // c10d may move from the split vectors it is given: it gets copies.
    std::vector<int64_t> output_counts = output_splits, input_counts = input_splits;
    at::Tensor out = ByteRows(output), in = ByteRows(input);  // Note [Collectives that move bytes]
    c10d::AllToAllOptions options;
    options.timeout = timeout_;
    Finish(backend_->alltoall_base(out, in, output_counts, input_counts, options));
  }

  PendingWork StartSend(at::Tensor& bytes, int peer, int tag) override {
    std::vector<at::Tensor> tensors{Unowned(bytes)};
    return Pending(backend_->send(tensors, peer, tag), "send to", peer);
  }

  PendingWork StartRecv(at::Tensor& bytes, int peer, int tag) override {
    std::vector<at::Tensor> tensors{Unowned(bytes)};
    return Pending(backend_->recv(tensors, peer, tag), "receive from", peer);
  }

  std::string name() const override { return backend_->getBackendName(); }

 private:
  static void Finish(const c10::intrusive_ptr<c10d::Work>& work) {
    // wait() rethrows the collective's failure (for example "Connection closed by peer").
    work->wait();
  }

  // A point-to-point work: waits at most the collectives' timeout (unset: the group's own).
  PendingWork Pending(c10::intrusive_ptr<c10d::Work> work, const char* what, int peer) const {
    const std::chrono::milliseconds timeout = timeout_ == c10d::kUnsetTimeout ? kNoTimeout : timeout_;
    return PendingWork(
        [work, timeout, what, peer] {
          if (!work->wait(timeout)) {
            throw std::runtime_error(std::string("the ") + what + " rank " + std::to_string(peer) + " was aborted");
          }
        },
        [work] { return work->isCompleted(); });
  }

  c10::intrusive_ptr<c10d::Backend> backend_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

std::unique_ptr<CollectiveBackend> MakeC10dBackend(c10::intrusive_ptr<c10d::Backend> backend,
                                                   std::chrono::milliseconds timeout) {
  return std::make_unique<C10dBackend>(std::move(backend), timeout);
}

}  // namespace hvdlite
