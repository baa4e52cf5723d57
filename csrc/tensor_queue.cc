#include "tensor_queue.h"

#include <unordered_set>

namespace hvdlite {

Status TensorQueue::Push(std::vector<Entry> entries, bool wake) {
  std::unordered_set<std::string> names;  // only a group can repeat a name within one call
  std::lock_guard<std::mutex> lock(mu_);
  if (!closed_.ok() && !entries.empty()) {
    // Note [Status subjects]: why the engine stopped, now about this call.
    return closed_.For(KindName(entries.front().request.kind), entries.front().request.name);
  }
  for (const Entry& entry : entries) {
    const Request& r = entry.request;
    if (entries.size() > 1 && !names.insert(r.name).second) {
      return Status::Of(StatusCode::kInvalidArgument, KindName(r.kind), r.name,
                        "the name appears twice in one grouped call; names must be unique");
    }
    if (in_flight_.count(r.name)) {
      return Status::Of(StatusCode::kInvalidArgument, KindName(r.kind), r.name,
                        "a collective with this name is already in flight on this rank; "
                        "synchronize it first or use another name");
    }
  }
  const auto now = std::chrono::steady_clock::now();
  if (new_requests_.empty()) oldest_new_ = now;
  newest_new_ = now;
  for (Entry& entry : entries) {
    new_bytes_ += entry.bytes;
    in_flight_bytes_ += entry.bytes;
    new_requests_.push_back(entry.request);
    std::string name = entry.request.name;
    in_flight_.emplace(std::move(name), std::move(entry));
  }
  if (wake) cv_.notify_one();
  if (hold_bytes_ > 0 && new_bytes_ >= hold_bytes_) pause_cv_.notify_one();
  return Status::Ok();
}

std::vector<Request> TensorQueue::TakeNewRequests() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Request> taken;
  taken.swap(new_requests_);
  new_bytes_ = 0;
  return taken;
}

bool TensorQueue::TakeEntry(const std::string& name, Entry* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = in_flight_.find(name);
  if (it == in_flight_.end()) return false;
  *out = std::move(it->second);
  in_flight_bytes_ -= out->bytes;
  in_flight_.erase(it);
  return true;
}

std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point>
TensorQueue::NewSpan() {
  std::lock_guard<std::mutex> lock(mu_);
  return {oldest_new_, newest_new_};
}

bool TensorQueue::HasNew() {
  std::lock_guard<std::mutex> lock(mu_);
  return !new_requests_.empty();
}

int64_t TensorQueue::InFlightBytes() {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_bytes_;
}

bool TensorQueue::AllInFlight(const std::function<bool(const Entry&)>& test) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, entry] : in_flight_) {
    if (!test(entry)) return false;
  }
  return true;
}

bool TensorQueue::HasInFlight() {
  std::lock_guard<std::mutex> lock(mu_);
  return !in_flight_.empty();
}

void TensorQueue::WaitForWork(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, deadline, [&] { return woken_ || !new_requests_.empty(); });
  woken_ = false;
}

void TensorQueue::Wake() {
  std::lock_guard<std::mutex> lock(mu_);
  woken_ = true;
  cv_.notify_one();
  pause_cv_.notify_one();
}

void TensorQueue::AddWaiter() {
  std::lock_guard<std::mutex> lock(mu_);
  ++waiters_;
  pause_cv_.notify_one();
}

void TensorQueue::RemoveWaiter() {
  std::lock_guard<std::mutex> lock(mu_);
  --waiters_;
}

TensorQueue::PauseEnd TensorQueue::Pause(std::chrono::steady_clock::time_point deadline,
                                         int64_t bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool by_size = bytes > 0;
  if (waiters_ > 0) return PauseEnd::kWaiter;
  if (by_size && new_bytes_ >= bytes) return PauseEnd::kBytesReady;
  hold_bytes_ = by_size ? bytes : 0;
  pause_cv_.wait_until(lock, deadline,
                       [&] { return woken_ || waiters_ > 0 || (by_size && new_bytes_ >= bytes); });
  hold_bytes_ = 0;
  if (waiters_ > 0) return PauseEnd::kWaiter;
  return by_size && new_bytes_ >= bytes ? PauseEnd::kBytesArrived : PauseEnd::kTime;
}

std::vector<Entry> TensorQueue::Close(const Status& status) {
  std::vector<Entry> remaining;
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_.ok()) closed_ = status;
  for (auto& [name, entry] : in_flight_) remaining.push_back(std::move(entry));
  in_flight_.clear();
  new_requests_.clear();
  new_bytes_ = 0;
  in_flight_bytes_ = 0;
  return remaining;
}

namespace {

Status UnknownHandle(int64_t handle) {
  return Status(StatusCode::kInvalidArgument,
                "unknown handle " + std::to_string(handle) + " (already synchronized?)");
}

}  // namespace

int64_t HandleTable::Create() {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t handle = next_++;
  slots_.emplace(handle, Slot());
  return handle;
}

void HandleTable::Complete(int64_t handle, Completion completion) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(handle);
  if (it == slots_.end()) return;
  it->second.done = true;
  // Swap rather than assign, so the slot's previous (empty) tensors die here, not the output.
  std::swap(it->second.completion, completion);
  cv_.notify_all();
}

// Note [Completing in one step]
// A fused batch completes all its handles at once. Completing them one by one, each with its
// own notify, wakes a caller that waits for the whole group once per handle: on a machine
// where the caller and the engine thread share cores, each of those wake-ups is a context
// switch and a fight for this mutex, and a large group's completion could take several times
// as long (measured: docs/performance.md, Design measurements). So a batch completes under one
// lock with one wake-up, and a group's caller waits once for all of its handles.
void HandleTable::CompleteAll(std::vector<std::pair<int64_t, Completion>>* done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [handle, completion] : *done) {
      auto it = slots_.find(handle);
      if (it == slots_.end()) continue;
      it->second.done = true;
      std::swap(it->second.completion, completion);
    }
  }
  cv_.notify_all();
  // `done` now holds the slots' empty completions; the caller drops them outside the lock.
}

bool HandleTable::AllDone(const std::vector<int64_t>& handles) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t handle : handles) {
    auto it = slots_.find(handle);
    if (it != slots_.end() && !it->second.done) return false;
  }
  return true;
}

void HandleTable::WaitAll(const std::vector<int64_t>& handles, std::vector<Completion>* out,
                          std::vector<Status>* statuses) {
  out->assign(handles.size(), Completion());
  statuses->assign(handles.size(), Status::Ok());
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    for (int64_t handle : handles) {
      auto it = slots_.find(handle);
      if (it != slots_.end() && !it->second.done) return false;
    }
    return true;
  });
  for (size_t i = 0; i < handles.size(); ++i) {
    auto it = slots_.find(handles[i]);
    if (it == slots_.end()) {
      (*statuses)[i] = UnknownHandle(handles[i]);
      continue;
    }
    (*out)[i] = std::move(it->second.completion);
    slots_.erase(it);
  }
}

Status HandleTable::Poll(int64_t handle, bool* done) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(handle);
  if (it == slots_.end()) return UnknownHandle(handle);
  *done = it->second.done;
  return Status::Ok();
}

void HandleTable::Discard(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  slots_.erase(handle);
}

bool HandleTable::TryTake(int64_t handle, Completion* out, Status* status) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(handle);
  if (it == slots_.end()) {
    *status = UnknownHandle(handle);
    return true;
  }
  if (!it->second.done) return false;
  *out = std::move(it->second.completion);
  slots_.erase(it);
  *status = Status::Ok();
  return true;
}

Status HandleTable::Wait(int64_t handle, Completion* out) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = slots_.find(handle);
  if (it == slots_.end()) return UnknownHandle(handle);
  cv_.wait(lock, [&] { return slots_.at(handle).done; });
  it = slots_.find(handle);
  *out = std::move(it->second.completion);
  slots_.erase(it);
  return Status::Ok();
}

}  // namespace hvdlite
