// ShmPointToPoint's failures (shm_point_to_point.h): an operation failed, a peer lost or
// closed, the group's timeout, Abort(), and what outlives an operation's outcome (Note
// [Operations that outlive their outcome]): sends a receiver still reads, receives a stopped
// sender may still write into.
#include "shm_point_to_point.h"

#include "shm_segment.h"

#include <algorithm>
#include <sstream>
#include <thread>

namespace hvdlite {
namespace {

using Clock = std::chrono::steady_clock;

std::string Seconds(double s) {
  std::ostringstream out;
  out << s << " s";
  return out.str();
}

}  // namespace

void ShmPointToPoint::Fail(Op& op, const std::string& why, c10d::ErrorType kind) {
  if (op.ended) return;
  if (op.send && op.slot >= 0) {  // withdraw it, unless the receiver is reading it
    uint32_t full = Mail::kFull;
    if (boxes_.Slot(rank_, op.peer, op.slot).state.compare_exchange_strong(full, Mail::kEmpty)) op.slot = -1;
  }
  op.error = message_words::DistError("hvdlite backend: " + op.what + ": " + why);
  op.ended = true;
  if (kind != c10d::ErrorType::SUCCESS) {
    int none = 0;
    error_.compare_exchange_strong(none, static_cast<int>(kind));
  }
}

void ShmPointToPoint::CheckPeers(std::vector<std::shared_ptr<Op>>* ended) {
  const Clock::time_point now = Clock::now();
  orphans_.erase(std::remove_if(orphans_.begin(), orphans_.end(),
                                [](const Orphan& o) {
                                  return static_cast<int64_t>(o.mail->copied.load()) >= o.bytes ||
                                         o.mail->seq != o.seq || !ShmSegment::Running(o.pid);
                                }),
                 orphans_.end());
  for (const std::shared_ptr<Op>& op : live_) {
    if (op->ended) {  // a failed send whose slot a receiver held
      if (op->send && op->slot >= 0) {
        uint32_t full = Mail::kFull;  // a receiver that claimed it by mistake gave it back
        if (!ShmSegment::Running(segment_.pid(op->peer)) ||
            boxes_.Slot(rank_, op->peer, op->slot).state.compare_exchange_strong(full, Mail::kEmpty)) {
          op->slot = -1;
        }
      }
      continue;
    }
    if (op->peer == kAnySource) {
      // a receive from any rank fails when a rank crashed (exited without closing), or when
      // every other rank has closed; one rank that finished and shut down is not its failure
      std::string crashed;
      int open = 0;
      for (int peer = 0; peer < size_; ++peer) {
        if (peer == rank_) continue;
        const int64_t pid = segment_.pid(peer);
        const bool closed = boxes_.Bell(peer).closed.load() != 0;
        const bool running = ShmSegment::Running(pid);
        if (!running && !closed && crashed.empty()) {
          crashed = "rank " + std::to_string(peer) + " (pid " + std::to_string(pid) + ") exited";
        }
        open += running && !closed;
      }
      if (!crashed.empty()) {
        Fail(*op, crashed, c10d::ErrorType::COMM_ERROR);
      } else if (open == 0) {
        Fail(*op, "every other rank shut down or aborted its process group", c10d::ErrorType::COMM_ERROR);
      }
    }
    for (int peer = 0; peer < size_ && !op->ended && op->peer != kAnySource; ++peer) {
      if (peer == rank_ || op->peer != peer) continue;
      const std::string name = "rank " + std::to_string(peer);
      const int64_t pid = segment_.pid(peer);
      if (op->send && op->slot >= 0 &&
          boxes_.Slot(rank_, op->peer, op->slot).state.load() >= Mail::kClaimed && ShmSegment::Running(pid)) {
        continue;  // being read now
      }
      if (!ShmSegment::Running(pid)) {
        op->slot = -1;  // nobody will read it
        Fail(*op, name + " (pid " + std::to_string(pid) + ") exited", c10d::ErrorType::COMM_ERROR);
      } else if (boxes_.Bell(peer).closed.load() != 0) {
        Fail(*op, name + " shut down or aborted its process group", c10d::ErrorType::COMM_ERROR);
      }
    }
    const bool being_read = op->send && op->slot >= 0 &&
                            boxes_.Slot(rank_, op->peer, op->slot).state.load() >= Mail::kClaimed;
    // a send being read waits for its receiver, whose own timeout bounds the copy
    if (!op->ended && !being_read && timeout_.count() > 0 && now - op->started > timeout_) {
      const std::string waited = Seconds(std::chrono::duration<double>(timeout_).count());
      const std::string why =
          op->peer == kAnySource ? "" : " " + ShmSegment::Why(segment_.pid(op->peer));
      Fail(*op, op->step + ": still waiting after " + waited + " (the process group's timeout)" + why,
           c10d::ErrorType::TIMEOUT);
    }
  }
  Progress(ended);  // gathers the ones failed here
}

void ShmPointToPoint::Abort(const std::string& why) {
  std::vector<std::shared_ptr<Op>> ended;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.empty()) aborted_ = why.empty() ? "aborted" : why;
    for (const std::shared_ptr<Op>& op : live_) {
      if (!op->ended) Fail(*op, aborted_, c10d::ErrorType::COMM_ERROR);
    }
    Progress(&ended);
  }
  Complete(ended);
  boxes_.Bell(rank_).closed.store(1);
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_) boxes_.Ring(peer);
  }
  cv_.notify_all();
}

void ShmPointToPoint::AwaitHeldSlots() {
  // Note [Operations that outlive their outcome]: a receiver may still be reading a send's
  // bytes; wait (at most 10 s) until it is done or gone before the tensors may go.
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(10);
  for (;;) {
    std::vector<std::shared_ptr<Op>> ended;
    bool held = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Progress(&ended);
      for (const std::shared_ptr<Op>& op : live_) {
        if (op->send && op->slot >= 0) {
          if (!ShmSegment::Running(segment_.pid(op->peer))) op->slot = -1;  // nobody reads it now
          held |= op->slot >= 0;
        }
      }
      Progress(&ended);
    }
    Complete(ended);
    if (!held || Clock::now() > deadline) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace hvdlite
