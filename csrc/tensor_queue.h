// TensorQueue and HandleTable: the state that Python threads (enqueuing, polling, waiting)
// share with the thread that runs the rounds, the background thread or a waiting caller that
// holds the engine's round lock (Note [A waiting caller runs the round] in round_driver.h). Any thread
// may call them. Each has one mutex, held only for short map operations; neither ever calls
// into torch or Python while holding it (Note [GIL and tensor references]).
//
// Note [GIL and tensor references]
// Dropping the last reference to a tensor that Python created makes torch take the GIL. So a
// Python-facing call must never wait on these locks while holding the GIL (every binding
// releases it), and the background thread never destroys an Entry while holding a lock: it
// moves entries out first and lets them die outside.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "message.h"
#include "status.h"

namespace hvdlite {

struct Entry {
  int64_t handle = 0;
  Request request;
  at::Tensor input;
  at::Tensor output;  // allreduce/broadcast: allocated by Python (the input itself if in place)
  at::Tensor write_back;  // Note [Inference tensors] (engine.h): the caller's output, if an inference tensor
  std::shared_ptr<c10::Event> ready_event;  // non-CPU tensors: recorded on the caller's stream
  int64_t enqueued_us = 0;                  // for the timeline
  int64_t bytes = 0;                        // the input's size (Note [Gathering by size])
};

class TensorQueue {
 public:
  // All or nothing: refuses the whole list if a name repeats within it or is already in
  // flight on this rank, or if the queue was closed (then with the closing status). `wake`
  // false leaves WaitForWork asleep (its caller runs the round: Note [A waiting caller runs the
  // round] in engine.h).
  Status Push(std::vector<Entry> entries, bool wake = true);

  // Requests pushed since the last call, in push order (the thread that runs the round).
  std::vector<Request> TakeNewRequests();
  // Removes the entry for a name this rank submitted; false if there is none.
  bool TakeEntry(const std::string& name, Entry* out);

  bool HasNew();
  // When the newest and the oldest of the requests not yet taken were pushed.
  std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point> NewSpan();
  bool HasInFlight();
  // The bytes of the entries pushed and not yet taken (Note [A waiting caller runs the round]).
  int64_t InFlightBytes();
  // Whether `test` holds for every entry pushed and not yet taken.
  bool AllInFlight(const std::function<bool(const Entry&)>& test);
  // Blocks until a push or Wake(), or until `deadline`.
  void WaitForWork(std::chrono::steady_clock::time_point deadline);
  void Wake();

  // Note [A waiting caller ends the gathering]
  // The background thread holds new requests back for a while (a burst of pushes, the cycle
  // time) so that more of them share a round and a fused buffer. Once a caller blocks on a
  // handle, waiting longer only delays it: a loop of async calls is over when its first
  // synchronize() starts, and a blocking call pushes nothing more. So callers announce that
  // they wait, and the hold-back pauses end at once while anyone does. Pushes do not wake
  // these pauses (a burst of 200 pushes would cost 200 wake-ups of the background thread).
  void AddWaiter();
  void RemoveWaiter();
  // The count of waiting callers, also read without the lock (Note [Yield only while a caller
  // waits] in shm_channel.h).
  const std::atomic<int>* waiting() const { return &waiters_; }
  // The background thread's one way to hold back: sleeps until `deadline` or Wake(), and ends
  // at once while a caller waits. With `bytes` > 0 (Note [Gathering by size]) it also ends
  // when the requests not yet taken add up to `bytes` (the push that crosses it wakes it); if
  // they already do, it returns kBytesReady without sleeping.
  enum class PauseEnd { kTime, kWaiter, kBytesArrived, kBytesReady };
  PauseEnd Pause(std::chrono::steady_clock::time_point deadline, int64_t bytes = 0);

  // Refuses every later push with `status` and returns every entry still in flight.
  std::vector<Entry> Close(const Status& status);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable pause_cv_;
  bool woken_ = false;
  std::atomic<int> waiters_{0};  // changed under mu_ (the pauses' predicate reads it)
  int64_t new_bytes_ = 0;   // of the requests not yet taken
  int64_t hold_bytes_ = 0;  // > 0 while Pause waits for that many
  int64_t in_flight_bytes_ = 0;  // of the entries in in_flight_
  Status closed_;
  std::unordered_map<std::string, Entry> in_flight_;
  std::vector<Request> new_requests_;
  std::chrono::steady_clock::time_point oldest_new_, newest_new_;
};

struct Completion {
  Status status;
  at::Tensor output;
  std::shared_ptr<c10::Event> done_event;  // non-CPU: the output is ready after this event
  std::vector<int64_t> aux;  // alltoall: rows received from each rank; join: the last rank
  at::Tensor write_back;     // Note [Inference tensors] (engine.h): copied into on the caller's thread
};

class HandleTable {
 public:
  int64_t Create();
  void Complete(int64_t handle, Completion completion);
  // Note [Completing in one step]: many handles under one lock, with one wake-up.
  void CompleteAll(std::vector<std::pair<int64_t, Completion>>* done);
  // kInvalidArgument for a handle that does not exist (never created or already waited on).
  Status Poll(int64_t handle, bool* done);
  // Forgets a handle whose operation was never queued.
  void Discard(int64_t handle);
  // Blocks until the handle completes, then consumes it.
  Status Wait(int64_t handle, Completion* out);
  // Blocks until every handle completes, then consumes them all; statuses[i] is handles[i]'s
  // own error (an unknown handle), and `out` holds the completions in the same order.
  void WaitAll(const std::vector<int64_t>& handles, std::vector<Completion>* out,
               std::vector<Status>* statuses);
  // True when every handle has completed (unknown ones count as completed).
  bool AllDone(const std::vector<int64_t>& handles);
  // Consumes the handle if it has completed (true); false if it is still running. An unknown
  // handle counts as completed, with that error in `status`.
  bool TryTake(int64_t handle, Completion* out, Status* status);

 private:
  struct Slot {
    bool done = false;
    Completion completion;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t next_ = 1;
  std::unordered_map<int64_t, Slot> slots_;
};

}  // namespace hvdlite
