// The point-to-point half of TorchBackend (torch_backend.h): which path carries a group's
// sends and receives. CPU tensors: the group's MessagePath, through shared memory on one host
// (Note [Point-to-point through shared memory] in shm_point_to_point.h) or over Gloo (Note
// [Point-to-point messages] in point_to_point.h), chosen when the group was made; CUDA tensors:
// the engine's NCCL group (Note [CUDA point-to-point] in torch_backend.h).
#include "torch_backend.h"

#include <c10/util/Exception.h>

namespace hvdlite {

std::shared_ptr<MessagePath> TorchBackend::Messages(const char* what) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!stopping_, "hvdlite backend: ", what, " after the process group was shut down");
  TORCH_CHECK(p2p_ != nullptr, "hvdlite backend: ", what, ": this group has no point-to-point link");
  return p2p_;
}

c10::intrusive_ptr<c10d::Backend> TorchBackend::CudaMessages(const char* what) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!stopping_, "hvdlite backend: ", what, " after the process group was shut down");
  TORCH_CHECK(cuda_link_, "hvdlite backend: ", what, " of a CUDA tensor: this group has no NCCL group (CUDA or NCCL "
              "was not available when it was made)");
  return cuda_link_;
}

c10::intrusive_ptr<c10d::Work> TorchBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  TORCH_CHECK(tensors.size() == 1, "hvdlite backend: send takes one tensor");
  sequence_.fetch_add(1);
  // Note [CUDA point-to-point]
  if (tensors[0].is_cuda()) return CudaMessages("send")->send(tensors, dst, tag);
  return Messages("send")->Send(tensors[0], dst, tag);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  TORCH_CHECK(tensors.size() == 1, "hvdlite backend: recv takes one tensor");
  sequence_.fetch_add(1);
  if (tensors[0].is_cuda()) return CudaMessages("recv")->recv(tensors, src, tag);
  return Messages("recv")->Recv(tensors[0], src, tag);
}

c10::intrusive_ptr<c10d::Work> TorchBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  TORCH_CHECK(tensors.size() == 1, "hvdlite backend: recv takes one tensor");
  sequence_.fetch_add(1);
  TORCH_CHECK(!tensors[0].is_cuda(), "hvdlite backend: recv from any source into a CUDA tensor: NCCL, which "
              "carries them, has no receive from any source; name the source");
  return Messages("recv")->Recv(tensors[0], MessagePath::kAnySource, tag);
}

std::string TorchBackend::pointToPointPath() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!p2p_) return "";
  return dynamic_cast<ShmPointToPoint*>(p2p_.get()) != nullptr ? "shared_memory" : "gloo";
}

std::vector<std::string> TorchBackend::pendingPointToPoint() const {
  std::lock_guard<std::mutex> lock(mu_);
  return p2p_ ? p2p_->Pending() : std::vector<std::string>{};
}

}  // namespace hvdlite
