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

}  // namespace

Status Config::FromLookup(const std::function<const char*(const char*)>& lookup, Config* out) {
  Config config;
  // Each setter reads one variable if it is set and non-empty; the first bad value wins.
  auto set = [&](const char* var) -> const char* {
    const char* value = lookup(var);
    return value != nullptr && *value != '\0' ? value : nullptr;
  };
  auto number = [&](const char* var, double minimum, const char* expected, double* field) {
    const char* value = set(var);
    return value ? ParseDouble(var, value, minimum, expected, field) : Status::Ok();
  };
  auto integer = [&](const char* var, int64_t minimum, const char* expected, int64_t* field) {
    const char* value = set(var);
    return value ? ParseInt(var, value, minimum, expected, field) : Status::Ok();
  };
  int64_t autotune = 0, shared_memory = 1, hierarchical = 0;
  const Status statuses[] = {
      integer("HVDLITE_FUSION_THRESHOLD", 0, "a number of bytes >= 0", &config.fusion_threshold_bytes),
      number("HVDLITE_CYCLE_TIME", 0.0, "milliseconds >= 0", &config.cycle_time_ms),
      number("HVDLITE_IDLE_HEARTBEAT_MS", 1.0, "milliseconds >= 1", &config.idle_heartbeat_ms),
      number("HVDLITE_STALL_CHECK_TIME_SECONDS", 0.0, "seconds >= 0", &config.stall_check_seconds),
      number("HVDLITE_STALL_SHUTDOWN_TIME_SECONDS", 0.0, "seconds >= 0 (0 disables)",
             &config.stall_shutdown_seconds),
      integer("HVDLITE_CACHE_CAPACITY", 0, "a number of names >= 0 (0 disables)",
              &config.cache_capacity),
      integer("HVDLITE_INLINE_BYTES", 0, "a number of bytes >= 0 (0 disables)", &config.inline_bytes),
      integer("HVDLITE_GATHER_BYTES", 0, "a number of bytes >= 0 (0 disables)", &config.gather_bytes),
      number("HVDLITE_GATHER_MAX_MS", 0.0, "milliseconds >= 0", &config.gather_max_ms),
      integer("HVDLITE_CPU_CHANNELS", 1, "a number of process groups from 1 to 16", &config.cpu_channels),
      integer("HVDLITE_AUTOTUNE", 0, "0 or 1", &autotune),
      integer("HVDLITE_SHARED_MEMORY", 0, "0 or 1", &shared_memory),
      integer("HVDLITE_HIERARCHICAL_ALLREDUCE", 0, "0 or 1", &hierarchical),
      number("HVDLITE_AUTOTUNE_SAMPLE_SECONDS", 0.001, "seconds >= 0.001",
             &config.autotune_sample_seconds),
      integer("HVDLITE_TEST_FORGET_CACHE_AT_ROUND", 0, "a round number >= 0",
              &config.test_forget_cache_round),
  };
  for (const Status& status : statuses) {
    if (!status.ok()) return status;
  }
  if (config.inline_bytes > (1 << 20)) {
    return BadValue("HVDLITE_INLINE_BYTES", set("HVDLITE_INLINE_BYTES"), "at most 1048576 bytes");
  }
  if (config.cpu_channels > 16) {
    return BadValue("HVDLITE_CPU_CHANNELS", set("HVDLITE_CPU_CHANNELS"), "a number of process groups from 1 to 16");
  }
  if (autotune > 1) return BadValue("HVDLITE_AUTOTUNE", set("HVDLITE_AUTOTUNE"), "0 or 1");
  config.autotune = autotune == 1;
  if (shared_memory > 1) return BadValue("HVDLITE_SHARED_MEMORY", set("HVDLITE_SHARED_MEMORY"), "0 or 1");
  config.shared_memory = shared_memory == 1;
  if (hierarchical > 1) {
    return BadValue("HVDLITE_HIERARCHICAL_ALLREDUCE", set("HVDLITE_HIERARCHICAL_ALLREDUCE"), "0 or 1");
  }
  config.hierarchical_allreduce = hierarchical == 1;
  if (const char* value = set("HVDLITE_AUTOTUNE_LOG")) config.autotune_log_path = value;
  if (const char* value = set("HVDLITE_JOIN_AVERAGE")) {
    const std::string text = value;
    if (text != "size" && text != "contributors") return BadValue("HVDLITE_JOIN_AVERAGE", value, "size or contributors");
    config.average_over_contributors = text == "contributors";
  }
  if (const char* value = set("HVDLITE_TIMELINE")) config.timeline_path = value;
  if (const char* value = set("HVDLITE_LOG_LEVEL")) {
    Status status = ParseLogLevel("HVDLITE_LOG_LEVEL", value, &config.log_level);
    if (!status.ok()) return status;
  }
  *out = config;
  return Status::Ok();
}

const std::vector<std::string>& JobWideVariables() {
  static const std::vector<std::string> kVariables = {
      "HVDLITE_FUSION_THRESHOLD",         "HVDLITE_CYCLE_TIME",
      "HVDLITE_IDLE_HEARTBEAT_MS",        "HVDLITE_STALL_CHECK_TIME_SECONDS",
      "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS", "HVDLITE_CACHE_CAPACITY",
      "HVDLITE_INLINE_BYTES",             "HVDLITE_GATHER_BYTES",
      "HVDLITE_GATHER_MAX_MS",            "HVDLITE_CPU_CHANNELS",
      "HVDLITE_AUTOTUNE",                 "HVDLITE_AUTOTUNE_SAMPLE_SECONDS",
      "HVDLITE_JOIN_AVERAGE",             "HVDLITE_SHARED_MEMORY",
      "HVDLITE_HIERARCHICAL_ALLREDUCE",
  };
  return kVariables;
}

uint64_t JobWideDigest(const Config& c) {
  // FNV-1a over the fields' bytes; doubles are compared bit for bit, as they were parsed from
  // the same strings on every rank.
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&](const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  };
  const int64_t ints[] = {c.fusion_threshold_bytes, c.cache_capacity, c.inline_bytes,
                          c.gather_bytes, c.cpu_channels, c.autotune ? 1 : 0,
                          c.average_over_contributors ? 1 : 0, c.shared_memory ? 1 : 0, c.hierarchical_allreduce ? 1 : 0};
  const double doubles[] = {c.cycle_time_ms, c.idle_heartbeat_ms, c.stall_check_seconds,
                            c.stall_shutdown_seconds, c.gather_max_ms, c.autotune_sample_seconds};
  mix(ints, sizeof(ints));
  mix(doubles, sizeof(doubles));
  return h;
}

}  // namespace hvdlite
