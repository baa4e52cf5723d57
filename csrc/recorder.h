// Recorder: what an engine remembers about its own rounds for someone looking at the job from
// outside: the straggler figures, the flight record and the metrics counters. The thread that
// runs the round writes it (the background thread, or a waiting caller that holds the engine's
// round lock: Note [A waiting caller runs the round] in round_driver.h), a few calls per round that
// decided something; Python threads read it. One mutex, held for copies only.
//
// Note [Straggler attribution]
// Every rank's controller sees, for each tensor it decides, when every contributor submitted it
// (Note [Submission times] in message.h), so it knows which rank was last and how long after
// the first. Each round that decided something is one sample: the tensor of the round with the
// largest spread gives the round's last rank and its lag. The last kStragglerWindow samples are
// kept; for each rank the figures are the fraction of them in which it was last and the median
// and 95th percentile of its lag in those. A rank is flagged (consistently last) when it was
// last in at least max(0.6, 1.75/size) of at least kStragglerMinRounds samples with a median
// lag of at least HVDLITE_STRAGGLER_MIN_LAG_MS (default 10 ms): a rank that is last by chance
// is last in about 1/size of the rounds, and short lags are scheduling noise (where ranks
// outnumber the cores, one of them is always waiting for a time slice), while a rank that
// sleeps before each backward pass is last in nearly every round (measured:
// docs/performance.md, Design measurements).
// The samples come from the same messages on every rank, so every rank's figures agree once
// the ranks have decided the same rounds (after any collective has completed everywhere).
//
// Note [Flight record]
// The last HVDLITE_FLIGHT_RECORDER_ROUNDS rounds that decided something (round number, job
// clock, tensors and bytes, last rank and lag, the first kFlightItems tensors by name, op, size
// and outcome), and what the engine thread was last doing (negotiating, or running which
// collective since when). The collectives still pending are the controller's to tell; the
// engine asks it on request (Engine::PendingNow). hvdlite/_runtime/recorder.py writes them
// to the dump files with every thread's Python stack.
//
// Note [Dump requests]
// A dump is asked for by SIGUSR1 (InstallDumpSignal), by a stall warning or stall failure, or
// by another rank (kFlagDump: the rank that got the signal says so in its next round, so one
// signal to any rank dumps every rank of the job, in the same round). The requests go to one
// process-wide doorbell that hvdlite's recorder thread waits on (WaitDump). The signal handler
// only increments an atomic counter and posts a semaphore, both async-signal-safe; everything
// else happens on the waiting thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "fusion.h"
#include "status.h"
#include "types.h"

namespace hvdlite {

constexpr int kStragglerWindow = 100;
constexpr int kStragglerMinRounds = 10;
constexpr int kFlightItems = 8;

struct StragglerFigures {
  int rounds = 0;       // samples in the window (the same for every rank)
  int rounds_last = 0;  // samples in which this rank was last
  double last_fraction = 0, lag_median_s = 0, lag_p95_s = 0;
  bool flagged = false;
};

struct FlightItem {
  std::string name;
  CollectiveKind kind = CollectiveKind::kAllreduce;
  int64_t bytes = 0;
  std::string transport;
  std::string error;  // empty: succeeded
};

struct FlightRound {
  int64_t round = 0;
  int64_t at_us = 0;  // job clock (rank 0's monotonic clock)
  int64_t tensors = 0, bytes = 0;
  int last_rank = -1;
  int64_t lag_us = 0;
  std::vector<FlightItem> items;  // the first kFlightItems
};

// A collective some ranks have submitted and others have not (Controller::PendingView).
struct PendingCollective {
  std::string name;
  CollectiveKind kind = CollectiveKind::kAllreduce;
  int64_t bytes = 0;
  int64_t waited_ms = 0;
  std::vector<int> submitted, missing;
};

struct Traffic {
  int64_t tensors = 0, bytes = 0;
};

// Note [Metrics] (hvdlite/_runtime/metrics.py): counters since the engine started.
struct MetricsSnapshot {
  std::map<std::pair<std::string, std::string>, Traffic> traffic;  // (op, transport)
  std::vector<double> round_bounds_s;  // histogram upper bounds; the last bucket is +Inf
  std::vector<int64_t> round_counts;   // per bucket, not cumulative (round_bounds_s.size() + 1)
  double round_sum_s = 0;
  int64_t rounds = 0;                  // rounds that decided something
  double negotiate_sum_s = 0;          // time in the control exchange and the controller
  int64_t negotiations = 0;            // every round, quiet ones included
  double fusion_fill_sum = 0;          // batch bytes / fusion threshold, per fused batch
  int64_t fused_batches = 0;
  int64_t cache_hits = 0, cache_misses = 0;  // this rank's requests sent as cache ids / whole
  int64_t stall_warnings = 0, stall_failures = 0;
};

class Recorder {
 public:
  Recorder(int size, int64_t flight_rounds, double straggler_min_lag_ms);

  // Off: the engine records nothing (HVDLITE_FLIGHT_RECORDER=0, and bench/insight_cost.py,
  // which switches it in the middle of a job to measure what recording costs).
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  void set_enabled(bool on) { enabled_ = on; }

  // The background thread, before a round's batches run: the decisions of round `round`.
  // `transport(batch)` names the way a batch travels.
  template <typename TransportOf>
  void RecordDecisions(int64_t round, int64_t at_us, const std::vector<Batch>& batches,
                       int64_t fusion_threshold, const TransportOf& transport);
  // After it: the whole round took `seconds` (rounds that decided something only).
  void RecordRoundTime(double seconds);
  // Every round: negotiation time and this rank's cache use.
  void RecordNegotiation(double seconds, int64_t cache_hits, int64_t cache_misses, bool stall_warning);
  // What the engine thread is doing now (Note [Flight record]).
  void SetActivity(std::string what, int64_t since_us);
  // The same as "<what> <round>" (what: a literal), formatted only when read: every round sets
  // two, and a 4-byte allreduce's round takes a few microseconds in all.
  void SetRoundActivity(const char* what, int64_t round, int64_t since_us);

  std::vector<StragglerFigures> Stragglers() const;
  std::vector<FlightRound> Rounds() const;
  std::pair<std::string, int64_t> Activity() const;
  MetricsSnapshot Metrics() const;
  // Note [Straggler attribution]: "rank 2 submitted last in 96 of the last 100 rounds, ..."
  // for the slowest flagged rank, or empty.
  std::string StragglerLine() const;

 private:
  void AddSample(int last_rank, int64_t lag_us);  // with mu_ held
  // The ring's slot for the next round, as the round it held left it: the caller overwrites
  // every field, the items in place, so that their strings keep their capacity and a steady
  // loop of rounds allocates nothing here. With mu_ held; null when the ring is off.
  FlightRound* NextRound();

  std::atomic<bool> enabled_{true};
  const int size_;
  const size_t flight_rounds_;
  const double min_lag_s_;
  mutable std::mutex mu_;
  std::vector<std::pair<int, int64_t>> samples_;  // ring of (last rank, lag us)
  size_t next_sample_ = 0;
  std::vector<FlightRound> rounds_;               // ring
  size_t next_round_ = 0;
  std::string activity_ = "idle";
  const char* activity_prefix_ = nullptr;  // SetRoundActivity's (activity_ is then unused)
  int64_t activity_round_ = 0;
  int64_t activity_since_us_ = 0;
  MetricsSnapshot metrics_;
};

// Note [Dump requests]
void InstallDumpSignal(int signum);
// How many dump signals this process has received (async-signal-safe counter).
uint64_t DumpSignals();
// Asks the recorder thread for a dump; `id` names it the same on every rank ("" for none).
void RingDump(const std::string& id, const std::string& reason);
// Waits up to `timeout_s` for a request; returns the (id, reason) pairs rung since the last
// call (a signal appears as ("", "SIGUSR1")); empty on timeout.
std::vector<std::pair<std::string, std::string>> WaitDump(double timeout_s);

template <typename TransportOf>
void Recorder::RecordDecisions(int64_t round, int64_t at_us, const std::vector<Batch>& batches,
                               int64_t fusion_threshold, const TransportOf& transport) {
  std::lock_guard<std::mutex> lock(mu_);
  FlightRound* record = NextRound();
  int last_rank = -1;
  int64_t lag_us = 0, tensors = 0, bytes_in_round = 0;
  size_t items = 0;  // in record->items, written in place
  for (const Batch& batch : batches) {
    // A batch is one kind over one transport (fusion.h), so its traffic is counted once.
    const std::string how = transport(batch);
    const bool fusable = batch.items.front().status.ok() && !batch.items.front().inlined;
    if (fusable && fusion_threshold > 0 && batch.items.size() > 1) {
      // a batch streamed past the threshold (Note [Streaming a batch through its buffer]) is full
      metrics_.fusion_fill_sum += std::min(1.0, static_cast<double>(batch.bytes) / static_cast<double>(fusion_threshold));
      ++metrics_.fused_batches;
    }
    Traffic moved;
    for (const ReadyItem& item : batch.items) {
      const int64_t bytes = item.status.ok() ? RequestBytes(item.request) : 0;
      if (item.status.code() == StatusCode::kStall) ++metrics_.stall_failures;
      if (item.status.ok()) {
        ++moved.tensors;
        moved.bytes += bytes;
      }
      if (item.last_rank >= 0 && item.lag_us >= lag_us && item.status.ok()) {
        last_rank = item.last_rank;
        lag_us = item.lag_us;
      }
      ++tensors;
      bytes_in_round += bytes;
      if (record != nullptr && items < kFlightItems) {
        FlightItem& flight = items < record->items.size() ? record->items[items] : record->items.emplace_back();
        ++items;
        flight.name.assign(item.request.name);
        flight.kind = item.request.kind;
        flight.bytes = bytes;
        flight.transport.assign(how);
        if (item.status.ok()) {
          flight.error.clear();
        } else {
          flight.error.assign(item.status.message());
        }
      }
    }
    if (moved.tensors > 0) {
      Traffic& t = metrics_.traffic[{KindName(batch.items.front().request.kind), how}];
      t.tensors += moved.tensors;
      t.bytes += moved.bytes;
    }
  }
  if (record != nullptr) {
    record->round = round;
    record->at_us = at_us;
    record->tensors = tensors;
    record->bytes = bytes_in_round;
    record->last_rank = last_rank;
    record->lag_us = lag_us;
    record->items.resize(items);
  }
  if (last_rank >= 0) AddSample(last_rank, lag_us);
}

}  // namespace hvdlite
