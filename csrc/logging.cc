#include "logging.h"

#include <cstdio>

namespace hvdlite {

void Logger::Log(LogLevel level, const std::string& message) const {
  if (!Enabled(level)) return;
  static const char* kNames[] = {"TRACE", "DEBUG", "INFO", "WARNING", "ERROR"};
  std::string line = "[hvdlite rank " + std::to_string(rank_) + "] " +
                     kNames[static_cast<int>(level)] + ": " + message + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace hvdlite
