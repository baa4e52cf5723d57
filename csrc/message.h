// Messages exchanged on the control plane, and their compact binary encoding.
//
// Every negotiation round, each rank sends one RankMessage (the requests its Python threads
// enqueued since the last round, plus a few flags) and receives every other rank's. Decoding is
// defensive: each length is checked against the bytes left, so a truncated or corrupt message
// is a Status error, never undefined behaviour. Pure functions; no locking.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "status.h"
#include "types.h"

namespace hvdlite {

// One rank's description of one tensor it wants to take part in a collective.
struct Request {
  std::string name;
  CollectiveKind kind = CollectiveKind::kAllreduce;
  int8_t dtype = 0;          // c10::ScalarType value
  int8_t device_type = 0;    // c10::DeviceType value; the index may differ between ranks
  ReduceOp op = ReduceOp::kSum;
  int32_t root = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<int64_t> shape;
  // Members of a grouped operation share a group name and size; the group is negotiated
  // atomically: it runs when every member is ready on every rank, or fails as a whole.
  std::string group;
  int32_t group_size = 0;
  // alltoall: rows of dimension 0 sent to each rank (one entry per rank).
  std::vector<int64_t> splits;
  // Note [Inline small tensors]: a small CPU tensor's bytes ride along with its request, so
  // when every rank inlined, the round that negotiates it also delivers everyone's data and no
  // data collective is needed. `inlined` without bytes: a broadcast receiver that accepts this.
  bool inlined = false;
  std::string payload;
  // Note [Submission times]: when the sender enqueued it. On the sender, its own monotonic
  // clock; after DecodeRankMessage, microseconds after the sender's `base_us`; once the engine
  // has decoded a round, the job's clock (rank 0's). Not negotiated: not part of SameAs.
  int64_t submitted_us = 0;

  // Equality of everything negotiated (the payload is data, not part of the agreement).
  bool SameAs(const Request& other) const;
};

// Note [Response cache]: a request identical to the one a rank made for the same name when it
// was last ready travels as a small id instead (see response_cache.h). These two callbacks
// connect the encoding to the cache without the encoding knowing about it.
using CacheLookup = std::function<int32_t(const Request&)>;          // -1: not cached
using CacheResolve = std::function<bool(uint32_t id, Request* out)>;  // false: unknown id

enum RankMessageFlags : uint32_t {
  kFlagShutdown = 1u << 0,        // this rank is shutting down; everyone stops after this round
  kFlagHasOutstanding = 1u << 1,  // this rank waits on requests that are not complete yet
  kFlagTuned = 1u << 2,           // rank 0 only: `tuned` holds the parameters for this round
  kFlagReset = 1u << 3,           // with kFlagShutdown: a reset; pending work fails with kReset
  kFlagDump = 1u << 4,            // this process got a dump signal (Note [Dump requests] in recorder.h)
};

// Note [Protocol version]: the first four bytes of every control message; ranks running
// builds that speak different protocols are refused at hvd.init(), before any round.
constexpr uint32_t kProtocolVersion = 5;

struct RankMessage {
  uint32_t flags = 0;
  // Note [Agreement digest] (controller.h): the settings in force (JobWideDigest) and the
  // sender's controller state before this round; both must be the same on every rank.
  uint64_t settings_digest = 0;
  uint64_t state_digest = 0;
  int64_t clock_ms = 0;  // the sender's monotonic clock; rank 0's is the job's clock for stalls
  // Note [Submission times]: the sender's monotonic clock (microseconds) when its previous
  // round's exchange ended; each request's submission time travels relative to it.
  int64_t base_us = 0;
  TunedParams tuned;     // with kFlagTuned (Note [Autotune] in autotune.h)
  // With kFlagShutdown: why this rank shuts down, e.g. "exiting after RuntimeError: ..." (may
  // be empty); the others' errors quote it (Note [Failure reports] in hvdlite/_runtime/failure.py).
  std::string shutdown_reason;
  std::vector<Request> requests;
};

// Note [Submission times]
// Straggler attribution (recorder.h) compares when each rank submitted a tensor, and the ranks'
// clocks are not comparable (other hosts have other monotonic clocks). What every rank does
// see at nearly the same instant is the end of a round's exchange: the collective returns on
// every rank within its latency (microseconds on one host, a network round trip across
// hosts). So each rank sends, with every request, how long after the end of its previous
// exchange it was submitted (clamped to +-35 minutes; a request is taken at most one round
// after it was pushed, so only the first round of an engine comes near), and receivers place
// it on rank 0's clock by adding rank 0's own end of that exchange. Every rank computes the
// same times from the same messages, so every rank's straggler figures agree. The error is the
// spread of the exchange's end across ranks, far below the lags worth reporting.

// Reads only the digests at the front of an encoded message, before anything is decoded with
// the receiver's cache; false if the header is malformed.
bool PeekDigests(const char* data, size_t size, uint64_t* settings, uint64_t* state);

std::string EncodeRankMessage(const RankMessage& message, const CacheLookup& lookup = nullptr);
// Cached references are resolved through `resolve` (payloads are then taken from the message).
Status DecodeRankMessage(const char* data, size_t size, RankMessage* out,
                         const CacheResolve& resolve = nullptr);

}  // namespace hvdlite
