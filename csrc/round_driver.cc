#include "round_driver.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>

#include "autotune.h"
#include "controller.h"
#include "shm_channel.h"
#include "timeline.h"

namespace hvdlite {
namespace {

// Set while this thread runs a round, and for good on the background thread, so that Python
// code a round sets off (a tensor's last reference dropped, its finalizers) never tries to run
// one inside it, nor to take the lock that its own thread holds.
thread_local bool t_running_round = false;

}  // namespace

RoundDriver::RoundDriver(bool enabled, int rank, TensorQueue* queue, const Controller* controller,
                         const ShmChannel* shm, const Timeline* timeline)
    : enabled_(enabled), rank_(rank), queue_(queue), controller_(controller), shm_(shm), timeline_(timeline) {}

void RoundDriver::MarkRoundThread() { t_running_round = true; }

bool RoundDriver::CallerTakes(const std::vector<Entry>& entries, int64_t bytes, bool waits_now) {
  // A caller about to wait on small work, or on allreduces it has sent before, runs the round.
  return waits_now && enabled_ && (bytes <= kMaxBytes || (bytes <= kKnownMaxBytes && AllKnown(entries)));
}

void RoundDriver::RunWhile(const std::function<bool()>& pending, const std::function<bool()>& run_round,
                           const std::atomic<bool>& stopping) {
  if (!enabled_ || t_running_round) return;
  bool ran = false, wake = false;
  while (pending()) {
    std::unique_lock<std::mutex> drive(mu_, std::try_to_lock);
    if (!drive.owns_lock() || finished_ || stopping) break;
    // The last round changed nothing and this rank has nothing new: the background thread
    // backs off instead of this caller spinning rounds. Large or new work, and rounds that
    // grow long-lived tables, are the background thread's (CallerMayRun).
    if ((stuck_ && !queue_->HasNew()) || !CallerMayRun()) {
      wake = true;
      break;
    }
    // The round runs as the background thread's do, whatever the caller's own thread state:
    // no autograd, no inference tensors (buffers outlive the call), no autocast, no Python
    // dispatch modes (a TorchDispatchMode the caller entered would see the round's kernels).
    c10::InferenceMode not_inference(false);
    at::NoGradGuard no_grad;
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    c10::impl::ExcludeDispatchKeyGuard no_python(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    t_running_round = true;
    ran = true;
    caller_rounds_.fetch_add(1, std::memory_order_relaxed);
    const bool going = run_round();
    t_running_round = false;
    if (!going) break;  // finished: the background thread must wake to exit
  }
  // The background thread sleeps through rounds run here; what they leave is its work again.
  // If it holds the lock now, it is awake and looks at the queue before it sleeps.
  if (ran && !wake) {
    std::unique_lock<std::mutex> drive(mu_, std::try_to_lock);
    wake = drive.owns_lock() && (finished_ || queue_->HasInFlight() || queue_->HasNew());
  }
  if (wake) queue_->Wake();
}

bool RoundDriver::CallerMayRun() const {
  if (timeline_->enabled() || (tuner_ && !tuner_->done())) return false;
  const int64_t bytes = queue_->InFlightBytes();
  if (bytes <= kMaxBytes) return true;
  return bytes <= kKnownMaxBytes && TakesKnownWork() &&
         queue_->AllInFlight([this](const Entry& e) { return Known(e); });
}

bool RoundDriver::TakesKnownWork() const {
  // Over shared memory, and not on the single-copy path (its block is allocated by the first
  // round that takes it), which starts above kKnownMaxBytes unless a test or a benchmark
  // lowers it.
  return shm_ != nullptr && !shm_->SingleCopy(kKnownMaxBytes);
}

bool RoundDriver::Known(const Entry& entry) const {
  // A CPU allreduce whose output Python allocated, that this rank sent before exactly so: the
  // round allocates nothing that outlives it (the response cache only moves the entry to the
  // front). Not one that would grow the fusion buffer (a cast on the wire, a non-contiguous
  // tensor).
  return entry.request.kind == CollectiveKind::kAllreduce && entry.input.device().is_cpu() &&
         entry.input.is_contiguous() && entry.output.defined() && entry.output.is_contiguous() &&
         static_cast<c10::ScalarType>(entry.request.dtype) == entry.input.scalar_type() &&
         controller_->CacheLookup(rank_, entry.request) >= 0;
}

bool RoundDriver::AllKnown(const std::vector<Entry>& entries) {
  if (t_running_round || !TakesKnownWork()) return false;
  std::unique_lock<std::mutex> drive(mu_, std::try_to_lock);
  return drive.owns_lock() && std::all_of(entries.begin(), entries.end(), [this](const Entry& e) { return Known(e); });
}

}  // namespace hvdlite
