#include "pipeline.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace hvdlite {

bool PendingWork::Done() const {
  if (!wait_ || !done_) return false;
  try {
    return done_();
  } catch (...) {  // the probe failed: Wait will say why
    return false;
  }
}

void PendingWork::Wait() {
  if (!wait_) return;
  std::function<void()> wait = std::move(wait_);
  wait_ = nullptr;
  done_ = nullptr;
  wait();
}

std::vector<Chunk> CutChunks(int64_t total, int64_t per, int64_t first) {
  if (per <= 0) throw std::invalid_argument("CutChunks: chunks of " + std::to_string(per) + " units");
  std::vector<Chunk> chunks;
  if (total > 0) chunks.reserve(static_cast<size_t>(total / per + 2));
  for (int64_t begin = 0; begin < total;) {
    const int64_t want = chunks.empty() && first > 0 ? first : per;
    const int64_t n = std::min(want, total - begin);
    chunks.push_back({begin, n});
    begin += n;
  }
  return chunks;
}

WorkWindow::WorkWindow(int64_t count, int64_t lanes, Start start)
    : count_(count), lanes_(std::max<int64_t>(1, lanes)), start_(std::move(start)),
      works_(static_cast<size_t>(count)), started_(static_cast<size_t>(count), 0),
      ended_(static_cast<size_t>(count), 0) {}

WorkWindow::~WorkWindow() { Drain(); }

void WorkWindow::TryStart(int64_t k) {
  if (failure_ || draining_ || k < 0 || k >= count_ || k >= ready_ || started_[k]) return;
  if (k >= lanes_ && !ended_[k - lanes_]) return;  // its lane is busy
  started_[k] = 1;
  try {
    works_[k] = start_(k);
  } catch (...) {
    Fail(std::current_exception());
  }
}

void WorkWindow::Ready(int64_t through) {
  const int64_t from = ready_;
  ready_ = std::min(count_, std::max(ready_, through));
  // A work below `from` that has not started waits for its lane, which starts it when it ends.
  for (int64_t k = from; k < ready_; ++k) TryStart(k);
}

void WorkWindow::Reap(int64_t k) {
  if (k < 0 || k >= count_ || !started_[k] || ended_[k]) return;
  try {
    works_[k].Wait();
  } catch (...) {
    Fail(std::current_exception());
  }
  ended_[k] = 1;
  TryStart(k + lanes_);
}

bool WorkWindow::Travelling(int64_t k) const {
  return k >= 0 && k < count_ && started_[k] && !ended_[k] && works_[k] && !works_[k].Done();
}

void WorkWindow::Poll() {
  for (int64_t k = 0; k < count_; ++k) {
    if (started_[k] && !ended_[k] && works_[k].Done()) Reap(k);
  }
}

void WorkWindow::Drain() {
  draining_ = true;  // what has not started stays unstarted
  for (int64_t k = 0; k < count_; ++k) Reap(k);
}

void WorkWindow::Fail(std::exception_ptr failure) {
  if (!failure_) failure_ = std::move(failure);
}

void WorkWindow::ThrowIfFailed() const {
  if (failure_) std::rethrow_exception(failure_);
}

void WorkWindow::Finish() {
  for (int64_t k = 0; k < count_; ++k) Reap(k);  // a lane whose work ends starts its next one
  Drain();
  ThrowIfFailed();
  for (int64_t k = 0; k < count_; ++k) {
    if (!started_[k]) throw std::logic_error("WorkWindow: work " + std::to_string(k) + " of " + std::to_string(count_) +
                                             " never started (the caller did not make it ready)");
  }
}

}  // namespace hvdlite
