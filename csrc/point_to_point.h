// PointToPoint: send and receive between two ranks of a process group of the backend "hvdlite"
// (TorchBackend::send, recv, recvAnysource; torch's isend, irecv and batch_isend_irecv call
// them op by op). It promises: messages of one (source, destination, tag) are matched in the
// order they were sent and posted; a receive whose dtype or element count differs from the
// matching send fails on both ranks, naming both ranks, the tag and both tensors, and moves no
// wrong bytes; a receive nothing matches, or a send nobody receives, fails after the group's
// timeout naming the pair and the tag; a lost peer fails the operations waiting on it at once;
// Abort() fails everything pending at once. Every operation completes its Work's future by
// itself, on a thread of its own, so a rank waiting in a receive holds up nothing else: not the
// engine's collectives (which run on the engine's thread and its groups' workers), not other
// receives, not other process groups.
//
// Note [Point-to-point messages]
// One send is three messages over the group's first CPU channel (a Gloo group, connected
// pair by pair on first use: Note [Connections on first use] in hvdlite/_runtime/groups.py),
// each on a Gloo slot of its own derived from the user's tag (Gloo matches a (peer, slot) in
// order, so a tag's messages from one peer keep their order):
//   1. header, sender -> receiver: dtype, element count, shape, bytes;
//   2. data, sender -> receiver: the tensor's bytes (absent for an empty tensor);
//   3. verdict, receiver -> sender: whether the receive took the data, with the receiver's
//      dtype and shape when it did not.
// The receiver posts its data receive only after reading the header, into its own tensor
// when dtype and element count agree and into a scratch buffer otherwise, so a mismatch never
// writes a wrong byte into the caller's tensor and never leaves a message unread on the
// connection: both ranks then raise with both sides' tensors in the message. A send completes
// when its verdict arrives (torch documents send as synchronous; a blocking send is matched
// by a posted receive), so a sender learns of a mismatch in the same call. Receives from one
// source and tag post their data receives in the order their headers were matched (the
// header of the earlier receive was matched first: Gloo's order), whichever thread gets there
// first. A receive from any source reads the header from whichever rank sent first and takes
// the data from that rank.
// Why not the engine's negotiation: a round involves every rank, and a pipeline's stages
// exchange activations between two ranks while the others do something else; point-to-point
// needs only the pair, and agreement between the pair is exactly what the header and the
// verdict check.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

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

class PointToPoint;

// What a process group's point-to-point calls go through: PointToPoint (below, over a Gloo
// group) or ShmPointToPoint (shm_point_to_point.h, through the segment of a group whose ranks
// share a host). Both keep the promises stated here and in PointToPoint's contract.
class MessagePath {
 public:
  static constexpr int kAnySource = -1;
  // The largest tag a user may pass: each tag takes four of the link's Gloo slots.
  static constexpr int kMaxTag = (1 << 29) - 1;
  virtual ~MessagePath() = default;
  virtual c10::intrusive_ptr<c10d::Work> Send(const at::Tensor& tensor, int dst, int tag) = 0;
  // `src`: a rank, or kAnySource.
  virtual c10::intrusive_ptr<c10d::Work> Recv(const at::Tensor& tensor, int src, int tag) = 0;
  // Fails every pending operation with `why` at once, and every later call.
  virtual void Abort(const std::string& why) = 0;
  // The operations in flight, one line each ("recv from rank 1 with tag 0: waiting 2.1 s"):
  // who waits for whom (the stall report and the flight recorder's dump).
  virtual std::vector<std::string> Pending() const = 0;
  // c10d's error kind of the first operation that failed for its peer or the transport (a
  // mismatch is the caller's error, not the group's): SUCCESS, TIMEOUT or COMM_ERROR.
  virtual c10d::ErrorType error() const = 0;
  // Called by a caller about to block on `future`: a path whose operations a waiting thread
  // can move along may do so here for a while (Note [Waiting callers move messages along]).
  virtual void BeforeWait(const c10::intrusive_ptr<c10::ivalue::Future>& future) {}
  // Called by Work::isCompleted before it answers; returns nothing of interest.
  virtual bool Poll() { return false; }
};

// The words that describe a message's tensor (a header, or a verdict), 16 int64: [0] magic,
// [1] tag, [2] dtype, [3] dims, [4] bytes, [5] numel, [6] verdict (1: taken), [7..15] shape.
namespace message_words {
constexpr int64_t kMagic = 0x68766470'32703270;  // "hvdp2p2p"
constexpr int kWords = 16;
constexpr int kMaxDims = kWords - 7;
void Describe(int64_t* words, const at::Tensor& t, int tag);
// "Float [2, 3]"
std::string Shown(const int64_t* words);
// Dtype and element count agree (the shape may differ, as with Gloo).
bool Agree(const int64_t* a, const int64_t* b);
// The DistBackendError c10d raises, as an exception_ptr for a future.
std::exception_ptr DistError(const std::string& message);
// "send to rank 1 with tag 0", "recv from any rank with tag 3": an operation, for messages.
std::string Name(bool send, int peer, int tag);
// "recv from rank 1 with tag 0: waiting for rank 1 to send for 2.1 s": a pending operation.
std::string PendingLine(const std::string& what, const std::string& step, double seconds);
// Checks `tensor` for a point-to-point `what` ("send", "recv") with `peer` and `tag`.
// `self`: whether the path lets a rank send to itself.
void CheckArguments(const char* what, const at::Tensor& tensor, int peer, int tag, int rank, int size, bool self);
}  // namespace message_words

// Blocks until `future` completes or `timeout` passes (<= 0: no limit); true if it completed.
bool WaitFutureFor(const c10::intrusive_ptr<c10::ivalue::Future>& future, std::chrono::milliseconds timeout);

// The Work of one send or receive. Its future completes when the operation ends (with the
// tensor, or with a DistBackendError naming what went wrong).
class P2PWork : public c10d::Work {
 public:
  P2PWork(int rank, c10d::OpType type, std::string what, at::Tensor tensor);
  bool isCompleted() override;
  bool isSuccess() const override;
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override;
  // The rank a receive took its message from (recv from any source reports it here).
  int sourceRank() const override;

 private:
  friend class PointToPoint;
  friend class ShmPointToPoint;
  std::weak_ptr<MessagePath> path_;  // BeforeWait's; empty for the Gloo path
  const std::string what_;  // "recv from rank 1 with tag 0", for errors
  at::Tensor tensor_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<int> source_{-1};
};

// What both paths hold of one send or receive, and its set-up, which is the same on both.
struct MessageOp {
  bool send = false;
  int peer = MessagePath::kAnySource;  // the destination of a send, the source asked for by a receive
  int tag = 0;
  std::string what;  // "send to rank 1 with tag 0"
  at::Tensor user;   // the caller's tensor
  at::Tensor data;   // contiguous: the bytes sent, or where a receive lands
  c10::intrusive_ptr<P2PWork> work;
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  // Fills the fields above for rank `rank`'s send of `tensor` to `peer_rank` (`is_send`) or
  // receive into it from `peer_rank` (a rank, or kAnySource). The path's threads then hold no
  // Python tensor (Note [Tensors handed to c10d] in backend_c10d.cc).
  void Begin(bool is_send, int peer_rank, int message_tag, const at::Tensor& tensor, int rank);
};

class PointToPoint : public MessagePath {
 public:

  // `link`: the Gloo group the messages travel through; `timeout`: how long a header or a
  // verdict is waited for (the process group's timeout).
  PointToPoint(c10::intrusive_ptr<c10d::Backend> link, int rank, int size, std::chrono::milliseconds timeout);
  ~PointToPoint() override;
  PointToPoint(const PointToPoint&) = delete;
  PointToPoint& operator=(const PointToPoint&) = delete;

  c10::intrusive_ptr<c10d::Work> Send(const at::Tensor& tensor, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> Recv(const at::Tensor& tensor, int src, int tag) override;
  void Abort(const std::string& why) override;
  std::vector<std::string> Pending() const override;
  c10d::ErrorType error() const override { return static_cast<c10d::ErrorType>(error_.load()); }

 private:
  struct Op;
  void Start(std::shared_ptr<Op> op);
  void WorkLoop();
  void Run(Op& op);
  void RunSend(Op& op);
  void RunRecv(Op& op);
  // Waits for `work` (a Gloo send or receive of `op`) at most `timeout`; throws naming `step`.
  void Await(Op& op, const c10::intrusive_ptr<c10d::Work>& work, const std::string& step,
             std::chrono::milliseconds timeout);
  // Note [Point-to-point messages]: returns once every earlier receive of op's tag that may
  // have been matched by `source` has posted its data receive.
  void WaitForEarlierReceives(Op& op, int source);
  void Finish(const std::shared_ptr<Op>& op, std::exception_ptr error);

  const c10::intrusive_ptr<c10d::Backend> link_;
  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;

  mutable std::mutex mu_;
  std::condition_variable cv_;           // work for the threads; receives posting their data
  std::deque<std::shared_ptr<Op>> queue_;  // under mu_: operations not yet taken by a thread
  std::vector<std::shared_ptr<Op>> live_;  // under mu_: every operation not yet finished
  std::vector<std::thread> threads_;       // under mu_
  size_t idle_ = 0;                        // under mu_: threads waiting for an operation
  uint64_t posted_ = 0;                    // under mu_: receives posted so far
  std::string aborted_;                    // under mu_: why, once aborted
  bool stopping_ = false;                  // under mu_
  std::atomic<int> error_{0};              // a c10d::ErrorType
};

}  // namespace hvdlite
