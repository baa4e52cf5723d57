#include "backend_c10d.h"

namespace hvdlite {
namespace {

c10d::ReduceOp ToC10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kProduct: return c10d::ReduceOp::PRODUCT;
    default: return c10d::ReduceOp::SUM;
  }
}

class C10dBackend final : public CollectiveBackend {
 public:
  explicit C10dBackend(c10::intrusive_ptr<c10d::Backend> backend) : backend_(std::move(backend)) {}

  void Allreduce(at::Tensor& tensor, ReduceOp op) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = ToC10d(op);
    Finish(backend_->allreduce(tensors, options));
  }

  void Broadcast(at::Tensor& tensor, int root) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    Finish(backend_->broadcast(tensors, options));
  }

  void Allgather(at::Tensor& input, std::vector<at::Tensor>& outputs) override {
    std::vector<at::Tensor> inputs{input};
    std::vector<std::vector<at::Tensor>> output_lists{outputs};
    Finish(backend_->allgather(output_lists, inputs));
    // Gloo writes into the tensors it was given, which alias `outputs`; nothing to copy back.
  }

  void Alltoall(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                std::vector<int64_t>& input_splits) override {
    Finish(backend_->alltoall_base(output, input, output_splits, input_splits));
  }

  std::string name() const override { return backend_->getBackendName(); }

 private:
  static void Finish(const c10::intrusive_ptr<c10d::Work>& work) {
    // wait() rethrows the collective's failure (for example "Connection closed by peer").
    work->wait();
  }

  c10::intrusive_ptr<c10d::Backend> backend_;
};

}  // namespace

std::unique_ptr<CollectiveBackend> MakeC10dBackend(c10::intrusive_ptr<c10d::Backend> backend) {
  return std::make_unique<C10dBackend>(std::move(backend));
}

}  // namespace hvdlite
