// Controller: negotiation. Decides which tensors are ready on every rank, checks that the
// ranks agree about them, and puts them in one order that every rank computes identically.
// Called only by whichever thread holds the engine's round lock (the background thread or a
// waiting caller: Note [A waiting caller runs the round] in round_driver.h); no locking.
//
// Note [Replicated negotiation]
// Every round, every rank sends its RankMessage to every rank over the control process group
// (ControlChannel::Exchange), so every rank holds all ranks' messages for the round. Each rank
// feeds them (indexed by rank) to its own Controller. The Controller is a deterministic state
// machine and every rank feeds it the same input, so every rank reaches the same decisions in
// the same order without a coordinator having to broadcast them: one collective per round
// instead of a gather plus a broadcast. That holds only while every input is identical: the
// settings are the job's by construction (Note [Job-wide settings] in config.h), and every
// round checks the settings and the controller state of every rank before deciding anything
// (Note [Agreement digest] below).
// Rank 0 still plays the coordinator where a decision depends on something outside the
// messages: time. Stall deadlines are measured on rank 0's clock, carried in its message.
//
// The protocol, one round:
//   1. each rank sends the requests enqueued since its last round (and its flags);
//   2. each request is recorded against its name and rank in the pending table;
//   3. a name is ready when all ranks have requested it; ready names are emitted in the order
//      in which their last request appears in the rank-ordered messages;
//   4. members of a group are held back until the whole group is ready, then emitted together
//      (Note [Grouped operations]);
//   5. a ready name whose requests disagree is emitted with a kMismatch status that names the
//      field, the ranks and their values; a grouped operation fails as a whole;
//   6. names pending past the stall deadlines produce a warning table, then kStall failures.
//
// Note [Join]
// A rank that has run out of data calls join(). From the round in which its join request is
// recorded until every rank has joined, that rank counts as having submitted every other name:
// a name is ready once all ranks that have not joined requested it. The joined rank still runs
// the collective, with a neutral input (zeros for sums, the op's identity for Min/Max/Product,
// no rows for alltoall) and discards the result. An allgather or a broadcast decided while a
// rank has joined fails on the ranks that called it, as in horovod.torch (a joined rank has no
// tensor to send, and a Horovod script expects the error); the job goes on. Averages divide by
// the size of the set, as horovod.torch and DDP's Join do (the joined ranks count as zeros),
// or, with HVDLITE_JOIN_AVERAGE=contributors, by the ranks that contributed. When the last rank
// joins, every rank's join completes, returning the rank that joined last, and the joined set
// is cleared.
// Note [Grouped operations]
// A rank submits all members of a group in one message (the tensor queue takes a group
// whole), so once a rank's message has been recorded its list of members ("manifest") is
// complete. When every rank that has not joined has sent its manifest, the manifests are
// compared: members that differ in count or names fail the whole group on every rank at once
// with a kMismatch naming the ranks and their members, instead of waiting for members that
// will never come. Otherwise members are held as they become ready and released together.
// Any failure of one member (a shape mismatch, a stall) fails every member of the group,
// held or still pending, on every rank; nothing of a failed group is left waiting.
//
// Note [Agreement digest]
// Digest() summarizes what every rank's controller must have identically before a round: a
// chain over every decision made so far (name, outcome, contributors), the response cache's
// contents and the sizes of the pending tables. Each rank sends it in its next message, and a
// difference stops the job before the round is decided (engine.cc), so a controller that
// diverged (a bug) is reported as such instead of showing up as mismatched collectives.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "message.h"
#include "ready_item.h"
#include "recorder.h"
#include "response_cache.h"
#include "status.h"

namespace hvdlite {

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
             size_t cache_capacity = 0, bool average_over_contributors = false);

  // messages[r] is rank r's message for this round; its requests are moved into the table.
  RoundResult ProcessRound(std::vector<RankMessage> messages);

  size_t pending_count() const { return pending_.size(); }
  // Note [Flight record]: the names some ranks submitted and others not, in arrival order,
  // with how long they have waited by `now_ms` (rank 0's clock).
  std::vector<PendingCollective> PendingView(int64_t now_ms) const;
  // Note [Response cache]: how `rank` may abbreviate a request, and how to expand it.
  int32_t CacheLookup(int rank, const Request& request) const { return cache_.Lookup(rank, request); }
  bool CacheResolve(int rank, uint32_t id, Request* out) const { return cache_.Resolve(rank, id, out); }
  size_t cache_entries() const { return cache_.entries(); }
  // Note [Cached rounds] (cached_round.h): the ids a cache hit may take (0 .. id_space() - 1),
  // and whether a round may be settled as a cached one: nothing pending, no group held, no rank
  // joined, a cache. The same on every rank whose controller has not diverged.
  uint32_t id_space() const { return cache_.id_space(); }
  // Note [Cached rounds]: whether every one of `ids` (ready on every rank, each rank's request
  // its cache entry) has a decision to repeat, and the round that repeats them: what
  // ProcessRound would decide for every rank's cached requests, without building them.
  // payloads[r]: rank r's inlined payloads by id (taken).
  bool CanRepeat(const std::vector<uint32_t>& ids) const;
  // `all_idle`: no rank offered a request (a quiet round, as ProcessRound's quiet).
  RoundResult ProcessRepeated(const std::vector<uint32_t>& ids, std::vector<std::map<uint32_t, std::string>>* payloads,
                              bool all_outstanding, bool all_idle, int64_t now_ms);
  bool Settled() const {
    return in_step_enabled_ && cache_.enabled() && pending_.empty() && groups_.empty() && last_joined_ < 0;
  }
  // Note [Agreement digest]
  uint64_t Digest() const;
  // Test hook (Config::test_forget_cache_round): this controller forgets its response cache.
  void ForgetCacheForTest() {
    cache_.Clear();
    repeatable_.clear();
  }
  // Test hook (tests/unit): every round takes the general path (Note [Rounds in step]).
  void DisableInStepForTest() { in_step_enabled_ = false; }
  uint64_t in_step_rounds() const { return in_step_rounds_; }

 private:
  struct Pending {
    std::vector<Request> by_rank;   // meaningful where submitted[r]
    std::vector<bool> submitted;
    int count = 0;
    uint64_t sequence = 0;          // arrival order, for deterministic scans
    int64_t first_seen_ms = 0;      // rank 0's clock
    int64_t warned_at_ms = -1;
  };

  // Note [Grouped operations]: what each rank submitted of one group.
  struct Group {
    std::vector<std::vector<std::string>> manifests;  // by rank; empty: not submitted yet
    std::vector<ReadyItem> held;                      // members ready everywhere
    size_t size = 0;                                  // members, once the manifests agree
  };

  // Note [Rounds in step]
  // The common round of a training loop: nothing is pending, no rank has joined, and every rank
  // sends the same names in the same order, none grouped and none a join. Then every name completes in this
  // round, in that order, exactly as the general path would decide it (each name completes on
  // the last rank's request, so the slow path emits them in the last rank's order, which is
  // everyone's), and the round skips the pending table: no hash entries, no arrival index, no
  // completeness scans. Decisions, the cache and the digest are updated by the same MakeReady
  // and Decide calls. Names are unique within one rank's message (TensorQueue::Push refuses a
  // name already in flight). Every rank sees the same messages, so every rank takes the same
  // path.
  bool InStep(const std::vector<RankMessage>& messages) const;
  // Adds `request` to the pending table; returns its entry, or null (after emitting a kInternal
  // failure) when `rank` had already submitted that name.
  Pending* Add(int rank, Request&& request, int64_t now_ms, std::vector<ReadyItem>* ready);
  void Record(int rank, Request&& request, int64_t now_ms, std::vector<ReadyItem>* ready);
  // All members of one group from one rank's message (they always travel together).
  void RecordGroup(int rank, std::vector<Request>&& members, int64_t now_ms, std::vector<ReadyItem>* ready);
  // Compares the manifests once every rank that has not joined has sent one; false if failed.
  bool CheckManifests(const std::string& group, std::vector<ReadyItem>* ready);
  // Fails every member of `group`, held or pending, with `status` (Note [Grouped operations]).
  void FailGroup(const std::string& group, const Status& status, std::vector<ReadyItem>* ready);
  void Decide(ReadyItem&& item, std::vector<ReadyItem>* ready);
  bool Complete(const Pending& pending) const;
  // Emits (and forgets) the pending names that are now complete, in arrival order.
  void ReleaseCompleted(std::vector<ReadyItem>* ready);
  void Erase(const std::string& name);
  ReadyItem MakeReady(Pending& pending);
  // Note [Cached rounds]: keeps `item` (but not its payloads), decided for the name cached under
  // `id`, as the decision to repeat when every rank sends that entry again (where it can be
  // repeated: every rank contributed, no failure, not an alltoall, whose splits are N x N);
  // forgets it otherwise.
  void Remember(int64_t id, ReadyItem& item);
  // Note [Agreement digest]: chains the round's decisions into decisions_.
  void ChainDecisions(const std::vector<ReadyItem>& ready);
  void InspectStalls(int64_t now_ms, RoundResult* result);

  int size_;
  int64_t stall_check_ms_;
  int64_t stall_shutdown_ms_;
  std::unordered_map<std::string, Pending> pending_;
  std::map<uint64_t, const std::string*> arrival_;  // sequence -> pending_'s key, for every name
  uint64_t next_sequence_ = 0;
  std::vector<bool> joined_;
  int last_joined_ = -1;
  std::map<std::string, Group> groups_;
  ResponseCache cache_;
  std::vector<std::optional<ReadyItem>> repeatable_;  // by cache id: Remember
  uint64_t decisions_ = 0;  // Note [Agreement digest]: chain over every decision
  bool average_over_contributors_;
  bool in_step_enabled_ = true;
  uint64_t in_step_rounds_ = 0;  // rounds that took the short path (for tests)
};


}  // namespace hvdlite
