#include "autotune.h"

#include <algorithm>
#include <cstdio>

namespace hvdlite {
namespace {

constexpr int64_t kMiB = 1 << 20;

std::vector<TunedParams> ThresholdCandidates(const TunedParams& start) {
  std::vector<int64_t> values = {1 * kMiB, 2 * kMiB, 4 * kMiB, 8 * kMiB,
                                 16 * kMiB, 32 * kMiB, 64 * kMiB, 128 * kMiB};
  // A threshold of 0 (fusion disabled) is the user's explicit choice, not a starting point.
  if (start.fusion_threshold_bytes > 0) values.push_back(start.fusion_threshold_bytes);
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  std::vector<TunedParams> out;
  for (int64_t v : values) out.push_back({v, start.cycle_time_ms});
  return out;
}

std::vector<TunedParams> CycleCandidates(const TunedParams& best, double start_cycle_ms) {
  std::vector<double> values = {0.1, 0.25, 0.5, 1.0, 2.0, 4.0, start_cycle_ms};
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  std::vector<TunedParams> out;
  for (double v : values) {
    TunedParams p{best.fusion_threshold_bytes, v};
    if (!(p == best)) out.push_back(p);  // measured already in the threshold phase
  }
  return out;
}

TunedParams PopFront(std::vector<TunedParams>* queue) {
  TunedParams p = queue->front();
  queue->erase(queue->begin());
  return p;
}

}  // namespace

Autotuner::Autotuner(TunedParams start, double sample_seconds)
    : start_(start), sample_seconds_(sample_seconds), current_(start), best_(start) {}

bool Autotuner::Record(int64_t bytes, double now_seconds) {
  if (done()) return false;
  if (sample_start_ < 0) {  // the first round starts the clock; what it moved came before
    sample_start_ = now_seconds;
    return false;
  }
  sample_bytes_ += bytes;
  const double elapsed = now_seconds - sample_start_;
  if (elapsed < sample_seconds_ || sample_bytes_ == 0) return false;
  samples_.push_back({current_, sample_bytes_, elapsed, phase_});
  sample_start_ = now_seconds;
  sample_bytes_ = 0;
  Advance();
  return true;
}

const char* AutotunePhaseName(AutotunePhase phase) {
  switch (phase) {
    case AutotunePhase::kWarmup: return "warmup";
    case AutotunePhase::kThreshold: return "threshold";
    case AutotunePhase::kCycle: return "cycle";
    case AutotunePhase::kConfirm: return "confirm";
    default: return "done";
  }
}

double Autotuner::MeanScore(const TunedParams& params) const {
  double sum = 0.0;
  int n = 0;
  for (const AutotuneSample& s : samples_) {
    if (s.params == params && s.phase != AutotunePhase::kWarmup) {
      sum += s.BytesPerSecond();
      ++n;
    }
  }
  return n ? sum / n : 0.0;
}

void Autotuner::Advance() {
  // Note [Autotune]: the phases, in order.
  if (!queue_.empty()) {
    current_ = PopFront(&queue_);
    return;
  }
  // The best sample of the threshold phase (and, with `with_cycles`, of the cycle phase at
  // the kept threshold).
  auto best_of = [&](bool with_cycles) {
    const AutotuneSample* best = nullptr;
    for (const AutotuneSample& s : samples_) {
      const bool candidate = s.phase == AutotunePhase::kThreshold ||
                             (with_cycles && s.phase == AutotunePhase::kCycle);
      if (!candidate) continue;
      if (with_cycles && s.params.fusion_threshold_bytes != best_.fusion_threshold_bytes) continue;
      if (!best || s.BytesPerSecond() > best->BytesPerSecond()) best = &s;
    }
    return best ? best->params : start_;
  };
  switch (phase_) {
    case AutotunePhase::kWarmup:
      phase_ = AutotunePhase::kThreshold;
      queue_ = ThresholdCandidates(start_);
      break;
    case AutotunePhase::kThreshold:
      best_ = best_of(false);
      phase_ = AutotunePhase::kCycle;
      queue_ = CycleCandidates(best_, start_.cycle_time_ms);
      break;
    case AutotunePhase::kCycle:
      best_ = best_of(true);
      phase_ = AutotunePhase::kConfirm;
      if (!(best_ == start_)) queue_ = {start_, best_, start_, best_};
      break;
    case AutotunePhase::kConfirm:
    case AutotunePhase::kDone:
      break;
  }
  if (!queue_.empty()) {
    current_ = PopFront(&queue_);
    return;
  }
  if (phase_ == AutotunePhase::kCycle) {  // no cycle candidates: straight to confirmation
    Advance();
    return;
  }
  phase_ = AutotunePhase::kDone;
  current_ = MeanScore(best_) > MeanScore(start_) ? best_ : start_;
}

std::string Autotuner::Summary() const {
  char line[320];
  std::snprintf(line, sizeof(line),
                "autotune chose fusion threshold %.3g MiB and cycle time %.3g ms: %.1f MB/s, "
                "against %.1f MB/s with the starting %.3g MiB and %.3g ms (%zu samples)",
                current_.fusion_threshold_bytes / static_cast<double>(kMiB), current_.cycle_time_ms,
                MeanScore(current_) / 1e6, MeanScore(start_) / 1e6,
                start_.fusion_threshold_bytes / static_cast<double>(kMiB), start_.cycle_time_ms,
                samples_.size());
  return line;
}

}  // namespace hvdlite
