// ControlLink: the control plane's own connections across hosts, one TCP connection to each
// partner of the recursive doubling (Hypercube::Peers), made while init() runs and then read
// and written by whichever thread runs the engine's rounds, itself, while it waits. A
// CollectiveBackend with point-to-point only: the control channel sends every round through
// its hypercube over it (Note [Control exchange by hypercube] in hypercube.h).
//
// Threads: the constructor and Connect run in init() (the GIL released), before the engine
// exists; afterwards StartSend, StartRecv and the works they return are called by the thread
// that holds the engine's round lock (Note [A waiting caller runs the round] in
// round_driver.h), one at a time, so nothing here is locked. Its counters are atomics.
//
// Note [Control link]
// Every negotiation round is the whole cost of a small collective, and across hosts it went
// through a Gloo group: an alltoall of slots up to 16 ranks, Gloo send/receive pairs by
// recursive doubling past it. Each Gloo operation is a chain of thread hand-offs (the caller,
// the group's worker, its loop thread, and the same on the peer), which on namespace hosts cost
// far more than the bytes: a 4-byte hvd.allreduce took 1.1-3.7x Gloo's own 4-byte allreduce
// from 2 to 32 hosts. The same recursive doubling over plain sockets, each step a write and a
// blocking read by the calling thread, took 70 us at 4 hosts and 1.3 ms at 32, where Gloo's
// 4-byte allreduce took 0.95 and 12.7 ms (measured: docs/performance.md, "The control link").
// So the control plane across hosts has connections of its own, log2(N) + 1 per rank (its
// hypercube partners, nothing else), which the round's thread drives: a send is written at
// once (what the socket does not take waits in the peer's queue and goes out while the thread
// waits for anything), and a wait polls every partner's connection, reading whatever arrived,
// so two partners sending large transfers to each other never block each other.
//   - Connecting: rank r connects to its partners below r and accepts those above it. Each
//     rank listens before its address is published with the engine's Gloo addresses (the same
//     store request: Note [Group addresses in two requests] in
//     hvdlite/_runtime/group_store.py), so a connection is never refused for being early, and
//     closes its listener once every partner is connected: after init() nothing listens. A
//     connection opens with a hello [magic, rank, the listener's nonce] and its answer
//     [magic, rank]. The nonce, 64 random bits, was published with the address, so only a
//     process that read the job's store can connect; a hello that is malformed, late or wrong
//     closes the connection, and at most kMaxUnverified unverified connections are held (past
//     it the oldest goes, and a partner whose connection closed before the answer dials
//     again), so a stranger can neither make a rank hold more nor keep a partner out. An
//     address that refuses is final (its listener was open before it was published), so a
//     partner none of whose addresses can be reached fails init at once, not at the timeout. An address is "port:nonce:host[,host]":
//     every address of the interfaces the rank's Gloo groups use; a connector tries them all at
//     once and keeps the first that answers correctly.
//   - Frames: [u32 tag][u32 0][u64 length][bytes], in order on each connection. A frame that
//     arrives before its receive is waited on waits in its (peer, tag) queue, in order;
//     receives of one (peer, tag) are waited on in the order they were started.
//   - Failures: a connection that closes or fails fails the receive that waits on it, naming the
//     peer (frames that arrived before the close are delivered first: a partner's kFailed,
//     Note [Failures travel the hypercube], comes before its exit; a write that fails leaves
//     the connection open for reading until it ends, and a send to a failed peer fails when
//     waited on, after the receive posted before it), and a wait longer than the
//     control timeout (Note [Frozen peers] in hvdlite/_runtime/groups.py) fails naming the
//     peer waited for. A frame longer than kMaxFrame is a corrupt peer, and fails too.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "backend.h"

namespace hvdlite {

class ControlLink : public CollectiveBackend {
 public:
  static constexpr uint32_t kMagic = 0x6876644c;  // "hvdL"
  static constexpr int kMaxUnverified = 64;
  static constexpr uint64_t kMaxFrame = uint64_t{1} << 36;

  // Listens on `listen_host` (an IPv4 address, "0.0.0.0" for every interface) on a port the
  // kernel picks; `published` are the addresses peers are told to try.
  ControlLink(int rank, int size, const std::string& listen_host, const std::vector<std::string>& published,
              double timeout_s);
  ~ControlLink() override;
  ControlLink(const ControlLink&) = delete;
  ControlLink& operator=(const ControlLink&) = delete;

  // "port:nonce:host[,host]", for the job's store.
  std::string address() const;
  // This rank's partners (Hypercube::Peers): the ranks it connects to or accepts.
  std::vector<int> partners() const;
  // Connects every partner, `addresses` holding each one's address(); throws std::runtime_error
  // naming the partners not connected within the timeout, and closes the listener either way.
  void Connect(const std::map<int, std::string>& addresses);

  PendingWork StartSend(at::Tensor& bytes, int peer, int tag) override;
  PendingWork StartRecv(at::Tensor& bytes, int peer, int tag) override;
  bool point_to_point_only() const override { return true; }
  std::string name() const override { return "control link"; }
  PendingWork StartAllreduce(at::Tensor&, ReduceOp) override { NotHere("allreduce"); }
  void Broadcast(at::Tensor&, int) override { NotHere("broadcast"); }
  void Allgather(at::Tensor&, std::vector<at::Tensor>&) override { NotHere("allgather"); }
  void Alltoall(at::Tensor&, at::Tensor&, const std::vector<int64_t>&, const std::vector<int64_t>&) override {
    NotHere("alltoall");
  }

  // For tests: open connections, and frames sent and received.
  int connections() const { return connections_.load(); }
  uint64_t frames_sent() const { return frames_sent_.load(); }
  uint64_t frames_received() const { return frames_received_.load(); }

 private:
  struct Peer {
    int fd = -1;
    std::string in;           // bytes read, not yet a whole frame
    std::string out;          // bytes queued, from out_at on not yet written
    size_t out_at = 0;
    uint64_t queued = 0, written = 0;  // bytes ever queued and written
    std::map<uint32_t, std::deque<std::string>> frames;  // by tag, in arrival order
    std::map<uint32_t, uint64_t> started, taken;         // receives started and waited on, by tag
    std::string failure;      // why the connection ended ("" while open)
  };
  [[noreturn]] void NotHere(const char* what) const;
  Peer& PeerOf(int peer, const char* what);
  // Waits, reading and writing every connection, until `done` holds; throws when `peer`'s
  // connection has failed (and `done` cannot hold any more) or after the timeout.
  void Progress(int peer, const std::function<bool()>& done, const char* waiting_for);
  void Flush(int rank, Peer& p);
  void Read(int rank, Peer& p);
  // Marks `p` failed with `why` (the first reason stays) and stops its sends; closes it unless
  // `keep_reading` (a failed write: what the peer sent before it went is still to be read).
  void Fail(Peer& p, const std::string& why, bool keep_reading = false);

  const int rank_, size_;
  const double timeout_s_;
  int listener_ = -1;
  int port_ = 0;
  uint64_t nonce_ = 0;
  std::vector<std::string> published_;
  std::map<int, Peer> peers_;
  std::atomic<int> connections_{0};
  std::atomic<uint64_t> frames_sent_{0}, frames_received_{0};
};

}  // namespace hvdlite
