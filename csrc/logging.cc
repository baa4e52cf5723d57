#include "logging.h"

#include <cstdio>

namespace hvdlite {

namespace {

void Write(int rank, LogLevel level, const std::string& message) {
  static const char* kNames[] = {"TRACE", "DEBUG", "INFO", "WARNING", "ERROR"};
  std::string line = "[hvdlite rank " + std::to_string(rank) + "] " +
                     kNames[static_cast<int>(level)] + ": " + message + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace

void Logger::Log(LogLevel level, const std::string& message) const {
  if (Enabled(level)) Write(rank_, level, message);
}

void Logger::Announce(const std::string& message) const {
  if (Enabled(LogLevel::kWarning)) Write(rank_, LogLevel::kInfo, message);
}

}  // namespace hvdlite
