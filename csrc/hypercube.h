// Hypercube: "everyone's bytes" over point-to-point messages, in log2(N) steps, for the control
// plane across hosts (ControlChannel). Called by whichever thread runs the engine's rounds, one
// call at a time; no lock. Its counters for tests are read on the same thread.
//
// Note [Control exchange by hypercube]
// Every rank needs every rank's message each round (Note [Replicated negotiation] in
// controller.h). An alltoall of slots delivers them in one step but costs every rank N - 1
// messages and a connection to every peer: across 32 namespace hosts, a 4-byte allreduce (one
// round) took 2-3.7x Gloo's own ring allreduce, and every rank held about 8 sockets per peer.
// So past HVDLITE_CONTROL_ALLTOALL_MAX ranks (Note [Control exchange by alltoall] in
// control_channel.h) the ranks pair up by recursive doubling: in step k, rank r swaps
// everything it holds with rank r ^ 2^k, so after log2(P) steps (P the largest power of two
// <= N) every rank holds every message. A rank r >= P first hands its message to r - P and gets
// every other message back from it at the end (two more steps for those ranks only). Per rank and
// round: at most log2(N) + 1 messages sent and received, connections to log2(N) + 1 peers only
// (the control link connects only those: Note [Control link] in control_link.h; a Gloo group
// connects lazily, hvdlite/_runtime/groups.py), and the bytes every rank must
// receive anyway (each message once). The replicated controller keeps its input bit for bit:
// only how the bytes travel changed.
//
// Each transfer is [int64 header | bytes]: the header is the byte count of what follows in
// full, or kFailed with a reason. The receiver posts a buffer of the slot times the messages the
// sender holds at that step (the same sizes on both sides: every rank computes the slot alike,
// Note [Slots sized by the last rounds] in control_channel.h); what does not fit follows in
// one more transfer of exactly the rest, on the step's second tag. A smaller transfer lands in
// a larger posted buffer (Gloo's unbound buffers allow it; tests/multirank/test_control_slots.py
// covers both sizes).
//
// Note [Failures travel the hypercube]
// With connections to log2(N) peers only, a rank that dies is seen at once only by its own
// partners; the others wait for a partner that will never send. So a rank whose exchange fails
// (a connection closed, a timeout, a malformed transfer, a partner's kFailed) sends kFailed with
// the reason to every partner on every tag before it throws, and those do the same: the
// failure reaches every rank in at most log2(N) + 1 hops, each as fast as a closed connection,
// and every rank's error quotes the first reason. The kFailed sends are never waited for (a
// partner that already passed that step never receives them); the hypercube is dead afterwards
// and refuses further rounds.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend.h"
#include "pipeline.h"

namespace hvdlite {

class Hypercube {
 public:
  static constexpr int64_t kFailed = -1;
  Hypercube(CollectiveBackend* link, int rank, int size);

  // Every rank's bytes, indexed by rank. `slot`: the bytes one message may take (header
  // included) before its transfer needs a second one; the same on every rank.
  std::vector<std::string> Allgather(const std::string& mine, int64_t slot);
  // Every rank's bytes combined pairwise by `combine`, which must give the same bytes for
  // (a, b) and (b, a) (Note [Cached rounds] in cached_round.h): one transfer per step, of the
  // combination so far, not of every message. A combination longer than kReduceSlot takes a
  // second transfer per step.
  using Combine = std::function<std::string(const std::string&, const std::string&)>;
  std::string Reduce(const std::string& mine, const Combine& combine);
  static constexpr int64_t kReduceSlot = 1024;

  // For tests: transfers sent and second transfers (rest that did not fit), over every round;
  // the peers this rank exchanges with.
  uint64_t sent() const { return sent_; }
  uint64_t rests() const { return rests_; }
  std::vector<int> Peers() const;

 private:
  // A partner's kFailed, whose reason is passed on unchanged.
  struct Forwarded : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  // Ranks a core rank holds before step `k` (its block of 2^k core ranks and their partners >= P).
  std::vector<int> Held(int core_rank, int k) const;
  // Sends `out` (where given; its first part carries at most out_capacity_ bytes) and receives
  // a transfer whose first part carries at most `capacity` (where > 0), with `peer` on `tag`;
  // returns what came.
  std::string Swap(int peer, int tag, const std::string* out, int64_t capacity);
  [[noreturn]] void Fail(const std::string& why);

  CollectiveBackend* link_;
  int rank_, size_, core_ = 1, steps_ = 0;
  int64_t out_capacity_ = 0;
  std::vector<at::Tensor> poison_;            // kFailed transfers in flight (kept alive)
  std::vector<PendingWork> poison_works_;
  std::string failed_;                        // non-empty: a round failed; the reason
  uint64_t sent_ = 0, rests_ = 0;
};

// The encoding of a set of messages inside one transfer: [count] then [rank, length, bytes]
// each. Exposed for the unit tests.
std::string PackMessages(const std::vector<std::string>& messages, const std::vector<int>& ranks);
// Fills messages[rank] for each entry; false if malformed (a rank out of range, lengths past the end).
bool UnpackMessages(const std::string& packed, std::vector<std::string>* messages, std::vector<bool>* have);

}  // namespace hvdlite
