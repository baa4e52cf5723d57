// The CollectiveBackend over a c10d::Backend (ProcessGroupGloo, ProcessGroupNCCL, ...).
// Included only by backend_c10d.cc and bindings.cc: the c10d headers are heavy.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <memory>

#include "backend.h"

namespace hvdlite {

std::unique_ptr<CollectiveBackend> MakeC10dBackend(c10::intrusive_ptr<c10d::Backend> backend);

}  // namespace hvdlite
