// Controller: negotiation. Decides which tensors are ready on every rank, checks that the
// ranks agree about them, and puts them in one order that every rank computes identically.
//
// Note [Replicated negotiation]
// Every round, every rank sends its RankMessage to every rank over the control process group
// (ControlChannel::Exchange), so every rank holds all ranks' messages for the round. Each rank
// feeds them (indexed by rank) to its own Controller. The Controller is a deterministic state
// machine and every rank feeds it the same input, so every rank reaches the same decisions in
// the same order without a coordinator having to broadcast them: one collective per round
// instead of a gather plus a broadcast.
// Rank 0 still plays the coordinator where a decision depends on something outside the
// messages: time. Stall deadlines are measured on rank 0's clock, carried in its message.
//
// The protocol, one round:
//   1. each rank sends the requests enqueued since its last round (and its flags);
//   2. each request is recorded against its name and rank in the pending table;
//   3. a name is ready when all ranks have requested it; ready names are emitted in the order
//      in which their last request appears in the rank-ordered messages;
//   4. members of a group are held back until the whole group is ready, then emitted together;
//   5. a ready name whose requests disagree is emitted with a kMismatch status that names the
//      field, the ranks and their values; a grouped operation fails as a whole;
//   6. names pending past the stall deadlines produce a warning table, then kStall failures.
// Called only from the background thread; no locking.
//
// Note [Join]
// A rank that has run out of data calls join(). From the round in which its join request is
// recorded until every rank has joined, that rank counts as having submitted every other name:
// a name is ready once all ranks that have not joined requested it. The joined rank still runs
// the collective, with a neutral input (zeros for sums, the op's identity for Min/Max/Product,
// no rows for allgather and alltoall) and discards the result; averages divide by the number of
// ranks that contributed. When the last rank joins, every rank's join completes, returning the
// rank that joined last, and the joined set is cleared.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "message.h"
#include "response_cache.h"
#include "status.h"

namespace hvdlite {

struct ReadyItem {
  Request request;                 // the agreed request (the lowest submitting rank's)
  std::vector<int64_t> rank_dim0;  // allgather: every rank's first dimension (0 if joined)
  std::vector<std::vector<int64_t>> rank_splits;  // alltoall: [sender][receiver] rows
  std::vector<int> joined;         // ranks that take part with a neutral input (Note [Join])
  int contributors = 0;            // ranks that submitted it: averages divide by this
  int last_joined = -1;            // join: the rank that joined last
  bool inlined = false;            // every rank's data came with its request (payloads)
  std::vector<std::string> payloads;  // by rank, when inlined (Note [Inline small tensors])
  Status status;                   // not ok: this tensor fails on every rank with this status
};

struct RoundResult {
  std::vector<ReadyItem> ready;
  bool shutdown = false;         // some rank asked to shut down: everyone stops after this round
  bool quiet = false;            // no rank sent anything and nothing became ready
  bool all_outstanding = false;  // every rank waits on something
  std::string stall_warning;     // non-empty: log it (every rank produces the same text)
};

class Controller {
 public:
  Controller(int size, double stall_check_seconds, double stall_shutdown_seconds,
             size_t cache_capacity = 0);

  // messages[r] is rank r's message for this round; its requests are moved into the table.
  RoundResult ProcessRound(std::vector<RankMessage> messages);

  size_t pending_count() const { return pending_.size(); }
  // Note [Response cache]: how `rank` may abbreviate a request, and how to expand it.
  int32_t CacheLookup(int rank, const Request& request) const { return cache_.Lookup(rank, request); }
  bool CacheResolve(int rank, uint32_t id, Request* out) const { return cache_.Resolve(rank, id, out); }
  size_t cache_entries() const { return cache_.entries(); }

 private:
  struct Pending {
    std::vector<Request> by_rank;   // meaningful where submitted[r]
    std::vector<bool> submitted;
    int count = 0;
    uint64_t sequence = 0;          // arrival order, for deterministic scans
    int64_t first_seen_ms = 0;      // rank 0's clock
    int64_t warned_at_ms = -1;
  };

  void Record(int rank, Request&& request, int64_t now_ms, std::vector<ReadyItem>* ready);
  bool Complete(const Pending& pending) const;
  // Emits (and forgets) the pending names that are now complete, in arrival order.
  void ReleaseCompleted(std::vector<ReadyItem>* ready);
  void Erase(const std::string& name);
  ReadyItem MakeReady(Pending& pending);
  void Release(ReadyItem item, std::vector<ReadyItem>* ready);
  void InspectStalls(int64_t now_ms, RoundResult* result);

  int size_;
  int64_t stall_check_ms_;
  int64_t stall_shutdown_ms_;
  std::unordered_map<std::string, Pending> pending_;
  std::map<uint64_t, const std::string*> arrival_;  // sequence -> pending_'s key, for every name
  uint64_t next_sequence_ = 0;
  std::vector<bool> joined_;
  int last_joined_ = -1;
  std::map<std::string, std::vector<ReadyItem>> held_groups_;
  ResponseCache cache_;
};

// Compares the requests that `ranks` made for one name (by_rank[i] is ranks[i]'s). Returns ""
// when they agree, else the message for the mismatch error. Exposed for unit tests.
std::string CheckAgreement(const std::vector<int>& ranks, const std::vector<Request>& by_rank);

}  // namespace hvdlite
