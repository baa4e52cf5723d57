// Timeline: an optional Chrome trace of what the engine did (HVDLITE_TIMELINE=path), to open
// in Perfetto or chrome://tracing. One file per rank ("trace.json" becomes "trace.rank1.json"
// in a job of several ranks), pid = rank. Rows: one per tensor name, with its NEGOTIATE span
// (enqueue until every rank had submitted it) and its execution phases (COPY_IN, COLLECTIVE,
// COPY_OUT, or INLINE for tensors that travelled inside the negotiation round), and a
// "rounds" row with one marker per negotiation round that did something.
// Used only by the thread that holds the engine's round lock (and by the engine's constructor,
// before its thread starts); while it is enabled that is the background thread, since callers
// run no rounds then (Note [A waiting caller runs the round] in round_driver.h). No locking. When
// disabled every call returns at once. Start() and Stop() switch it at run time
// (hvd.start_timeline / stop_timeline, applied by the engine's background thread).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <unordered_map>

namespace hvdlite {

int64_t MonotonicMicros();

class Timeline {
 public:
  Timeline(const std::string& path, int rank, int size);
  ~Timeline();
  // Closes the current file, if any, and starts writing `path` (this rank's name for it).
  void Start(const std::string& path);
  void Stop();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  bool enabled() const { return file_ != nullptr; }
  void Span(const std::string& row, const char* name, int64_t start_us, int64_t end_us);
  void Marker(const std::string& row, const char* name, int64_t at_us, const std::string& args_json);

 private:
  static constexpr const char* kOverflowRow = "(other tensors: more than 4096 names)";
  int Row(const std::string& row);
  void Write(const std::string& event);

  std::FILE* file_ = nullptr;
  int rank_;
  int size_;
  bool first_ = true;
  std::unordered_map<std::string, int> rows_;
};

}  // namespace hvdlite
