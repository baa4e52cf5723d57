#include "shm_point_to_point.h"

#include "shm_channel.h"
#include "shm_segment.h"
#include "futex.h"
#include "shm_mailbox.h"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace hvdlite {
namespace {

using Clock = std::chrono::steady_clock;
using message_words::kWords;

constexpr auto kSpin = std::chrono::microseconds(20);    // Note [Waiting callers move messages along]
constexpr auto kYield = std::chrono::microseconds(500);
constexpr int kCheckMs = 10;  // peers' liveness and timeouts are checked this often
// Note [Waiting callers move messages along]: how often the progress thread looks for new
// operations while a caller spins or shortly after the last operation ended, and after how
// long without operations it waits to be woken instead.
constexpr auto kPoll = std::chrono::milliseconds(2);
constexpr auto kPark = std::chrono::seconds(1);

}  // namespace

bool ShmPointToPoint::Usable(const ShmChannel& channel) {
  return channel.single_copy_enabled() && channel.segment().Mailbox() != nullptr && channel.segment().size() >= 2;
}

std::shared_ptr<ShmPointToPoint> ShmPointToPoint::Make(std::shared_ptr<ShmChannel> channel,
                                                       std::chrono::milliseconds timeout) {
  return std::shared_ptr<ShmPointToPoint>(new ShmPointToPoint(std::move(channel), timeout));
}

ShmPointToPoint::ShmPointToPoint(std::shared_ptr<ShmChannel> channel, std::chrono::milliseconds timeout)
    : channel_(std::move(channel)),
      segment_(channel_->segment()),
      rank_(segment_.rank()),
      size_(segment_.size()),
      timeout_(timeout),
      boxes_(segment_.Mailbox(), segment_.size()),
      next_seq_(segment_.size(), 0),
      posted_(segment_.size(), 0),
      completions_(std::make_shared<Completions>()) {
  if (segment_.Mailbox() == nullptr) throw std::runtime_error("shared-memory point-to-point: the segment has no mailboxes");
}

ShmPointToPoint::~ShmPointToPoint() {
  Abort("the process group was shut down");
  AwaitHeldSlots();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;  // no thread starts after this
  }
  cv_.notify_all();
  boxes_.Ring(rank_);
  if (thread_.joinable()) thread_.join();  // it runs no caller's code, so it never gets here itself
  {
    std::lock_guard<std::mutex> lock(completions_->mu);
    completions_->stop = true;
  }
  completions_->cv.notify_all();
  if (completer_.joinable()) {
    if (completer_.get_id() == std::this_thread::get_id()) {
      completer_.detach();  // a callback let go of the last reference; the loop touches only completions_
    } else {
      completer_.join();
    }
  }
}

c10::intrusive_ptr<c10d::Work> ShmPointToPoint::Send(const at::Tensor& tensor, int dst, int tag) {
  message_words::CheckArguments("send", tensor, dst, tag, rank_, size_, true);
  auto op = std::make_shared<Op>();
  op->Begin(true, dst, tag, tensor, rank_);
  message_words::Describe(op->words, op->data, tag);
  op->step = "waiting for a free slot to rank " + std::to_string(dst);
  op->work->path_ = weak_from_this();
  Start(op);
  return op->work;
}

c10::intrusive_ptr<c10d::Work> ShmPointToPoint::Recv(const at::Tensor& tensor, int src, int tag) {
  message_words::CheckArguments("recv", tensor, src, tag, rank_, size_, true);
  auto op = std::make_shared<Op>();
  op->Begin(false, src, tag, tensor, rank_);
  message_words::Describe(op->words, op->data, tag);
  op->step = src == kAnySource ? "waiting for a send from any rank" : "waiting for rank " + std::to_string(src) + " to send";
  op->work->path_ = weak_from_this();
  Start(op);
  return op->work;
}

void ShmPointToPoint::Start(const std::shared_ptr<Op>& op) {
  std::vector<std::shared_ptr<Op>> ended;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(aborted_.empty(), "hvdlite backend: ", op->what, ": ", aborted_);
    if (op->send) op->seq = next_seq_[op->peer]++;
    live_.push_back(op);
    // the progress thread starts with the first operation: a group that never sends has none
    if (!thread_.joinable() && !stopping_) {
      completer_ = std::thread([completions = completions_] { CompleteLoop(completions); });
      completer_id_.store(completer_.get_id());
      thread_ = std::thread([this] { ProgressLoop(); });
    }
    Progress(&ended);  // a send posts now; a receive takes a message already there
  }
  Complete(ended);
  // Note [Waiting callers move messages along]: the progress thread looks within kPoll; only a
  // parked one is woken (a wake per message was most of a small message's time).
  if (!op->ended && parked_.load()) cv_.notify_all();
}

bool ShmPointToPoint::Progress(std::vector<std::shared_ptr<Op>>* ended) {
  bool did = false;
  for (const std::shared_ptr<Op>& op : live_) {
    if (op->send && op->slot >= 0) did |= HelpCopy(*op) || ReapSend(*op);
  }
  did |= PostSends(ended);
  // Note [Point-to-point through shared memory]: every receive of this pass sees the messages
  // below the same counts, read once, so a message that arrives during the pass cannot go to a
  // later receive after an earlier one looked for it and found nothing.
  bool receiving = false;
  for (const std::shared_ptr<Op>& op : live_) receiving |= !op->send && !op->ended;
  if (receiving) {
    for (int source = 0; source < size_; ++source) {
      posted_[source] = boxes_.Pair(source, rank_).posted.load(std::memory_order_acquire);
    }
    for (const std::shared_ptr<Op>& op : live_) {
      if (!op->send && !op->ended) did |= MatchReceive(op);
    }
  }
  bool gone = false;
  for (const std::shared_ptr<Op>& op : live_) {
    if (op->ended && !op->completed) {
      op->completed = true;
      ended->push_back(op);
    }
    gone |= op->ended && op->slot < 0;
  }
  // Note [Operations that outlive their outcome]: a send whose slot a receiver still holds
  // stays (its tensor with it) until the slot comes back.
  if (gone) {
    live_.erase(std::remove_if(live_.begin(), live_.end(),
                               [](const std::shared_ptr<Op>& op) { return op->ended && op->slot < 0; }),
                live_.end());
  }
  return did;
}

bool ShmPointToPoint::PostSends(std::vector<std::shared_ptr<Op>>* /*ended*/) {
  bool did = false;
  // the caller's spin runs this on every turn: nothing to post, nothing allocated
  if (std::none_of(live_.begin(), live_.end(),
                   [](const std::shared_ptr<Op>& op) { return op->send && !op->ended && op->slot < 0; })) {
    return false;
  }
  std::vector<char> blocked(size_, 0);  // a destination whose earlier send found no slot
  for (const std::shared_ptr<Op>& op : live_) {
    if (!op->send || op->ended || op->slot >= 0 || blocked[op->peer]) continue;
    MailPair& pair = boxes_.Pair(rank_, op->peer);
    int free = -1;
    for (int i = 0; i < Mailboxes::kSlots && free < 0; ++i) {
      if (boxes_.Slot(rank_, op->peer, i).state.load(std::memory_order_acquire) == Mail::kEmpty) free = i;
    }
    if (free < 0) {
      blocked[op->peer] = 1;
      continue;
    }
    Mail& mail = boxes_.Slot(rank_, op->peer, free);
    const int64_t bytes = op->words[4];
    mail.seq = op->seq;
    std::memcpy(mail.sent, op->words, sizeof(op->words));
    if (bytes <= Mail::kInline) {
      if (bytes > 0) std::memcpy(mail.payload, op->data.data_ptr(), static_cast<size_t>(bytes));
      mail.address = 0;
    } else {
      mail.address = reinterpret_cast<uint64_t>(op->data.data_ptr());
    }
    mail.state.store(Mail::kFull, std::memory_order_release);
    pair.posted.store(op->seq + 1, std::memory_order_release);
    boxes_.Ring(op->peer);
    op->slot = free;
    op->step = "waiting for rank " + std::to_string(op->peer) + " to receive it";
    did = true;
  }
  return did;
}

bool ShmPointToPoint::MatchReceive(const std::shared_ptr<Op>& op) {
  for (int k = 0; k < size_; ++k) {
    const int source = op->peer == kAnySource ? k : op->peer;
    if (source == rank_ && op->peer == kAnySource) continue;  // a rank's own messages only when named
    for (;;) {
      // Note [Point-to-point through shared memory]: every message numbered below the count
      // read first is visible; among those of the tag, the earliest.
      const uint64_t posted = posted_[source];
      Mail* best = nullptr;
      for (int i = 0; i < Mailboxes::kSlots; ++i) {
        Mail& mail = boxes_.Slot(source, rank_, i);
        if (mail.state.load(std::memory_order_acquire) != Mail::kFull || mail.seq >= posted || mail.sent[1] != op->tag) continue;
        if (best == nullptr || mail.seq < best->seq) best = &mail;
      }
      if (best == nullptr) break;
      const uint64_t seq = best->seq;
      uint32_t full = Mail::kFull;
      if (!best->state.compare_exchange_strong(full, Mail::kClaimed, std::memory_order_acq_rel)) continue;  // withdrawn
      if (best->seq != seq || best->sent[1] != op->tag) {
        // withdrawn and refilled between the scan and the claim: not the message scanned
        best->state.store(Mail::kFull, std::memory_order_release);
        continue;
      }
      Take(*op, source, *best);
      return true;
    }
    if (op->peer != kAnySource) break;
  }
  return false;
}

void ShmPointToPoint::Take(Op& op, int source, Mail& mail) {
  const std::string peer = "rank " + std::to_string(source);
  // the byte count is compared too, so a malformed message can never copy past this tensor
  const bool agree = mail.sent[0] == message_words::kMagic && message_words::Agree(mail.sent, op.words) &&
                     mail.sent[4] == op.words[4];
  const int64_t bytes = op.words[4];
  std::string unreadable;
  if (agree && bytes > 0) {
    char* into = static_cast<char*>(op.data.data_ptr());
    if (bytes <= Mail::kInline) {
      std::memcpy(into, mail.payload, static_cast<size_t>(bytes));
    } else if (bytes < Mailboxes::kSharedCopyMin) {
      // Note [Point-to-point through shared memory]: one copy, straight from the sender's tensor.
      const std::string error = Mailboxes::CopyWith(segment_.pid(source), true, into, mail.address, 0, bytes);
      if (!error.empty()) unreadable = "reading " + std::to_string(bytes) + " bytes from " + peer + " failed: " + error;
    } else {
      unreadable = boxes_.ReceiverCopy(mail, source, segment_.pid(source), into, bytes, timeout_);
    }
  }
  int64_t sent[message_words::kWords];  // the slot is the sender's again once taken
  std::memcpy(sent, mail.sent, sizeof(sent));
  if (!unreadable.empty() && static_cast<int64_t>(mail.copied.load()) < bytes && bytes >= Mailboxes::kSharedCopyMin) {
    // Note [Operations that outlive their outcome]: the sender may still finish its chunk
    orphans_.push_back({op.data, &mail, mail.seq, bytes, segment_.pid(source)});
  }
  std::memcpy(mail.answer, op.words, sizeof(op.words));
  mail.answer[6] = !agree ? Mail::kRefused : unreadable.empty() ? Mail::kAccepted : Mail::kUnreadable;
  mail.state.store(Mail::kTaken, std::memory_order_release);
  boxes_.Ring(source);
  op.work->source_.store(source);
  if (!unreadable.empty()) {
    Fail(op, unreadable, c10d::ErrorType::COMM_ERROR);
  } else if (!agree) {
    Fail(op, peer + " sent " + message_words::Shown(sent) + ", but rank " + std::to_string(rank_) +
                 " receives into " + message_words::Shown(op.words) + ": the dtype or the number of elements differs",
         c10d::ErrorType::SUCCESS);
  } else {
    if (!op.data.is_same(op.user)) op.user.copy_(op.data);
    op.ended = true;
  }
}

bool ShmPointToPoint::HelpCopy(Op& op) {
  // Note [Large messages copied from both ends] (shm_mailbox.h)
  if (op.slot < 0) return false;
  return Mailboxes::SenderCopy(boxes_.Slot(rank_, op.peer, op.slot), segment_.pid(op.peer),
                               static_cast<const char*>(op.data.data_ptr()), op.words[4]);
}

bool ShmPointToPoint::ReapSend(Op& op) {
  if (op.slot < 0) return false;
  Mail& mail = boxes_.Slot(rank_, op.peer, op.slot);
  if (mail.state.load(std::memory_order_acquire) != Mail::kTaken) return false;
  const int64_t verdict = mail.answer[6];
  // the receiver's words, for an error only (read before the slot goes back to the sender)
  int64_t answer[message_words::kWords];
  if (verdict != Mail::kAccepted) std::memcpy(answer, mail.answer, sizeof(answer));
  mail.state.store(Mail::kEmpty, std::memory_order_release);
  const std::string peer = verdict == Mail::kAccepted ? "" : "rank " + std::to_string(op.peer);
  op.slot = -1;
  if (op.ended) {
    // failed while the receiver held it (Note [Operations that outlive their outcome])
  } else if (verdict == Mail::kAccepted) {
    op.ended = true;
  } else if (verdict == Mail::kUnreadable) {
    Fail(op, peer + " could not read the message from this process's memory", c10d::ErrorType::COMM_ERROR);
  } else {
    Fail(op, peer + " receives into " + message_words::Shown(answer) + ", but rank " + std::to_string(rank_) + " sent " +
                 message_words::Shown(op.words) + ": the dtype or the number of elements differs",
         c10d::ErrorType::SUCCESS);
  }
  return true;
}

void ShmPointToPoint::Complete(std::vector<std::shared_ptr<Op>>& ended) {
  for (const std::shared_ptr<Op>& op : ended) {
    if (op->error) {
      op->work->future_->setError(op->error);
    } else {
      op->work->future_->markCompleted(c10::IValue(std::vector<at::Tensor>{op->user}));
    }
  }
  ended.clear();
}

void ShmPointToPoint::HandOff(std::vector<std::shared_ptr<Op>>& ended) {
  if (ended.empty()) return;
  {
    std::lock_guard<std::mutex> lock(completions_->mu);
    completions_->queue.insert(completions_->queue.end(), ended.begin(), ended.end());
  }
  completions_->cv.notify_one();
  ended.clear();
}

void ShmPointToPoint::CompleteLoop(std::shared_ptr<Completions> completions) {
  std::unique_lock<std::mutex> lock(completions->mu);
  for (;;) {
    completions->cv.wait(lock, [&] { return completions->stop || !completions->queue.empty(); });
    if (completions->queue.empty()) return;  // stopped
    std::vector<std::shared_ptr<Op>> batch;
    batch.swap(completions->queue);
    lock.unlock();
    Complete(batch);  // may run callbacks, even the path's destructor: only `completions` is used after
    lock.lock();
  }
}

bool ShmPointToPoint::TryProgress() {
  std::vector<std::shared_ptr<Op>> ended;
  bool did = false;
  {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    did = Progress(&ended);
  }
  Complete(ended);
  return did;
}

void ShmPointToPoint::BeforeWait(const c10::intrusive_ptr<c10::ivalue::Future>& future) {
  if (std::this_thread::get_id() == completer_id_.load()) {
    // a callback on the completion thread waits: nobody else would complete what it waits
    // for (Note [Operations that outlive their outcome]), so it does that work itself
    while (!future->completed()) {
      const bool did = TryProgress();
      std::vector<std::shared_ptr<Op>> batch;
      {
        std::lock_guard<std::mutex> lock(completions_->mu);
        batch.swap(completions_->queue);
      }
      Complete(batch);
      if (!did) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return;
  }
  spinners_.fetch_add(1);
  const Clock::time_point start = Clock::now();
  unsigned spins = 0;
  while (!future->completed()) {
    if (TryProgress()) continue;
    Relax();
    if ((++spins & 63) != 0) continue;
    const auto waited = Clock::now() - start;
    if (waited < kSpin) continue;
    if (waited >= kYield) break;
    sched_yield();
  }
  spinners_.fetch_sub(1);
  if (!future->completed()) cv_.notify_all();  // the progress thread watches the doorbell from now on
}

bool ShmPointToPoint::Poll() {
  TryProgress();
  return true;
}

void ShmPointToPoint::ProgressLoop() {
  MailBell& me = boxes_.Bell(rank_);
  Clock::time_point last_check = Clock::now();
  std::vector<std::shared_ptr<Op>> ended;
  std::unique_lock<std::mutex> lock(mu_);
  Clock::time_point busy = Clock::now();  // when an operation was last live
  while (!stopping_) {
    if (live_.empty()) {
      if (Clock::now() - busy < kPark) {
        cv_.wait_for(lock, kPoll);
      } else {
        parked_.store(true);
        cv_.wait(lock, [this] { return stopping_ || !live_.empty(); });
        parked_.store(false);
      }
      continue;
    }
    busy = Clock::now();
    if (Clock::now() - last_check >= std::chrono::milliseconds(kCheckMs)) {
      CheckPeers(&ended);
      last_check = Clock::now();
    }
    bool did = !ended.empty();
    const bool spinning = spinners_.load() > 0;
    if (!spinning) {
      const uint32_t seen = me.ring.load();
      me.sleepers.fetch_add(1);
      did |= Progress(&ended);
      lock.unlock();
      HandOff(ended);
      if (!did) FutexWait(&me.ring, seen, kCheckMs);
      me.sleepers.fetch_sub(1);
      lock.lock();
    } else {
      lock.unlock();
      HandOff(ended);
      lock.lock();
      // Note [Waiting callers move messages along]: a spinning caller watches the doorbell.
      if (spinners_.load() > 0 && !stopping_) cv_.wait_for(lock, kPoll);
    }
  }
}

std::vector<std::string> ShmPointToPoint::Pending() const {
  std::vector<std::string> lines;
  std::lock_guard<std::mutex> lock(mu_);
  const Clock::time_point now = Clock::now();
  for (const std::shared_ptr<Op>& op : live_) {
    const double seconds = std::chrono::duration<double>(now - op->started).count();
    lines.push_back(message_words::PendingLine(op->what, op->step, seconds));
  }
  return lines;
}

double ShmPointToPoint::PingPongFloor(const ShmChannel& channel, int rounds) {
  const ShmSegment& segment = channel.segment();
  if (segment.Mailbox() == nullptr || segment.rank() > 1 || rounds <= 0) return 0.0;
  return Mailboxes(segment.Mailbox(), segment.size()).PingPongFloor(segment.rank(), rounds);
}

}  // namespace hvdlite
