// Logging: rank-prefixed lines on stderr, filtered by HVDLITE_LOG_LEVEL. Thread-safe (one
// write per line); called from the background thread and from Python-facing calls.
#pragma once

#include <string>

#include "types.h"

namespace hvdlite {

class Logger {
 public:
  Logger(int rank, LogLevel level) : rank_(rank), level_(level) {}
  bool Enabled(LogLevel level) const { return level >= level_; }
  void Log(LogLevel level, const std::string& message) const;
  // An INFO line the user asked for by enabling a feature (autotune's choice): shown unless
  // HVDLITE_LOG_LEVEL=error.
  void Announce(const std::string& message) const;

 private:
  int rank_;
  LogLevel level_;
};

}  // namespace hvdlite
