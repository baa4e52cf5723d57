#include "timeline.h"

#include <chrono>

namespace hvdlite {
namespace {

std::string Escaped(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

std::string RankPath(const std::string& path, int rank, int size) {
  if (size == 1) return path;
  const size_t dot = path.rfind('.');
  const size_t slash = path.rfind('/');
  const std::string suffix = ".rank" + std::to_string(rank);
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return path + suffix;
  return path.substr(0, dot) + suffix + path.substr(dot);
}

}  // namespace

int64_t MonotonicMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Timeline::Timeline(const std::string& path, int rank, int size) : rank_(rank), size_(size) {
  Start(path);
}

Timeline::~Timeline() { Stop(); }

void Timeline::Start(const std::string& path) {
  Stop();
  if (path.empty()) return;
  file_ = std::fopen(RankPath(path, rank_, size_).c_str(), "w");
  first_ = true;
  rows_.clear();
  if (file_ != nullptr) {
    std::fputs("[\n", file_);
    Write("{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " + std::to_string(rank_) +
          ", \"args\": {\"name\": \"hvdlite rank " + std::to_string(rank_) + "\"}}");
  }
}

void Timeline::Stop() {
  if (file_ == nullptr) return;
  std::fputs("\n]\n", file_);
  std::fclose(file_);
  file_ = nullptr;
}

int Timeline::Row(const std::string& row) {
  auto it = rows_.find(row);
  if (it != rows_.end()) return it->second;
  // A job that names every step's tensors anew (bench/soak.py: 100,000 names) would grow this
  // table, and the process, by ~100 bytes a name: past kMaxRows names share one row.
  constexpr size_t kMaxRows = 4096;
  if (rows_.size() >= kMaxRows && row != kOverflowRow) return Row(kOverflowRow);
  const int tid = static_cast<int>(rows_.size()) + 1;
  rows_.emplace(row, tid);
  Write("{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " + std::to_string(rank_) +
        ", \"tid\": " + std::to_string(tid) + ", \"args\": {\"name\": \"" + Escaped(row) + "\"}}");
  return tid;
}

void Timeline::Span(const std::string& row, const char* name, int64_t start_us, int64_t end_us) {
  if (file_ == nullptr) return;
  const int tid = Row(row);
  Write(std::string("{\"name\": \"") + name + "\", \"ph\": \"X\", \"pid\": " + std::to_string(rank_) +
        ", \"tid\": " + std::to_string(tid) + ", \"ts\": " + std::to_string(start_us) +
        ", \"dur\": " + std::to_string(end_us > start_us ? end_us - start_us : 0) + "}");
}

void Timeline::Marker(const std::string& row, const char* name, int64_t at_us,
                      const std::string& args_json) {
  if (file_ == nullptr) return;
  const int tid = Row(row);
  Write(std::string("{\"name\": \"") + name + "\", \"ph\": \"i\", \"s\": \"t\", \"pid\": " +
        std::to_string(rank_) + ", \"tid\": " + std::to_string(tid) + ", \"ts\": " +
        std::to_string(at_us) + ", \"args\": " + args_json + "}");
}

void Timeline::Write(const std::string& event) {
  if (!first_) std::fputs(",\n", file_);
  first_ = false;
  std::fputs(event.c_str(), file_);
}

}  // namespace hvdlite
