// Autotuner: the search behind HVDLITE_AUTOTUNE=1 for the fusion threshold and cycle time that
// move the most bytes per second in this job. Pure logic over the numbers it is fed, so it is
// testable in one process. Rank 0's engine owns one and feeds it after every round that did
// something, under the engine's round lock (callers run no rounds while the search runs: Note
// [A waiting caller runs the round] in round_driver.h). No locking.
//
// Note [Autotune]
// Every rank must plan the same batches in a round (Note [Replicated negotiation]), so the
// parameters cannot be tuned per rank. Rank 0 runs the search and sends the parameters in
// effect in its RankMessage every round; every rank, rank 0 included, plans that round with
// them and paces its next round by that cycle time. Tuning therefore never makes ranks
// disagree, and the result of every collective is the same under any parameters: only speed
// changes.
//
// The score of a sample is the bytes the data collectives moved per second of wall time over
// at least HVDLITE_AUTOTUNE_SAMPLE_SECONDS. In a training loop compute time is the same
// under every setting, so more bytes per second means shorter steps. The search:
//   1. one warm-up sample with the starting parameters (buffers grow, caches fill), discarded;
//   2. every fusion threshold candidate (1 MiB .. 128 MiB and the starting one) at the
//      starting cycle time; the best threshold is kept;
//   3. every cycle time candidate (0.1 .. 4 ms and the starting one) at that threshold;
//   4. confirmation: the best pair and the starting pair are sampled twice more, alternately,
//      and the best pair is kept only if its mean score over all its samples beats the
//      starting pair's; a noisy single sample cannot make things worse than the defaults.
// Then the choice stays in effect for the rest of the job.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "types.h"

namespace hvdlite {

enum class AutotunePhase { kWarmup, kThreshold, kCycle, kConfirm, kDone };
const char* AutotunePhaseName(AutotunePhase phase);  // "warmup", "threshold", ...

struct AutotuneSample {
  TunedParams params;
  int64_t bytes = 0;
  double seconds = 0.0;
  AutotunePhase phase = AutotunePhase::kWarmup;  // the phase it was measured in
  double BytesPerSecond() const { return seconds > 0 ? bytes / seconds : 0.0; }
};

class Autotuner {
 public:
  Autotuner(TunedParams start, double sample_seconds);

  // After every round: the bytes its data collectives moved and the time (monotonic seconds).
  // Returns true when this closed a sample (samples().back()); current() may then change.
  bool Record(int64_t bytes, double now_seconds);

  const TunedParams& current() const { return current_; }
  bool done() const { return phase_ == AutotunePhase::kDone; }
  const std::vector<AutotuneSample>& samples() const { return samples_; }
  // One line: the choice and its score next to the starting parameters'.
  std::string Summary() const;

 private:
  void Advance();
  double MeanScore(const TunedParams& params) const;

  const TunedParams start_;
  const double sample_seconds_;
  AutotunePhase phase_ = AutotunePhase::kWarmup;
  TunedParams current_;
  std::vector<TunedParams> queue_;  // candidates still to sample in this phase
  TunedParams best_;
  std::vector<AutotuneSample> samples_;
  double sample_start_ = -1.0;
  int64_t sample_bytes_ = 0;
};

}  // namespace hvdlite
