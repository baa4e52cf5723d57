// Status: a code plus a message. Errors cross threads (background thread -> waiting Python
// thread) as values, never as C++ exceptions. The Python layer maps each code to one
// exception class of the HvdliteError family (hvdlite/exceptions.py).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace hvdlite {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument = 1,  // a local mistake caught in C++ (Python validates most of them first)
  kMismatch = 2,         // ranks disagree about a tensor
  kRankFailure = 3,      // a peer died or a collective failed
  kStall = 4,            // some ranks never submitted a tensor the others wait on
  kShutdown = 5,         // the engine was shut down with the operation pending
  kInternal = 6,         // a broken invariant: a bug in hvdlite
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace hvdlite
