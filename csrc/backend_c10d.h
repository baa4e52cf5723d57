// The CollectiveBackend over a c10d::Backend (ProcessGroupGloo, ProcessGroupNCCL, ...).
// Included only by backend_c10d.cc and bindings.cc: the c10d headers are heavy.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <memory>

#include "backend.h"

namespace hvdlite {

// Note [Tensors handed to c10d] (backend_c10d.cc): `t` as a new tensor on the same storage,
// without a Python object, so that no thread but Python's drops a Python tensor's last reference.
at::Tensor Unowned(const at::Tensor& t);

// `timeout`: every collective's own timeout, instead of the one the process group was made
// with (kUnsetTimeout: that one). Note [Frozen peers] in hvdlite/_runtime/groups.py.
std::unique_ptr<CollectiveBackend> MakeC10dBackend(c10::intrusive_ptr<c10d::Backend> backend,
                                                   std::chrono::milliseconds timeout = c10d::kUnsetTimeout);

}  // namespace hvdlite
