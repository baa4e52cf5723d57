// StatusError: a Status thrown as an exception. Thrown through a binding, the module's
// exception translator turns it into the matching HvdliteError with the status's fields
// (bindings.cc); thrown by the executor, it tells the engine that this rank could not take
// part in a collective (Note [Fatal errors] in engine.h).
#pragma once

#include <exception>
#include <string>
#include <utility>

#include "status.h"

namespace hvdlite {

struct StatusError : std::exception {
  explicit StatusError(Status s) : status(std::move(s)), text(status.message()) {}
  const char* what() const noexcept override { return text.c_str(); }
  Status status;
  std::string text;
};

inline void Check(const Status& status) {
  if (!status.ok()) throw StatusError(status);
}

}  // namespace hvdlite
