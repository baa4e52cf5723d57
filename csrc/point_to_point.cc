#include "point_to_point.h"

#include "backend_c10d.h"

#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>
#include <utility>

namespace hvdlite {
namespace {

using Clock = std::chrono::steady_clock;

// Note [Point-to-point messages]: a tag's four Gloo slots.
enum Slot : int { kHeader = 0, kData = 1, kVerdict = 2 };
int SlotOf(int tag, Slot slot) { return tag * 4 + slot; }

using message_words::kMagic;
using message_words::kMaxDims;
using message_words::kWords;

// `t`'s bytes as a flat uint8 tensor on its storage (no Python object: Note [Tensors handed to c10d]).
at::Tensor Bytes(const at::Tensor& t) {
  at::Tensor alias = at::empty({0}, t.options().dtype(at::kByte));
  alias.set_(t.storage(), t.storage_offset() * static_cast<int64_t>(t.element_size()),
             {t.numel() * static_cast<int64_t>(t.element_size())}, {1});
  return alias;
}

at::Tensor Words() { return at::zeros({kWords}, at::TensorOptions().dtype(at::kLong)); }

void Describe(at::Tensor& words, const at::Tensor& t, int tag) {
  message_words::Describe(words.data_ptr<int64_t>(), t, tag);
}

std::string Shown(const at::Tensor& words) { return message_words::Shown(words.data_ptr<int64_t>()); }

bool Agree(const at::Tensor& a, const at::Tensor& b) {
  return message_words::Agree(a.data_ptr<int64_t>(), b.data_ptr<int64_t>());
}

using message_words::DistError;

std::string Seconds(std::chrono::milliseconds ms) {
  std::ostringstream out;
  out << static_cast<double>(ms.count()) / 1000.0 << " s";
  return out.str();
}

}  // namespace

namespace message_words {

void Describe(int64_t* w, const at::Tensor& t, int tag) {
  std::fill(w, w + kWords, 0);
  w[0] = kMagic;
  w[1] = tag;
  w[2] = static_cast<int64_t>(t.scalar_type());
  w[3] = t.dim();
  w[4] = t.numel() * static_cast<int64_t>(t.element_size());
  w[5] = t.numel();
  for (int64_t d = 0; d < t.dim(); ++d) w[7 + d] = t.size(d);
}

std::string Shown(const int64_t* w) {
  std::ostringstream out;
  out << c10::toString(static_cast<c10::ScalarType>(w[2])) << " [";
  for (int64_t d = 0; d < std::min<int64_t>(w[3], kMaxDims); ++d) out << (d ? ", " : "") << w[7 + d];
  out << "]";
  return out.str();
}

bool Agree(const int64_t* x, const int64_t* y) { return x[2] == y[2] && x[5] == y[5]; }

std::exception_ptr DistError(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

std::string Name(bool send, int peer, int tag) {
  const std::string who = peer == MessagePath::kAnySource ? "any rank" : "rank " + std::to_string(peer);
  return (send ? "send to " : "recv from ") + who + " with tag " + std::to_string(tag);
}

std::string PendingLine(const std::string& what, const std::string& step, double seconds) {
  std::ostringstream line;
  line << what << ": " << step << " for " << seconds << " s";
  return line.str();
}

void CheckArguments(const char* what, const at::Tensor& tensor, int peer, int tag, int rank, int size, bool self) {
  const bool send = std::string(what) == "send";
  TORCH_CHECK((!send && peer == MessagePath::kAnySource) || (peer >= 0 && peer < size && (self || peer != rank)),
              "hvdlite backend: ", what, ": the ", send ? "destination " : "source ", peer, " is not ",
              self ? "a rank" : "another rank", " of this group of ", size,
              peer == rank ? " (across hosts a rank cannot send to itself)" : "");
  TORCH_CHECK(tag >= 0 && tag <= MessagePath::kMaxTag, "hvdlite backend: ", what, ": tag ", tag, " is outside 0..",
              MessagePath::kMaxTag);
  TORCH_CHECK(tensor.device().is_cpu(), "hvdlite backend: ", what, send ? " of a " : " into a ", tensor.device().str(),
              " tensor: point-to-point carries CPU and CUDA tensors");
  TORCH_CHECK(tensor.dim() <= kMaxDims, "hvdlite backend: ", what, ": a tensor of ", tensor.dim(),
              " dimensions (at most ", kMaxDims, ")");
}

}  // namespace message_words

bool WaitFutureFor(const c10::intrusive_ptr<c10::ivalue::Future>& future, std::chrono::milliseconds timeout) {
  if (future->completed()) return true;
  if (timeout.count() <= 0) {  // kNoTimeout or kUnsetTimeout
    future->wait();
    return true;
  }
  struct Signal {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  auto signal = std::make_shared<Signal>();
  future->addCallback([signal](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(signal->mu);
    signal->done = true;
    signal->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(signal->mu);
  return signal->cv.wait_for(lock, timeout, [&] { return signal->done; });
}

// ---- P2PWork --------------------------------------------------------------------------------

P2PWork::P2PWork(int rank, c10d::OpType type, std::string what, at::Tensor tensor)
    : c10d::Work(rank, type),
      what_(std::move(what)),
      tensor_(std::move(tensor)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

bool P2PWork::isCompleted() {
  if (!future_->completed()) {
    if (std::shared_ptr<MessagePath> path = path_.lock()) path->Poll();
  }
  return future_->completed();
}

bool P2PWork::isSuccess() const { return future_->completed() && !future_->hasError(); }

bool P2PWork::wait(std::chrono::milliseconds timeout) {
  if (!future_->completed()) {
    if (std::shared_ptr<MessagePath> path = path_.lock()) path->BeforeWait(future_);
  }
  if (!WaitFutureFor(future_, timeout)) {
    C10_THROW_ERROR(DistBackendError, "hvdlite backend: " + what_ + " did not complete within " +
                                          std::to_string(timeout.count()) + " ms (the wait's timeout)");
  }
  if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  return true;
}

std::vector<at::Tensor> P2PWork::result() {
  future_->wait();
  if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  return {tensor_};
}

int P2PWork::sourceRank() const {
  const int source = source_.load();
  TORCH_CHECK(source >= 0, "hvdlite backend: ", what_, ": the source rank is known once a receive has completed");
  return source;
}

void MessageOp::Begin(bool is_send, int peer_rank, int message_tag, const at::Tensor& tensor, int rank) {
  send = is_send;
  peer = peer_rank;
  tag = message_tag;
  what = message_words::Name(send, peer, tag);
  user = Unowned(tensor);
  data = send ? user.contiguous() : tensor.is_contiguous() ? user : at::empty(tensor.sizes(), tensor.options());
  const c10d::OpType type = send ? c10d::OpType::SEND
                                 : peer == MessagePath::kAnySource ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV;
  work = c10::make_intrusive<P2PWork>(rank, type, what, user);
}

// ---- PointToPoint ---------------------------------------------------------------------------

struct PointToPoint::Op : MessageOp {
  at::Tensor words;       // a send's header, a receive's header as read
  at::Tensor verdict;     // what the receiver answered, or answers
  // Under PointToPoint::mu_:
  std::vector<c10::intrusive_ptr<c10d::Work>> gloo;  // what Abort() interrupts
  std::string step = "queued";
  uint64_t seq = 0;         // receives: the posting order
  int source = kAnySource;  // receives: where the header came from
  bool header_read = false;
  bool data_posted = false;
};

PointToPoint::PointToPoint(c10::intrusive_ptr<c10d::Backend> link, int rank, int size,
                           std::chrono::milliseconds timeout)
    : link_(std::move(link)), rank_(rank), size_(size), timeout_(timeout) {}

PointToPoint::~PointToPoint() {
  Abort("the process group was shut down");
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  cv_.notify_all();
  for (std::thread& t : threads) t.join();
}

c10::intrusive_ptr<c10d::Work> PointToPoint::Send(const at::Tensor& tensor, int dst, int tag) {
  message_words::CheckArguments("send", tensor, dst, tag, rank_, size_, false);
  auto op = std::make_shared<Op>();
  op->Begin(true, dst, tag, tensor, rank_);
  op->words = Words();
  Describe(op->words, op->data, tag);
  op->verdict = Words();
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(aborted_.empty(), "hvdlite backend: ", op->what, ": ", aborted_);
    std::vector<at::Tensor> header{op->words}, verdict{op->verdict};
    op->gloo.push_back(link_->send(header, dst, SlotOf(tag, kHeader)));
    if (op->data.numel() > 0) {
      std::vector<at::Tensor> data{Bytes(op->data)};
      op->gloo.push_back(link_->send(data, dst, SlotOf(tag, kData)));
    }
    op->gloo.push_back(link_->recv(verdict, dst, SlotOf(tag, kVerdict)));
  }
  Start(op);
  return op->work;
}

c10::intrusive_ptr<c10d::Work> PointToPoint::Recv(const at::Tensor& tensor, int src, int tag) {
  message_words::CheckArguments("recv", tensor, src, tag, rank_, size_, false);
  auto op = std::make_shared<Op>();
  op->Begin(false, src, tag, tensor, rank_);
  op->words = Words();
  op->verdict = Words();
  {
    // Posted under mu_, so the posting order (seq) is the order Gloo matches headers in.
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(aborted_.empty(), "hvdlite backend: ", op->what, ": ", aborted_);
    std::vector<at::Tensor> header{op->words};
    op->gloo.push_back(src == kAnySource ? link_->recvAnysource(header, SlotOf(tag, kHeader))
                                         : link_->recv(header, src, SlotOf(tag, kHeader)));
    op->seq = posted_++;
  }
  Start(op);
  return op->work;
}

void PointToPoint::Start(std::shared_ptr<Op> op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_.push_back(op);
    queue_.push_back(std::move(op));
    // A thread per operation in flight: a receive waits for its peer, and must not hold up
    // another (Note [Point-to-point messages]).
    if (idle_ < queue_.size() && !stopping_) threads_.emplace_back([this] { WorkLoop(); });
  }
  cv_.notify_all();
}

void PointToPoint::WorkLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    --idle_;
    if (queue_.empty()) return;  // stopping
    std::shared_ptr<Op> op = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    try {
      Run(*op);
    } catch (const std::exception& e) {
      error = DistError("hvdlite backend: " + op->what + ": " + e.what());
    }
    Finish(op, error);
    lock.lock();
  }
}

void PointToPoint::Run(Op& op) {
  if (op.send) {
    RunSend(op);
  } else {
    RunRecv(op);
  }
}

void PointToPoint::Await(Op& op, const c10::intrusive_ptr<c10d::Work>& work, const std::string& step,
                         std::chrono::milliseconds timeout) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.empty()) throw std::runtime_error(aborted_);
    op.step = step;
  }
  bool done = false;
  try {
    done = work->wait(timeout);
  } catch (const std::exception& e) {
    const std::string message = e.what();
    const bool timed_out = message.find("Timed out") != std::string::npos;
    int none = 0;
    error_.compare_exchange_strong(none, static_cast<int>(timed_out ? c10d::ErrorType::TIMEOUT
                                                                    : c10d::ErrorType::COMM_ERROR));
    if (timed_out) {
      throw std::runtime_error(step + ": still waiting after " + Seconds(timeout) + " (the process group's timeout)");
    }
    throw std::runtime_error(step + ": " + message.substr(0, message.find('\n')));
  }
  if (!done) {
    int none = 0;
    error_.compare_exchange_strong(none, static_cast<int>(c10d::ErrorType::COMM_ERROR));
    std::lock_guard<std::mutex> lock(mu_);
    throw std::runtime_error(aborted_.empty() ? step + ": aborted" : aborted_);
  }
}

void PointToPoint::RunSend(Op& op) {
  const std::string peer = "rank " + std::to_string(op.peer);
  const size_t last = op.gloo.size() - 1;
  for (size_t i = 0; i < last; ++i) Await(op, op.gloo[i], "sending to " + peer, timeout_);
  Await(op, op.gloo[last], "waiting for " + peer + " to receive it", timeout_);
  if (op.verdict.data_ptr<int64_t>()[0] != kMagic) {
    throw std::runtime_error(peer + " answered with a malformed message");
  }
  if (op.verdict.data_ptr<int64_t>()[6] != 1) {
    throw std::runtime_error(peer + " receives into " + Shown(op.verdict) + ", but rank " + std::to_string(rank_) +
                             " sent " + Shown(op.words) + ": the dtype or the number of elements differs");
  }
}

void PointToPoint::WaitForEarlierReceives(Op& op, int source) {
  std::unique_lock<std::mutex> lock(mu_);
  op.source = source;
  op.header_read = true;
  cv_.wait(lock, [&] {
    if (!aborted_.empty()) return true;
    for (const std::shared_ptr<Op>& other : live_) {
      if (other->send || other->tag != op.tag || other->seq >= op.seq || other->data_posted) continue;
      const bool could_be_source = other->header_read ? other->source == source
                                                      : other->peer == source || other->peer == kAnySource;
      if (could_be_source) return false;
    }
    return true;
  });
  op.step = "receiving data";
}

void PointToPoint::RunRecv(Op& op) {
  Await(op, op.gloo[0],
        op.peer == kAnySource ? "waiting for a send from any rank" : "waiting for rank " + std::to_string(op.peer) +
                                                                          " to send",
        timeout_);
  const int source = op.peer == kAnySource ? op.gloo[0]->sourceRank() : op.peer;
  const std::string peer = "rank " + std::to_string(source);
  if (op.words.data_ptr<int64_t>()[0] != kMagic) {
    throw std::runtime_error(peer + " sent a malformed message");
  }
  at::Tensor mine = Words();
  Describe(mine, op.data, op.tag);
  const bool agree = Agree(op.words, mine);
  const int64_t bytes = op.words.data_ptr<int64_t>()[4];
  // Note [Point-to-point messages]: a mismatched message is read into scratch, never the caller's tensor.
  at::Tensor landing = agree ? Bytes(op.data) : at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
  WaitForEarlierReceives(op, source);
  c10::intrusive_ptr<c10d::Work> data;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes > 0 && aborted_.empty()) {
      std::vector<at::Tensor> into{landing};
      data = link_->recv(into, source, SlotOf(op.tag, kData));
      op.gloo.push_back(data);
    }
    op.data_posted = true;
  }
  cv_.notify_all();
  if (data) Await(op, data, "receiving " + std::to_string(bytes) + " bytes from " + peer, timeout_);
  Describe(op.verdict, op.data, op.tag);
  op.verdict.data_ptr<int64_t>()[6] = agree ? 1 : 0;
  c10::intrusive_ptr<c10d::Work> answer;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.empty()) throw std::runtime_error(aborted_);
    std::vector<at::Tensor> verdict{op.verdict};
    answer = link_->send(verdict, source, SlotOf(op.tag, kVerdict));
    op.gloo.push_back(answer);
  }
  Await(op, answer, "answering " + peer, timeout_);
  op.work->source_.store(source);
  if (!agree) {
    throw std::runtime_error(peer + " sent " + Shown(op.words) + ", but rank " + std::to_string(rank_) +
                             " receives into " + Shown(mine) + ": the dtype or the number of elements differs");
  }
  if (!op.data.is_same(op.user)) op.user.copy_(op.data);
}

void PointToPoint::Finish(const std::shared_ptr<Op>& op, std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    op->data_posted = true;  // a receive that failed before posting holds up no later one
    live_.erase(std::remove(live_.begin(), live_.end(), op), live_.end());
  }
  cv_.notify_all();
  if (error) {
    op->work->future_->setError(error);
  } else {
    op->work->future_->markCompleted(c10::IValue(std::vector<at::Tensor>{op->user}));
  }
}

void PointToPoint::Abort(const std::string& why) {
  std::vector<c10::intrusive_ptr<c10d::Work>> gloo;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.empty()) aborted_ = why.empty() ? "aborted" : why;
    for (const std::shared_ptr<Op>& op : live_) gloo.insert(gloo.end(), op->gloo.begin(), op->gloo.end());
  }
  cv_.notify_all();
  for (const auto& work : gloo) {
    try {
      work->abort();
    } catch (const std::exception&) {
      // a work that already ended has nothing to abort
    }
  }
}

std::vector<std::string> PointToPoint::Pending() const {
  std::vector<std::string> lines;
  std::lock_guard<std::mutex> lock(mu_);
  const Clock::time_point now = Clock::now();
  for (const std::shared_ptr<Op>& op : live_) {
    const double seconds = std::chrono::duration<double>(now - op->started).count();
    lines.push_back(message_words::PendingLine(op->what, op->step, seconds));
  }
  return lines;
}

}  // namespace hvdlite
