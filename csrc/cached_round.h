// The cached round: a negotiation round of a training loop's steady state, settled by a reduction
// of a few words per rank instead of every rank's message. The offer's encoding, combination and
// verdict are pure functions; the engine's side (Engine::CachedRound and DecideCached, in
// cached_round.cc) runs on the thread that holds the engine's round lock, like every round.
//
// Note [Cached rounds]
// Across hosts every round travels by recursive doubling (Note [Control exchange by hypercube]
// in hypercube.h: over the control link, or past HVDLITE_CONTROL_ALLTOALL_MAX ranks on a Gloo
// group), which bounds the messages per rank at
// log2(N) + 1 but not the bytes: every rank still receives and decodes every rank's message,
// 1.5 KB for a cached ResNet-50 step, 24.5 MB a round at 16,384 ranks. Yet in a training loop's
// steady state every request is a response-cache hit (Note [Response cache] in response_cache.h),
// the same on every rank, and the replicated controller (Note [Replicated negotiation] in
// controller.h) needs no more than which cached entries are ready everywhere. So there, a round
// first tries this: each rank contributes an offer, and the offers are combined pairwise along
// the hypercube (log2(N) steps, each carrying one combined offer, not a set of messages):
//   - flags, ANDed: "my message is only cache hits, no group, no flag, and the controller has
//     nothing pending" (clean), "I wait on something" (outstanding), "I offer nothing" (idle);
//   - the settings and state digests (Note [Agreement digest] in controller.h), each as d and
//     ~d, ANDed: equal everywhere exactly when AND(d) | AND(~d) has every bit set;
//   - rank 0's clock and base time (every other rank offers all ones), ANDed: rank 0's values;
//   - a bit per response-cache id this rank has ready, ANDed: the ids ready on every rank;
//   - the inlined payloads of the ids it offers (Note [Inline small tensors]), by rank: the
//     only part that grows with N, and only by the payloads, which a data collective would move
//     anyway.
// Each combination is canonical (ANDs, and sections ordered by rank), so both partners of a
// step, and in the end every rank, hold the same bytes. When every rank was clean and the
// digests agree, the round is decided from it: for each ready id, every rank repeats the
// decision it made when that entry was last recorded (Controller::ProcessRepeated), with this
// round's payloads, in id order, as the in-step path (Note [Rounds in step] in controller.h)
// would decide every rank's cached request: a cache hit is a request equal to its entry, so
// the decision is the same one. That costs O(ready ids) per round, not O(N x ids): 0.06 ms
// against 0.87 s for a ResNet-50 step at 16,384 ranks (docs/performance.md). An entry without a
// decision to repeat (an alltoall: its N x N splits are not kept) is decided in full from every
// rank's cached request. An offered id that is not ready everywhere stays with its rank and is
// offered again next round (so the pending table, and with it the stall inspector, sees only
// what a full round sent). Anything else (a new name, a shape that changed, a group, a join, a
// shutdown, a dump signal, a digest that differs, a request held past kHoldMs) makes some rank
// unclean, and every rank runs the full round in the same round, which names what differs as
// before: the cost of a round that is not steady is one extra reduction of a few words.
// Why the controller stays replicated rather than a coordinator deciding for all: the steady
// round, the one that must scale, needs no decision to travel (every rank already holds it), so
// a coordinator would add a broadcast and a root that every round waits for and that a failure
// takes down; the full round still gathers every rank's message (O(N) bytes per rank), which a
// gather to one rank and a broadcast of its decisions would bound at the root only, and is left
// as it is because it runs on a job's first step, new names and errors.
// Every round of such an engine starts with the reduction, also where the controller's state
// rules a cached round out (something pending, a group held, a rank joined): a rank then
// offers itself unclean. So every rank runs the same collectives in the same order even if
// their controllers had diverged, and the digests in the reduction send every rank to the
// full round, whose digest check names the ranks that diverged.
// What it gives up: a cached round carries no submission times, so straggler attribution (Note
// [Straggler attribution] in recorder.h) sees no lag in such rounds.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "status.h"

namespace hvdlite {

// One rank's offer for a cached round.
struct CachedOffer {
  int rank = 0;
  bool clean = false;
  bool outstanding = false;
  bool idle = false;  // offers no request at all
  uint64_t settings_digest = 0;
  uint64_t state_digest = 0;
  int64_t clock_ms = 0;  // rank 0's are kept
  int64_t base_us = 0;
  uint32_t id_space = 0;                       // response-cache ids 0 .. id_space - 1
  std::vector<uint32_t> ids;                   // ready here, each < id_space
  std::map<uint32_t, std::string> payloads;    // ids whose request is inlined: its payload
};

// What every rank learns from the combined offers.
struct CachedVerdict {
  bool all_clean = false;
  bool agree = false;          // settings, state digests and id spaces equal everywhere
  bool all_outstanding = false;
  bool all_idle = false;              // no rank offered a request: a quiet round
  int64_t clock_ms = 0, base_us = 0;  // rank 0's
  std::vector<uint32_t> ready;        // ids offered by every rank, ascending
  // By rank: the payloads it offered (inlined requests), by id.
  std::vector<std::map<uint32_t, std::string>> payloads;
};

std::string EncodeOffer(const CachedOffer& offer);
// The combination of two (combined) offers of disjoint sets of ranks; the same bytes whichever
// comes first. Throws std::runtime_error on malformed input.
std::string CombineOffers(const std::string& a, const std::string& b);
// Reads the combination of every rank's offer.
Status ReadVerdict(const std::string& combined, int size, CachedVerdict* out);

}  // namespace hvdlite
