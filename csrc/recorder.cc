#include "recorder.h"

#include <semaphore.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <ctime>

namespace hvdlite {
namespace {

// Upper bounds of the round-time histogram, in seconds.
const std::vector<double>& RoundBounds() {
  static const std::vector<double> bounds = {50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3,
                                             10e-3, 25e-3,  50e-3,  100e-3, 250e-3, 1.0};
  return bounds;
}

double Quantile(std::vector<int64_t> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(values.size())));  // nearest rank
  const size_t at = std::min(values.size(), std::max<size_t>(rank, 1)) - 1;
  return static_cast<double>(values[at]) / 1e6;
}

}  // namespace

Recorder::Recorder(int size, int64_t flight_rounds, double straggler_min_lag_ms)
    : size_(size),
      flight_rounds_(static_cast<size_t>(std::max<int64_t>(flight_rounds, 0))),
      min_lag_s_(straggler_min_lag_ms / 1000.0) {
  metrics_.round_bounds_s = RoundBounds();
  metrics_.round_counts.assign(RoundBounds().size() + 1, 0);
}

void Recorder::AddSample(int last_rank, int64_t lag_us) {
  if (samples_.size() < static_cast<size_t>(kStragglerWindow)) {
    samples_.emplace_back(last_rank, lag_us);
    return;
  }
  samples_[next_sample_] = {last_rank, lag_us};
  next_sample_ = (next_sample_ + 1) % samples_.size();
}

FlightRound* Recorder::NextRound() {
  if (flight_rounds_ == 0) return nullptr;
  if (rounds_.size() < flight_rounds_) return &rounds_.emplace_back();
  FlightRound* slot = &rounds_[next_round_];
  next_round_ = (next_round_ + 1) % rounds_.size();
  return slot;
}

void Recorder::RecordRoundTime(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto& bounds = metrics_.round_bounds_s;
  const size_t bucket = std::lower_bound(bounds.begin(), bounds.end(), seconds) - bounds.begin();
  ++metrics_.round_counts[bucket];
  metrics_.round_sum_s += seconds;
  ++metrics_.rounds;
}

void Recorder::RecordNegotiation(double seconds, int64_t cache_hits, int64_t cache_misses, bool stall_warning) {
  std::lock_guard<std::mutex> lock(mu_);
  metrics_.negotiate_sum_s += seconds;
  ++metrics_.negotiations;
  metrics_.cache_hits += cache_hits;
  metrics_.cache_misses += cache_misses;
  if (stall_warning) ++metrics_.stall_warnings;
}

void Recorder::SetActivity(std::string what, int64_t since_us) {
  std::lock_guard<std::mutex> lock(mu_);
  activity_ = std::move(what);
  activity_prefix_ = nullptr;
  activity_since_us_ = since_us;
}

void Recorder::SetRoundActivity(const char* what, int64_t round, int64_t since_us) {
  std::lock_guard<std::mutex> lock(mu_);
  activity_prefix_ = what;
  activity_round_ = round;
  activity_since_us_ = since_us;
}

std::vector<StragglerFigures> Recorder::Stragglers() const {
  std::vector<std::vector<int64_t>> lags(size_);
  int rounds = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rounds = static_cast<int>(samples_.size());
    for (const auto& [rank, lag] : samples_) {
      if (rank >= 0 && rank < size_) lags[rank].push_back(lag);
    }
  }
  const double needed = std::max(0.6, 1.75 / size_);  // Note [Straggler attribution]
  std::vector<StragglerFigures> out(size_);
  for (int r = 0; r < size_; ++r) {
    StragglerFigures& f = out[r];
    f.rounds = rounds;
    f.rounds_last = static_cast<int>(lags[r].size());
    f.last_fraction = rounds == 0 ? 0.0 : static_cast<double>(f.rounds_last) / rounds;
    f.lag_median_s = Quantile(lags[r], 0.5);
    f.lag_p95_s = Quantile(lags[r], 0.95);
    f.flagged = rounds >= kStragglerMinRounds && f.last_fraction >= needed && f.lag_median_s >= min_lag_s_;
  }
  return out;
}

std::string Recorder::StragglerLine() const {
  const std::vector<StragglerFigures> figures = Stragglers();
  int worst = -1;
  for (int r = 0; r < size_; ++r) {
    if (figures[r].flagged && (worst < 0 || figures[r].lag_median_s > figures[worst].lag_median_s)) worst = r;
  }
  if (worst < 0) return "";
  const StragglerFigures& f = figures[worst];
  char line[256];
  std::snprintf(line, sizeof(line),
                "straggler: rank %d submitted last in %d of the last %d rounds, a median %.1f ms "
                "(p95 %.1f ms) after the first rank",
                worst, f.rounds_last, f.rounds, f.lag_median_s * 1e3, f.lag_p95_s * 1e3);
  return line;
}

std::vector<FlightRound> Recorder::Rounds() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<FlightRound> out;
  out.reserve(rounds_.size());
  for (size_t i = 0; i < rounds_.size(); ++i) out.push_back(rounds_[(next_round_ + i) % rounds_.size()]);
  return out;
}

std::pair<std::string, int64_t> Recorder::Activity() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (activity_prefix_ != nullptr) {
    return {std::string(activity_prefix_) + " " + std::to_string(activity_round_), activity_since_us_};
  }
  return {activity_, activity_since_us_};
}

MetricsSnapshot Recorder::Metrics() const {
  std::lock_guard<std::mutex> lock(mu_);
  return metrics_;
}

// Note [Dump requests]: the process-wide doorbell.
namespace {

std::atomic<uint64_t> g_signals{0};
sem_t g_bell;
std::once_flag g_bell_once;
std::mutex g_rung_mu;
std::vector<std::pair<std::string, std::string>> g_rung;  // under g_rung_mu
uint64_t g_signals_seen = 0;                              // under g_rung_mu

void Bell() {
  std::call_once(g_bell_once, [] { sem_init(&g_bell, 0, 0); });
}

void OnDumpSignal(int) {
  g_signals.fetch_add(1, std::memory_order_relaxed);
  sem_post(&g_bell);  // async-signal-safe
}

}  // namespace

void InstallDumpSignal(int signum) {
  Bell();
  struct sigaction action = {};
  action.sa_handler = OnDumpSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(signum, &action, nullptr);
}

uint64_t DumpSignals() { return g_signals.load(std::memory_order_relaxed); }

void RingDump(const std::string& id, const std::string& reason) {
  Bell();
  {
    std::lock_guard<std::mutex> lock(g_rung_mu);
    // Bounded: with the recorder thread off (HVDLITE_FLIGHT_RECORDER=0) nobody takes them.
    if (g_rung.size() >= 64) g_rung.erase(g_rung.begin());
    g_rung.emplace_back(id, reason);
  }
  sem_post(&g_bell);
}

std::vector<std::pair<std::string, std::string>> WaitDump(double timeout_s) {
  Bell();
  timespec deadline{};
  clock_gettime(CLOCK_REALTIME, &deadline);
  const double whole = std::floor(timeout_s);
  deadline.tv_sec += static_cast<time_t>(whole);
  deadline.tv_nsec += static_cast<long>((timeout_s - whole) * 1e9);
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec += 1;
    deadline.tv_nsec -= 1000000000L;
  }
  while (sem_timedwait(&g_bell, &deadline) != 0) {
    if (errno != EINTR) return {};
  }
  while (sem_trywait(&g_bell) == 0) {
  }  // one wake-up for everything rung so far
  std::lock_guard<std::mutex> lock(g_rung_mu);
  std::vector<std::pair<std::string, std::string>> out;
  out.swap(g_rung);
  const uint64_t signals = DumpSignals();
  if (signals != g_signals_seen) {
    out.emplace_back("", "SIGUSR1");
    g_signals_seen = signals;
  }
  return out;
}

}  // namespace hvdlite
