// Status: a code, the subject of the failure as fields, and the message built from them.
// Errors cross threads (background thread -> waiting Python thread) as values, never as C++
// exceptions. The Python layer maps each code to one exception class of the HvdliteError
// family (hvdlite/exceptions.py) and copies the fields onto the exception, so no caller ever
// parses a message back.
//
// Note [Status subjects]
// A failure of one operation reads "<op> of '<tensor>': <reason>", with the ranks it concerns
// as a separate field. Status::Of builds every such status, so the wording has one home;
// Status::Prefixed adds an outer subject (a grouped call) without losing the fields.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace hvdlite {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument = 1,  // a local mistake caught in C++ (Python validates most of them first)
  kMismatch = 2,         // ranks disagree about a tensor, a group, or the job's settings
  kRankFailure = 3,      // a peer died or the transport failed
  kStall = 4,            // some ranks never submitted a tensor the others wait on
  kShutdown = 5,         // the engine was shut down with the operation pending
  kInternal = 6,         // this rank could not go on (out of memory) or a broken invariant
  kReset = 7,            // a shutdown that is a reset: the job's members change (elastic), every
                         // rank starts again (Note [Hosts updated] in hvdlite/_runtime/elastic_worker.py)
};

class Status {
 public:
  Status() = default;
  // A failure with no operation as its subject: the message is the reason.
  Status(StatusCode code, std::string reason) : code_(code), reason_(std::move(reason)) {}
  static Status Ok() { return Status(); }
  // Note [Status subjects]: "<op> of '<tensor>': <reason>".
  static Status Of(StatusCode code, std::string op, std::string tensor, std::string reason,
                   std::vector<int> ranks = {}) {
    Status s(code, std::move(reason));
    s.op_ = std::move(op);
    s.tensor_ = std::move(tensor);
    s.ranks_ = std::move(ranks);
    return s;
  }
  // The same failure, now concerning operation `op` of `tensor` (the reason and ranks stay).
  Status For(const std::string& op, const std::string& tensor) const {
    Status s = Of(code_, op, tensor, reason_, ranks_);
    s.context_ = context_;
    return s;
  }
  // The same failure inside an outer subject, e.g. "grouped allreduce 'G'".
  Status Prefixed(const std::string& context) const {
    Status s = *this;
    s.context_ = context;
    return s;
  }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& op() const { return op_; }
  const std::string& tensor() const { return tensor_; }
  const std::string& reason() const { return reason_; }
  const std::vector<int>& ranks() const { return ranks_; }
  std::string message() const {
    std::string out = context_.empty() ? "" : context_ + ": ";
    if (!op_.empty()) out += op_ + " of '" + tensor_ + "': ";
    return out + reason_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string op_;
  std::string tensor_;
  std::string reason_;
  std::string context_;
  std::vector<int> ranks_;
};

}  // namespace hvdlite
