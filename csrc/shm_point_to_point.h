// ShmPointToPoint: send and receive between ranks of a process group of the backend "hvdlite"
// whose ranks all share this host, through the mailboxes of the group's shared-memory segment
// (ShmSegment::Mailbox). It keeps the promises of MessagePath and PointToPoint
// (point_to_point.h): order per (source, destination, tag), a mismatch named on both ranks with
// no wrong byte written, the timeout, a lost peer named at once, Abort() at once. Its
// operations move along by whichever thread calls in first: the caller (a send posts its
// message and a receive takes one already there before the call returns), a caller waiting on a
// Work (Note [Waiting callers move messages along]), or the path's one progress thread, which
// sleeps on this rank's doorbell while something is pending and nobody else watches.
//
// Note [Point-to-point through shared memory]
// The mailbox area holds a line per rank (its doorbell word, how many of its threads sleep on
// it, whether it closed its path) and, per ordered pair (source, destination), a line with the
// count of messages the source posted and 16 slots of 1 KB. A send takes the next free slot
// of its pair, writes the message's words (message_words: dtype, count, shape, tag), its
// sequence number, and either the bytes themselves (up to kInline, 704 bytes) or the address
// of its contiguous tensor, marks the slot full, raises the pair's count, and rings the
// destination's doorbell (a futex wake only when a thread sleeps on it). The receiver claims a
// full slot (compare and swap, so a withdrawing sender and the receiver never both own it),
// compares the words with its own tensor, copies the bytes (memcpy from the slot, or one
// process_vm_readv straight from the sender's tensor into its own: a single copy, no staging),
// writes its verdict and its own words, marks the slot taken and rings the sender, whose send
// then completes (or raises, naming both tensors); the sender empties the slot. So a send is
// synchronous as torch documents it, a message costs no system call below kInline bytes and
// one above it, and a mismatch moves nothing.
// Order: sends to one destination are posted in call order (a send that finds its pair's
// slots full waits, in order, for one to empty), and a receive takes, among the full slots of
// its source whose sequence number is below the pair's count as read first (so an earlier
// message cannot be missed while a later one is seen), the lowest sequence number with its
// tag. Receives are matched in the order they were posted, each pass over them against the
// counts read once at its start (else a message arriving during the pass could go to a later
// receive after an earlier one had looked for it: a test caught that).
// Used when the group's segment exists with single copy allowed (process_vm_readv between the
// ranks: Note [Single-copy allreduce]) and at most kMailboxMaxRanks ranks; otherwise, or for
// a group across hosts, messages travel through Gloo (Note [Point-to-point messages]).
// A rank may send to itself (its own pair's mailbox; a pipeline with two stages on one rank
// does), where Gloo refuses; a receive from any source takes only other ranks' messages.
// Limit: a sender keeps at most 16 messages unreceived in one pair's slots; a receiver that
// blocks on a 17th before posting receives for the earlier ones waits for the timeout.
//
// Note [Operations that outlive their outcome]
// A send's outcome can be known (aborted, the group shut down) while its receiver is still
// copying its bytes: the operation's future fails at once, but the operation, with its tensor,
// stays until the receiver gives the slot back (or exits), and the destructor waits for that
// (at most 10 s), so no receiver reads memory the sender has freed. Nothing times out a send
// whose receiver is reading it: the receiver's own timeout bounds the copy. A receive that gave
// up on a sender stopped in the middle of writing a chunk keeps its buffer (an Orphan) until
// that chunk is written or the sender exits. The progress thread completes no future itself:
// a completion thread does, so a callback that blocks or lets go of the path stops nothing (a
// callback there that waits on another operation runs the progress and the completions itself).
//
// Note [Waiting callers move messages along]
// The latency of a small message is the time until somebody on the receiving rank notices it.
// A caller that waits on a Work spins, moving every pending operation along, for 20 us, then
// keeps doing so but yields the core between attempts until 500 us have passed, then leaves
// it to the progress thread and blocks on the future (Note [Barrier waits] in shm_segment.h
// measured the same budget). While a caller spins the progress thread does not sleep on the
// doorbell, so a sender rings without a system call, and a new operation does not wake it:
// it looks every kPoll (2 ms) while operations come and go, and is woken only after a second
// without any. So an operation nobody waits on still moves (an irecv posted before a blocking
// collective, whose sender waits for it to be taken), a few milliseconds late at worst.
#pragma once

#include "point_to_point.h"
#include "shm_mailbox.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace hvdlite {

class ShmChannel;
class ShmSegment;

class ShmPointToPoint : public MessagePath, public std::enable_shared_from_this<ShmPointToPoint> {
 public:
  // Whether `channel` can carry a group's point-to-point messages (see the Note).
  static bool Usable(const ShmChannel& channel);
  // `channel`: the group's segment (every rank of the group, indexed by group rank);
  // `timeout`: the process group's.
  static std::shared_ptr<ShmPointToPoint> Make(std::shared_ptr<ShmChannel> channel, std::chrono::milliseconds timeout);
  // Closes this rank's side (peers waiting on it fail naming it) and joins the thread.
  ~ShmPointToPoint() override;

  c10::intrusive_ptr<c10d::Work> Send(const at::Tensor& tensor, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> Recv(const at::Tensor& tensor, int src, int tag) override;
  void Abort(const std::string& why) override;
  std::vector<std::string> Pending() const override;
  c10d::ErrorType error() const override { return static_cast<c10d::ErrorType>(error_.load()); }
  void BeforeWait(const c10::intrusive_ptr<c10::ivalue::Future>& future) override;
  // Moves what it can along (Work::isCompleted calls it, so a caller polling a Work sees it end).
  bool Poll() override;

  // The one-way time of a ping-pong of one word through the segment between ranks 0 and 1
  // (each calls it with the same `rounds`): the floor a message's latency is measured against.
  static double PingPongFloor(const ShmChannel& channel, int rounds);

 private:
  struct Op;
  struct Orphan;
  struct Completions;
  ShmPointToPoint(std::shared_ptr<ShmChannel> channel, std::chrono::milliseconds timeout);
  void Start(const std::shared_ptr<Op>& op);
  // Under mu_: moves every pending operation as far as it goes without waiting; appends the
  // ones that ended to `ended`. True if anything changed.
  bool Progress(std::vector<std::shared_ptr<Op>>* ended);
  bool PostSends(std::vector<std::shared_ptr<Op>>* ended);
  bool MatchReceive(const std::shared_ptr<Op>& op);
  void Take(Op& op, int source, Mail& mail);
  bool ReapSend(Op& op);
  // Note [Large messages copied from both ends] (shm_mailbox.h): the sender's chunks of `op`.
  bool HelpCopy(Op& op);
  // Under mu_: fails operations whose peer is gone or whose time is up (every kCheckMs).
  void CheckPeers(std::vector<std::shared_ptr<Op>>* ended);
  void Fail(Op& op, const std::string& why, c10d::ErrorType kind);
  // Completes the futures of `ended` (never under mu_: a callback may call in again).
  static void Complete(std::vector<std::shared_ptr<Op>>& ended);
  // The progress thread's completions go to the completion thread (Completions).
  void HandOff(std::vector<std::shared_ptr<Op>>& ended);
  static void CompleteLoop(std::shared_ptr<Completions> completions);
  // The destructor's wait for receivers still reading this rank's sends.
  void AwaitHeldSlots();
  bool TryProgress();
  void ProgressLoop();

  const std::shared_ptr<ShmChannel> channel_;  // keeps the mapping
  const ShmSegment& segment_;
  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  const Mailboxes boxes_;

  mutable std::mutex mu_;
  std::condition_variable cv_;           // the progress thread: work to do, or stopping
  std::vector<std::shared_ptr<Op>> live_;  // under mu_: every operation not yet ended, in call order
  std::vector<uint64_t> next_seq_;         // under mu_: per destination, the next send's number
  std::vector<uint64_t> posted_;           // under mu_: per source, its pair's count as this pass read it
  std::string aborted_;                    // under mu_
  bool stopping_ = false;                  // under mu_
  std::atomic<int> spinners_{0};           // callers moving operations along
  std::atomic<bool> parked_{false};        // the progress thread waits to be woken
  std::atomic<int> error_{0};              // a c10d::ErrorType
  std::vector<Orphan> orphans_;             // under mu_
  const std::shared_ptr<Completions> completions_;
  std::thread thread_;     // started under mu_ by the first operation
  std::thread completer_;  // started with thread_
  std::atomic<std::thread::id> completer_id_{};
};

// The private parts both of its files use (shm_point_to_point.cc: messages moving;
// shm_point_to_point_failures.cc: failures, abort and what outlives them).
struct ShmPointToPoint::Op : MessageOp {
  int64_t words[message_words::kWords];  // this side's tensor
  std::string step;
  uint64_t seq = 0;  // sends: the number among this rank's sends to `peer`
  int slot = -1;     // sends: the slot while posted (and while a receiver still holds it)
  bool ended = false;      // the outcome is known (error or not)
  bool completed = false;  // its future was handed to be completed
  std::exception_ptr error;
};

// Note [Operations that outlive their outcome]: a receive that gave up on a sender stopped in
// the middle of writing a chunk keeps its buffer (and the slot it watches) here.
struct ShmPointToPoint::Orphan {
  at::Tensor keep;  // the bytes the sender may still write into
  Mail* mail;
  uint64_t seq;
  int64_t bytes;
  int64_t pid;
};

// Futures the progress thread completes go to a thread of their own, which holds none of the
// path: a callback that blocks there, or drops the path's last reference, stops nothing.
struct ShmPointToPoint::Completions {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::shared_ptr<Op>> queue;
  bool stop = false;
};

}  // namespace hvdlite
