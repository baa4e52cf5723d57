#include "config.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace hvdlite {
namespace {

Status BadValue(const char* var, const char* value, const char* expected) {
  return Status(StatusCode::kInvalidArgument, std::string("invalid ") + var + "='" + value +
                                                  "': expected " + expected);
}

// Parses a whole string as a finite number >= minimum; trailing garbage is an error.
Status ParseDouble(const char* var, const char* value, double minimum, const char* expected,
                   double* out) {
  errno = 0;
  char* end = nullptr;
  double parsed = std::strtod(value, &end);
  if (end == value || *end != '\0' || errno != 0 || !std::isfinite(parsed) || parsed < minimum)
    return BadValue(var, value, expected);
  *out = parsed;
  return Status::Ok();
}

Status ParseInt(const char* var, const char* value, int64_t minimum, const char* expected,
                int64_t* out) {
  errno = 0;
  char* end = nullptr;
  long long parsed = std::strtoll(value, &end, 10);
  if (end == value || *end != '\0' || errno != 0 || parsed < minimum)
    return BadValue(var, value, expected);
  *out = parsed;
  return Status::Ok();
}

Status ParseLogLevel(const char* var, const char* value, LogLevel* out) {
  static const struct { const char* name; LogLevel level; } kLevels[] = {
      {"trace", LogLevel::kTrace}, {"debug", LogLevel::kDebug}, {"info", LogLevel::kInfo},
      {"warning", LogLevel::kWarning}, {"error", LogLevel::kError}};
  for (const auto& entry : kLevels) {
    if (std::string(entry.name) == value) {
      *out = entry.level;
      return Status::Ok();
    }
  }
  return BadValue(var, value, "one of trace, debug, info, warning, error");
}

// Note [One table of settings]
// Every HVDLITE_* variable the core reads is one row of kSettings: its name, the field it
// fills, how it is parsed (with its bounds and the words an error uses), whether it is
// job-wide (Note [Job-wide settings]) and its key in Python's view (_core._parse_config).
// Parsing, the job-wide list, the agreement digest and the Python view all walk this table,
// so a new setting is one row and cannot be parsed but forgotten by the digest.
struct Setting {
  enum class Kind { kInt, kDouble, kFlag, kText, kLevel, kJoinAverage };
  const char* variable;
  const char* key;  // Python's name for the field; nullptr: not shown (test hooks)
  Kind kind;
  bool job_wide;
  double minimum, maximum;
  const char* expected;
  int64_t Config::*int_field;
  double Config::*double_field;
  bool Config::*flag_field;
  std::string Config::*text_field;
};

using K = Setting::Kind;
constexpr double kNoMax = HUGE_VAL;
Setting Int(const char* var, const char* key, bool job_wide, int64_t minimum, double maximum,
            const char* expected, int64_t Config::*field) {
  return {var, key, K::kInt, job_wide, static_cast<double>(minimum), maximum, expected, field, nullptr, nullptr, nullptr};
}
Setting Double(const char* var, const char* key, bool job_wide, double minimum, const char* expected,
               double Config::*field) {
  return {var, key, K::kDouble, job_wide, minimum, kNoMax, expected, nullptr, field, nullptr, nullptr};
}
Setting Flag(const char* var, const char* key, bool job_wide, bool Config::*field) {
  return {var, key, K::kFlag, job_wide, 0, 1, "0 or 1", nullptr, nullptr, field, nullptr};
}
Setting Text(const char* var, const char* key, std::string Config::*field) {
  return {var, key, K::kText, false, 0, 0, "", nullptr, nullptr, nullptr, field};
}

const std::vector<Setting>& Settings() {
  static const std::vector<Setting> kSettings = {
      Int("HVDLITE_FUSION_THRESHOLD", "fusion_threshold_bytes", true, 0, kNoMax, "a number of bytes >= 0",
          &Config::fusion_threshold_bytes),
      Double("HVDLITE_CYCLE_TIME", "cycle_time_ms", true, 0.0, "milliseconds >= 0", &Config::cycle_time_ms),
      Double("HVDLITE_IDLE_HEARTBEAT_MS", "idle_heartbeat_ms", true, 1.0, "milliseconds >= 1",
             &Config::idle_heartbeat_ms),
      Double("HVDLITE_STALL_CHECK_TIME_SECONDS", "stall_check_seconds", true, 0.0, "seconds >= 0",
             &Config::stall_check_seconds),
      Double("HVDLITE_STALL_SHUTDOWN_TIME_SECONDS", "stall_shutdown_seconds", true, 0.0,
             "seconds >= 0 (0 disables)", &Config::stall_shutdown_seconds),
      Int("HVDLITE_CACHE_CAPACITY", "cache_capacity", true, 0, kNoMax, "a number of names >= 0 (0 disables)",
          &Config::cache_capacity),
      Int("HVDLITE_INLINE_BYTES", "inline_bytes", true, 0, 1 << 20, "a number of bytes from 0 (disables) to 1048576",
          &Config::inline_bytes),
      Int("HVDLITE_GATHER_BYTES", "gather_bytes", true, 0, kNoMax, "a number of bytes >= 0 (0 disables)",
          &Config::gather_bytes),
      Double("HVDLITE_GATHER_MAX_MS", "gather_max_ms", true, 0.0, "milliseconds >= 0", &Config::gather_max_ms),
      Int("HVDLITE_CPU_CHANNELS", "cpu_channels", true, 1, 16, "a number of process groups from 1 to 16",
          &Config::cpu_channels),
      Int("HVDLITE_CONTROL_ALLTOALL_MAX", "control_alltoall_max", true, 0, kNoMax, "a number of ranks >= 0",
          &Config::control_alltoall_max),
      Flag("HVDLITE_CACHED_ROUNDS", "cached_rounds", true, &Config::cached_rounds),
      Flag("HVDLITE_CONTROL_LINK", "control_link", true, &Config::control_link),
      Flag("HVDLITE_AUTOTUNE", "autotune", true, &Config::autotune),
      Double("HVDLITE_AUTOTUNE_SAMPLE_SECONDS", "autotune_sample_seconds", true, 0.001, "seconds >= 0.001",
             &Config::autotune_sample_seconds),
      {"HVDLITE_JOIN_AVERAGE", "average_over_contributors", K::kJoinAverage, true, 0, 0, "size or contributors",
       nullptr, nullptr, &Config::average_over_contributors, nullptr},
      Flag("HVDLITE_SHARED_MEMORY", "shared_memory", true, &Config::shared_memory),
      Flag("HVDLITE_SINGLE_COPY", "single_copy", true, &Config::single_copy),
      Flag("HVDLITE_SHM_POINT_TO_POINT", "shm_point_to_point", true, &Config::shm_point_to_point),
      Flag("HVDLITE_HIERARCHICAL_ALLREDUCE", "hierarchical_allreduce", true, &Config::hierarchical_allreduce),
      Flag("HVDLITE_CALLER_ROUNDS", "caller_rounds", false, &Config::caller_rounds),
      Text("HVDLITE_AUTOTUNE_LOG", "autotune_log_path", &Config::autotune_log_path),
      Text("HVDLITE_TIMELINE", "timeline_path", &Config::timeline_path),
      {"HVDLITE_LOG_LEVEL", "log_level", K::kLevel, false, 0, 0, "one of trace, debug, info, warning, error",
       nullptr, nullptr, nullptr, nullptr},
      Double("HVDLITE_STRAGGLER_REPORT_SECONDS", "straggler_report_seconds", false, 0.0, "seconds >= 0 (0 disables)",
             &Config::straggler_report_seconds),
      Double("HVDLITE_STRAGGLER_MIN_LAG_MS", "straggler_min_lag_ms", true, 0.0, "milliseconds >= 0",
             &Config::straggler_min_lag_ms),
      Int("HVDLITE_FLIGHT_RECORDER_ROUNDS", "flight_recorder_rounds", false, 0, 100000,
          "a number of rounds from 0 to 100000", &Config::flight_recorder_rounds),
      Int("HVDLITE_TEST_FORGET_CACHE_AT_ROUND", nullptr, false, 0, kNoMax, "a round number >= 0",
          &Config::test_forget_cache_round),
  };
  return kSettings;
}

// Parses `value` into the row's field of `config`.
Status Parse(const Setting& s, const char* value, Config* config) {
  switch (s.kind) {
    case K::kInt: {
      int64_t parsed = 0;
      Status status = ParseInt(s.variable, value, static_cast<int64_t>(s.minimum), s.expected, &parsed);
      if (!status.ok()) return status;
      if (static_cast<double>(parsed) > s.maximum) return BadValue(s.variable, value, s.expected);
      config->*s.int_field = parsed;
      return Status::Ok();
    }
    case K::kDouble:
      return ParseDouble(s.variable, value, s.minimum, s.expected, &(config->*s.double_field));
    case K::kFlag: {
      int64_t parsed = 0;
      Status status = ParseInt(s.variable, value, 0, s.expected, &parsed);
      if (!status.ok()) return status;
      if (parsed > 1) return BadValue(s.variable, value, s.expected);
      config->*s.flag_field = parsed == 1;
      return Status::Ok();
    }
    case K::kJoinAverage: {
      const std::string text = value;
      if (text != "size" && text != "contributors") return BadValue(s.variable, value, s.expected);
      config->*s.flag_field = text == "contributors";
      return Status::Ok();
    }
    case K::kText:
      config->*s.text_field = value;
      return Status::Ok();
    case K::kLevel:
      return ParseLogLevel(s.variable, value, &config->log_level);
  }
  return Status::Ok();
}

}  // namespace

Status Config::FromLookup(const std::function<const char*(const char*)>& lookup, Config* out) {
  Config config;
  // Each row reads its variable if it is set and non-empty; the first bad value wins.
  for (const Setting& setting : Settings()) {
    const char* value = lookup(setting.variable);
    if (value == nullptr || *value == '\0') continue;
    Status status = Parse(setting, value, &config);
    if (!status.ok()) return status;
  }
  *out = config;
  return Status::Ok();
}

const std::vector<std::string>& JobWideVariables() {
  static const std::vector<std::string> kVariables = [] {
    std::vector<std::string> out;
    for (const Setting& s : Settings()) {
      if (s.job_wide) out.push_back(s.variable);
    }
    return out;
  }();
  return kVariables;
}

uint64_t JobWideDigest(const Config& c) {
  // FNV-1a over the job-wide fields' bytes, in table order; doubles are compared bit for bit,
  // as they were parsed from the same strings on every rank.
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&](const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  };
  for (const Setting& s : Settings()) {
    if (!s.job_wide) continue;
    if (s.int_field) mix(&(c.*s.int_field), sizeof(int64_t));
    if (s.double_field) mix(&(c.*s.double_field), sizeof(double));
    if (s.flag_field) {
      const uint8_t flag = (c.*s.flag_field) ? 1 : 0;
      mix(&flag, 1);
    }
  }
  return h;
}

void VisitSettings(const Config& c, const SettingVisitor& visit) {
  for (const Setting& s : Settings()) {
    if (s.key == nullptr) continue;
    if (s.int_field) visit.integer(s.key, c.*s.int_field);
    if (s.double_field) visit.number(s.key, c.*s.double_field);
    if (s.flag_field) visit.flag(s.key, c.*s.flag_field);
    if (s.text_field) visit.text(s.key, c.*s.text_field);
    if (s.kind == K::kLevel) visit.integer(s.key, static_cast<int64_t>(c.log_level));
  }
}

}  // namespace hvdlite
