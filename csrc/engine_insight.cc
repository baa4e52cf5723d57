// The engine's side of seeing inside a job: labels and dump requests (Note [Dump requests]),
// the pending table on request (Note [Flight record]), transports for the metrics (Note
// [Metrics]) and the straggler line (Note [Straggler attribution]); see recorder.h.
#include <chrono>

#include "engine.h"

namespace hvdlite {

void Engine::SetLabel(const std::string& label, bool propagates_signals) {
  std::lock_guard<std::mutex> lock(label_mu_);
  label_ = label;
  propagates_signals_ = propagates_signals;
}

bool Engine::PendingNow(double timeout_s, std::vector<PendingCollective>* pending) {
  std::unique_lock<std::mutex> lock(pending_mu_);
  const uint64_t mine = ++pending_requested_;
  lock.unlock();
  queue_.Wake();
  lock.lock();
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  while (pending_served_ < mine) {
    if (stopped_ || Clock::now() >= deadline) return false;
    pending_cv_.wait_for(lock, std::chrono::milliseconds(20));
  }
  *pending = pending_view_;
  return true;
}

void Engine::ServePendingRequest() {
  std::lock_guard<std::mutex> lock(pending_mu_);
  if (pending_served_ == pending_requested_) return;
  pending_view_ = controller_.PendingView(job_clock_ms_ + (MonotonicMicros() / 1000 - job_clock_local_ms_));
  pending_served_ = pending_requested_;
  pending_cv_.notify_all();
}

void Engine::AfterDecisions(const RoundResult& round, int64_t at_us) {
  std::string label;
  {
    std::lock_guard<std::mutex> lock(label_mu_);
    label = label_;
  }
  // Note [Dump requests]: every rank decides the same stalls in the same round, so every rank
  // rings with the same id.
  if (!round.stall_warning.empty()) RingDump(label + "-r" + std::to_string(rounds_), round.stall_warning);
  for (const ReadyItem& item : round.ready) {
    if (item.status.code() == StatusCode::kStall) {
      RingDump(label + "-r" + std::to_string(rounds_), item.status.message());
      break;
    }
  }
  if (rank_ != 0 || config_.straggler_report_seconds <= 0) return;
  const int64_t now_ms = at_us / 1000;
  if (now_ms - last_straggler_line_ms_ < static_cast<int64_t>(config_.straggler_report_seconds * 1000)) return;
  if (last_straggler_line_ms_ == 0) {  // the first period starts with the first decision
    last_straggler_line_ms_ = now_ms;
    return;
  }
  last_straggler_line_ms_ = now_ms;
  const std::string line = recorder_.StragglerLine();
  if (!line.empty()) logger_.Announce(line);
}

std::string Engine::TransportOf(const Batch& batch) const {
  const ReadyItem& item = batch.items.front();
  const CollectiveKind kind = item.request.kind;
  if (kind == CollectiveKind::kBarrier || kind == CollectiveKind::kJoin) return "negotiation";
  if (item.inlined) return "inline";
  if (item.request.device_type != static_cast<int8_t>(c10::DeviceType::CPU)) return "nccl";
  if (kind == CollectiveKind::kAllreduce || kind == CollectiveKind::kReducescatter) {
    if (hierarchical_) return "hierarchical";
    if (!shm_) return "gloo";
    return shm_->SingleCopy(batch.bytes) ? "single_copy" : "shared_memory";  // Note [Single-copy allreduce]
  }
  if ((kind == CollectiveKind::kAllgather || kind == CollectiveKind::kBroadcast) && shm_ && !hierarchical_) {
    return "shared_memory";
  }
  return "gloo";
}

}  // namespace hvdlite
