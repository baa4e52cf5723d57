// Vocabulary shared by every part of the core: collective kinds, reduce ops and the small
// value types that travel between ranks. Pure data, no locking, no torch headers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hvdlite {

enum class CollectiveKind : uint8_t {
  kAllreduce = 0,
  kAllgather = 1,
  kBroadcast = 2,
  kAlltoall = 3,
  kReducescatter = 4,
  kBarrier = 5,  // no data: completes when every rank has reached it
  kJoin = 6,     // no data: this rank has run out of work (Note [Join] in controller.h)
};
constexpr int kNumCollectiveKinds = 7;

// Values match horovod.torch's constants so ported code that stores them keeps working.
enum class ReduceOp : uint8_t {
  kAverage = 0,
  kSum = 1,
  kAdasum = 2,  // accepted by the Python layer's validation only to reject it clearly
  kMin = 3,
  kMax = 4,
  kProduct = 5,
};
constexpr int kMaxReduceOp = 5;

// Job-wide parameters that rank 0 may change while the job runs (Note [Autotune] in
// autotune.h); every rank plans each round with rank 0's.
struct TunedParams {
  int64_t fusion_threshold_bytes = 0;
  double cycle_time_ms = 0.0;
  bool operator==(const TunedParams& o) const {
    return fusion_threshold_bytes == o.fusion_threshold_bytes && cycle_time_ms == o.cycle_time_ms;
  }
};

enum class LogLevel : uint8_t { kTrace = 0, kDebug = 1, kInfo = 2, kWarning = 3, kError = 4 };

const char* KindName(CollectiveKind kind);
const char* ReduceOpName(ReduceOp op);

// "[17, 3]" for error messages.
std::string ShapeString(const std::vector<int64_t>& shape);

// "rank 2" / "ranks 0, 1, 3".
std::string RanksString(const std::vector<int>& ranks);

}  // namespace hvdlite
