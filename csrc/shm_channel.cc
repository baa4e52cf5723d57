#include "shm_channel.h"

#include <ATen/Functions.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include "kernels.h"

namespace hvdlite {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kSpin = std::chrono::microseconds(20);  // busy, before yielding
constexpr auto kYield = std::chrono::microseconds(500);  // yielding, before sleeping on the futex
constexpr int kCheckMs = 10;                           // a sleeper checks its peers this often

// Note [Casting on the wire] (executor.h): a piece whose memory is of another dtype than the batch.
bool Casts(const ShmChannel::Piece& piece, c10::ScalarType dtype) {
  return piece.own != c10::ScalarType::Undefined && piece.own != dtype;
}

// The bytes a piece's memory spans (`bytes` counts the batch's elements of `element` bytes).
uintptr_t OwnBytes(const ShmChannel::Piece& piece, size_t element) {
  if (piece.own == c10::ScalarType::Undefined) return static_cast<uintptr_t>(piece.bytes);
  return static_cast<uintptr_t>(piece.bytes / static_cast<int64_t>(element)) * c10::elementSize(piece.own);
}

inline void Relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// False once `pid` has exited (a zombie has exited too); true when unsure.
// The state letter of `pid` in /proc (R, S, D, T for stopped, t for traced, Z...), or 0.
char ProcessState(int64_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  return paren == std::string::npos || paren + 2 >= text.size() ? 0 : text[paren + 2];
}

bool Alive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  return paren == std::string::npos || paren + 2 >= text.size() || text[paren + 2] != 'Z';
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t seen, int timeout_ms) {
  timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

size_t ShmChannel::HeaderBytes(int size) {
  const size_t bytes = kArrivalsAt + 64 * static_cast<size_t>(size);
  return (bytes + 4095) / 4096 * 4096;
}

int64_t ShmChannel::ChunkBytes(int size) {
  // Two banks of (size + 1) areas within ~32 MB, in multiples of 64 KB (so every dtype's
  // elements divide it), between 256 KB and 4 MB.
  int64_t chunk = (32LL << 20) / (2 * (size + 1));
  chunk = chunk / (64 << 10) * (64 << 10);
  return std::clamp<int64_t>(chunk, 256LL << 10, 4LL << 20);
}

size_t ShmChannel::SegmentBytes(int size, int64_t chunk_bytes) {
  const int64_t chunk = chunk_bytes > 0 ? chunk_bytes : ChunkBytes(size);
  return HeaderBytes(size) + ControlBytes(size) + 2 * static_cast<size_t>(size + 1) * static_cast<size_t>(chunk);
}

std::string ShmChannel::Create(const std::string& name, int size, int64_t chunk_bytes) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return Errno("shm_open(" + name + ")");
  const off_t bytes = static_cast<off_t>(SegmentBytes(size, chunk_bytes));
  std::string error;
  if (ftruncate(fd, bytes) != 0) {
    error = Errno("ftruncate");
  } else if (const int rc = posix_fallocate(fd, 0, bytes); rc != 0) {
    errno = rc;
    error = Errno("reserving " + std::to_string(bytes) + " bytes of shared memory");
  }
  close(fd);
  if (!error.empty()) shm_unlink(name.c_str());
  return error;
}

void ShmChannel::Unlink(const std::string& name) { shm_unlink(name.c_str()); }

ShmChannel::ShmChannel(const std::string& name, int rank, int size, std::vector<int64_t> ranks,
                       std::vector<int64_t> pids, double timeout_seconds, int64_t chunk_bytes)
    : name_(name),
      rank_(rank),
      size_(size),
      ranks_(std::move(ranks)),
      pids_(std::move(pids)),
      timeout_seconds_(timeout_seconds),
      bytes_(SegmentBytes(size, chunk_bytes)),
      chunk_(chunk_bytes > 0 ? chunk_bytes : ChunkBytes(size)) {
  if (static_cast<int>(pids_.size()) != size || static_cast<int>(ranks_.size()) != size) {
    throw std::runtime_error("shared memory: one rank and one pid per member expected");
  }
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(Errno("shm_open(" + name + ")"));
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes_) {
    close(fd);
    throw std::runtime_error("shared memory segment " + name + " has the wrong size");
  }
  base_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    throw std::runtime_error(Errno("mmap of shared memory segment " + name));
  }
  header_ = static_cast<Header*>(base_);
  // Test hook (tests/multirank/test_shared_memory.py): this rank pauses inside every allreduce
  // before its first barrier, so a test can kill it while the others wait in the channel.
  if (const char* delay = std::getenv("HVDLITE_TEST_SHM_DELAY_MS")) test_delay_ms_ = std::atoll(delay);
  // Test hook (tests/multirank/test_single_copy.py): this rank pauses after every block it
  // reduces in a single-copy allreduce, so its peers claim the rest.
  if (const char* delay = std::getenv("HVDLITE_TEST_SHM_CLAIM_DELAY_US")) test_claim_delay_us_ = std::atoll(delay);
}

ShmChannel::~ShmChannel() {
  if (base_ == nullptr) return;
  Abort();  // anyone still waiting on this rank fails now (Note [Control exchange through shared memory])
  munmap(base_, bytes_);
}

std::atomic<uint64_t>& ShmChannel::Arrived(int rank) const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(base_) + kArrivalsAt + 64 * rank);
}

std::atomic<uint32_t>& ShmChannel::Inside(int rank) const {
  return *reinterpret_cast<std::atomic<uint32_t>*>(static_cast<char*>(base_) + kArrivalsAt + 64 * rank + 8);
}

std::atomic<uint64_t>& ShmChannel::Claims() const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(base_) + kClaimsAt);
}

void ShmChannel::AwaitPeersOut() {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (int r = 0; r < size_; ++r) {
    while (r != rank_ && Inside(r).load() != 0 && Alive(pids_[r]) && Clock::now() < deadline) {
      const char state = ProcessState(pids_[r]);
      if (state == 'T' || state == 't') break;  // stopped: it cannot be waited for
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

char* ShmChannel::Slot(int bank, int rank) const {
  return static_cast<char*>(base_) + HeaderBytes(size_) + ControlBytes(size_) +
         (static_cast<size_t>(bank) * (size_ + 1) + rank) * chunk_;
}

char* ShmChannel::ControlSlot(int bank, int rank) const {
  return static_cast<char*>(base_) + HeaderBytes(size_) + (static_cast<size_t>(bank) * size_ + rank) * kControlSlot;
}

bool ShmChannel::Exchange(const std::string& mine, std::vector<std::string>* out, std::vector<int64_t>* lengths) {
  constexpr int64_t kHeader = 8;
  const int bank = control_bank_;
  control_bank_ ^= 1;
  const int64_t length = static_cast<int64_t>(mine.size());
  char* slot = ControlSlot(bank, rank_);
  std::memcpy(slot, &length, kHeader);
  if (length <= kControlSlot - kHeader) std::memcpy(slot + kHeader, mine.data(), mine.size());
  try {
    Barrier();
  } catch (...) {
    Abort();
    throw;
  }
  lengths->assign(size_, 0);
  int64_t longest = 0;
  for (int r = 0; r < size_; ++r) {
    std::memcpy(&(*lengths)[r], ControlSlot(bank, r), kHeader);
    (*lengths)[r] = std::max<int64_t>((*lengths)[r], 0);
    longest = std::max(longest, (*lengths)[r]);
  }
  if (longest > kControlSlot - kHeader) return false;
  out->assign(size_, std::string());
  for (int r = 0; r < size_; ++r) (*out)[r].assign(ControlSlot(bank, r) + kHeader, (*lengths)[r]);
  return true;
}

char* ShmChannel::Result(int bank) const { return Slot(bank, size_); }

void ShmChannel::Abort() {
  int32_t none = 0;
  header_->abort.compare_exchange_strong(none, rank_ + 1);
  header_->futex.fetch_add(1);
  FutexWakeAll(&header_->futex);
}

void ShmChannel::Barrier() {
  const uint64_t target = ++barriers_;
  Arrived(rank_).store(target);
  header_->futex.fetch_add(1);
  if (header_->sleepers.load() > 0) FutexWakeAll(&header_->futex);
  Wait(target);
}

void ShmChannel::Wait(uint64_t target) {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds_));
  auto last_check = start;
  bool yielded = false, slept = false;
  for (int r = 0; r < size_; ++r) {
    std::atomic<uint64_t>& arrived = Arrived(r);
    unsigned spins = 0;
    while (arrived.load() < target) {
      if (const int32_t aborted = header_->abort.load(); aborted != 0) {
        throw std::runtime_error("rank " + std::to_string(ranks_[aborted - 1]) +
                                 " stopped taking part in the shared-memory channel");
      }
      if ((++spins & 63) != 0) {
        Relax();
        continue;
      }
      if (const auto waited = Clock::now() - start; waited < kSpin) {
        continue;
      } else if (waited < kYield && (callers_waiting_ == nullptr || callers_waiting_->load() > 0)) {
        sched_yield();  // Note [Yield only while a caller waits]
        if (!yielded) ++waits_yielded_;
        yielded = true;
        continue;
      }
      if (!slept) ++waits_slept_;
      slept = true;
      header_->sleepers.fetch_add(1);
      const uint32_t seen = header_->futex.load();
      if (arrived.load() < target && header_->abort.load() == 0) FutexWait(&header_->futex, seen, kCheckMs);
      header_->sleepers.fetch_sub(1);
      const auto now = Clock::now();
      if (now - last_check < std::chrono::milliseconds(kCheckMs) || arrived.load() >= target) continue;
      last_check = now;
      if (!Alive(pids_[r])) {
        throw std::runtime_error("rank " + std::to_string(ranks_[r]) + " (pid " + std::to_string(pids_[r]) +
                                 ") exited (seen in the shared-memory channel)");
      }
      if (now > deadline) {
        const char state = ProcessState(pids_[r]);
        const std::string why = state == 'T' || state == 't'
                                    ? " (its process " + std::to_string(pids_[r]) +
                                          " is stopped: SIGSTOP, a debugger or a suspended job)"
                                    : " (hung: its process " + std::to_string(pids_[r]) + " is alive)";
        throw std::runtime_error("rank " + std::to_string(ranks_[r]) + " did not reach the shared-memory channel within " +
                                 std::to_string(static_cast<int64_t>(timeout_seconds_)) + " s" + why);
      }
    }
  }
}

void ShmChannel::Allreduce(at::Tensor& flat, ReduceOp op, const StartAcross& across,
                           const std::function<void(at::Tensor&)>& finish) {
  const int64_t element = static_cast<int64_t>(flat.element_size());
  auto* data = static_cast<char*>(flat.data_ptr());
  if (!across && SingleCopy(flat.numel() * element)) {  // Note [Single-copy allreduce]
    const Span whole{reinterpret_cast<uint64_t>(data), static_cast<uint64_t>(flat.numel() * element)};
    RunSingleCopy({whole}, {whole}, flat.numel(), flat.scalar_type(), op, finish);
    return;
  }
  Run(
      flat.numel(), flat.scalar_type(), op,
      [&](char* slot, int64_t offset, int64_t n) { std::memcpy(slot, data + offset * element, n * element); },
      [&](char* result, int64_t offset, int64_t n) { std::memcpy(data + offset * element, result, n * element); },
      [&](int64_t offset, int64_t n, std::vector<Segment>* own) {
        own->assign(1, Segment{data + offset * element, n});
        return true;
      },
      nullptr, finish, across);
}

bool ShmChannel::PiecesOverlap(const std::vector<Piece>& pieces, c10::ScalarType dtype) {
  // Every distinct byte range a batch reads or writes, sorted: neighbours must not overlap.
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  ranges.reserve(2 * pieces.size());
  const size_t element = c10::elementSize(dtype);
  for (const Piece& piece : pieces) {
    const auto in = reinterpret_cast<uintptr_t>(piece.in), out = reinterpret_cast<uintptr_t>(piece.out);
    const uintptr_t bytes = OwnBytes(piece, element);
    ranges.emplace_back(in, in + bytes);
    if (out != in) ranges.emplace_back(out, out + bytes);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) return true;
  }
  return false;
}

void ShmChannel::AllreducePieces(const std::vector<Piece>& pieces, c10::ScalarType dtype, ReduceOp op,
                                 const Hook& prescale, const Hook& finish, const StartAcross& across) {
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  int64_t total_bytes = 0;
  bool casts = false;
  for (const Piece& piece : pieces) {
    total_bytes += piece.bytes;
    casts = casts || Casts(piece, dtype);
  }
  if (!across && SingleCopy(total_bytes)) {  // Note [Single-copy allreduce]
    // The route sends a batch that casts through a fusion buffer here (CpuRoute::FusesInPlace).
    if (casts) throw std::logic_error("a batch that casts reached the single-copy path");
    SingleCopyPieces(pieces, dtype, op, prescale, finish);
    return;
  }
  // Note [Casting on the wire]: where a piece's memory is `own`'s, its offset `at` (counted in
  // the batch's bytes) lies at the same element there.
  auto own_at = [&](const Piece& piece, int64_t at) {
    return Casts(piece, dtype) ? at / element * static_cast<int64_t>(c10::elementSize(piece.own)) : at;
  };
  auto own = [&](const Piece& piece) { return Casts(piece, dtype) ? piece.own : dtype; };
  // Offsets only grow, so one cursor per use walks the pieces once.
  struct Cursor {
    size_t piece = 0;
    int64_t within = 0;  // bytes of `piece` already passed
    int64_t at = 0;      // bytes of the batch already passed
  } in_cursor, out_cursor, direct_cursor;
  using Step = std::function<void(const Piece&, int64_t, int64_t)>;
  // Passes the batch's bytes [cursor.at, to), handing each piece's part of them to `step`.
  auto walk = [&](Cursor& cursor, int64_t to, const Step& step) {
    while (cursor.at < to || (cursor.piece < pieces.size() && pieces[cursor.piece].bytes == 0)) {
      const Piece& piece = pieces[cursor.piece];
      const int64_t n = std::min(piece.bytes - cursor.within, to - cursor.at);
      if (step && n > 0) step(piece, cursor.within, n);
      cursor.at += n;
      cursor.within += n;
      if (cursor.within == piece.bytes) {
        ++cursor.piece;
        cursor.within = 0;
      }
    }
  };
  Run(
      total_bytes / element, dtype, op,
      [&](char* to, int64_t offset, int64_t n) {
        walk(in_cursor, offset * element, nullptr);
        walk(in_cursor, (offset + n) * element, [&](const Piece& piece, int64_t at, int64_t bytes) {
          CopyElements(piece.in + own_at(piece, at), own(piece), to, dtype, bytes / element);
          to += bytes;
        });
      },
      [&](char* result, int64_t offset, int64_t n) {
        const char* from = result;
        walk(out_cursor, offset * element, nullptr);
        walk(out_cursor, (offset + n) * element, [&](const Piece& piece, int64_t at, int64_t bytes) {
          CopyElements(from, dtype, piece.out + own_at(piece, at), own(piece), bytes / element);
          from += bytes;
        });
      },
      [&](int64_t offset, int64_t n, std::vector<Segment>* own) {  // Note [Own share straight from the input]
        own->clear();
        bool casts = false;
        walk(direct_cursor, offset * element, nullptr);
        walk(direct_cursor, (offset + n) * element, [&](const Piece& piece, int64_t at, int64_t bytes) {
          casts = casts || Casts(piece, dtype);
          own->push_back(Segment{piece.in + at, bytes / element});
        });
        return !casts && static_cast<int64_t>(own->size()) <= 1 + n * element / kStraightSegmentBytes;
      },
      prescale, finish, across);
}

void ShmChannel::Run(int64_t total, c10::ScalarType dtype, ReduceOp op, const Copy& fill, const Copy& drain,
                     const Direct& direct, const Hook& prepare, const Hook& finish, const StartAcross& across) {
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  const auto options = at::TensorOptions().dtype(dtype);
  // Note [Every path sends the same chunks] (pipeline.h): Allreduce, AllreducePieces and the
  // hierarchical route's lone ranks cut with the same function and chunk size.
  const std::vector<Chunk> cut = CutChunks(total, chunk_ / element);
  const int64_t count = static_cast<int64_t>(cut.size());
  const int first_bank = bank_;  // chunk k takes bank first_bank ^ (k & 1)
  auto bank_of = [first_bank](int64_t k) { return first_bank ^ static_cast<int>(k & 1); };
  // Note [Hierarchical allreduce] (cpu_route.h): chunk k's host sum travels across hosts while
  // chunk k + 1 is reduced here (two lanes). Rank 0 of the channel starts it; the others have
  // nothing to wait for. Without `across` the window stays empty.
  WorkWindow travelling(across ? count : 0, 2, !across ? WorkWindow::Start() : [&](int64_t k) {
    if (rank_ != 0) return PendingWork();
    at::Tensor reduced = at::from_blob(Result(bank_of(k)), {cut[k].n}, options);
    return across(reduced);
  });
  auto arrive = [&](int64_t k) {  // the job's sum is in: scale once, then everyone copies out
    travelling.Reap(k);
    travelling.ThrowIfFailed();
    if (rank_ == 0 && finish) {
      at::Tensor reduced = at::from_blob(Result(bank_of(k)), {cut[k].n}, options);
      finish(reduced);
    }
    Barrier();
    drain(Result(bank_of(k)), cut[k].begin, cut[k].n);
  };
  std::vector<Segment> own;
  try {
    if (test_delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(test_delay_ms_));
    for (int64_t k = 0; k < count; ++k) {
      const int64_t offset = cut[k].begin, n = cut[k].n;
      const int bank = bank_of(k);
      bank_ ^= 1;
      const int64_t share = (n + size_ - 1) / size_;
      const int64_t begin = std::min(n, rank_ * share), end = std::min(n, begin + share);
      // Note [Own share straight from the input]: where my share lies in my input (its
      // segments), or else one segment: my slot's share.
      const bool straight = end > begin && direct && !prepare && direct(offset + begin, end - begin, &own);
      char* slot = Slot(bank, rank_);
      if (!straight) {
        fill(slot, offset, n);
        own.assign(1, Segment{slot + begin * element, end - begin});
      } else {
        straight_shares_.fetch_add(1, std::memory_order_relaxed);
        if (begin > 0) fill(slot, offset, begin);
        if (n > end) fill(slot + end * element, offset + end, n - end);
      }
      if (prepare) {
        at::Tensor mine = at::from_blob(slot, {n}, options);
        prepare(mine);
      }
      Barrier();
      if (end > begin) {
        int64_t first = begin;  // the segment's first element in the chunk
        for (const Segment& segment : own) {
          auto view = [&](const char* area) {
            return at::from_blob(const_cast<char*>(area) + first * element, {segment.n}, options);
          };
          auto source = [&](int r) {  // rank r's contribution to this segment
            return r == rank_ ? at::from_blob(const_cast<char*>(segment.data), {segment.n}, options)
                              : view(Slot(bank, r));
          };
          at::Tensor result = view(Result(bank));
          Combine(result, source(0), source(1), op);
          for (int r = 2; r < size_; ++r) Combine(result, result, source(r), op);
          first += segment.n;
        }
        at::Tensor result = at::from_blob(Result(bank) + begin * element, {end - begin}, options);
        if (finish && !across) finish(result);
      }
      Barrier();
      if (!across) {
        drain(Result(bank), offset, n);
        continue;
      }
      travelling.Ready(k + 1);  // this chunk starts across hosts
      travelling.ThrowIfFailed();
      if (k > 0) arrive(k - 1);  // the chunk before, while this one travels
    }
    if (across && count > 0) arrive(count - 1);
  } catch (...) {
    // A cross-host allreduce still travelling writes into this segment: it ends first, and the
    // first failure is the one thrown.
    travelling.Fail(std::current_exception());
    travelling.Drain();
    Abort();
    travelling.ThrowIfFailed();
  }
}

void ShmChannel::Move(int64_t bytes, const std::function<void(char** slots, int64_t offset, int64_t n)>& fill,
                      const std::function<void(char** slots, int64_t offset, int64_t n)>& drain) {
  std::vector<char*> slots(size_);
  try {
    if (test_delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(test_delay_ms_));
    for (const Chunk& chunk : CutChunks(bytes, chunk_)) {
      const int64_t offset = chunk.begin, n = chunk.n;
      const int bank = bank_;
      bank_ ^= 1;
      for (int r = 0; r < size_; ++r) slots[r] = Slot(bank, r);
      fill(slots.data(), offset, n);
      Barrier();
      drain(slots.data(), offset, n);
    }
  } catch (...) {
    Abort();
    throw;
  }
}

void ShmChannel::Allgather(const at::Tensor& input, std::vector<at::Tensor>& outputs) {
  const char* in = static_cast<const char*>(input.data_ptr());
  Move(
      input.numel() * static_cast<int64_t>(input.element_size()),
      [&](char** slots, int64_t offset, int64_t n) { std::memcpy(slots[rank_], in + offset, n); },
      [&](char** slots, int64_t offset, int64_t n) {
        for (int r = 0; r < size_; ++r) std::memcpy(static_cast<char*>(outputs[r].data_ptr()) + offset, slots[r], n);
      });
}

void ShmChannel::Broadcast(at::Tensor& tensor, int root) {
  const auto found = std::find(ranks_.begin(), ranks_.end(), static_cast<int64_t>(root));
  if (found == ranks_.end()) throw std::runtime_error("shared memory: broadcast from rank " + std::to_string(root) +
                                                      ", which is not in this channel");
  const int from = static_cast<int>(found - ranks_.begin());
  char* data = static_cast<char*>(tensor.data_ptr());
  Move(
      tensor.numel() * static_cast<int64_t>(tensor.element_size()),
      [&](char** slots, int64_t offset, int64_t n) {
        if (rank_ == from) std::memcpy(slots[from], data + offset, n);
      },
      [&](char** slots, int64_t offset, int64_t n) {
        if (rank_ != from) std::memcpy(data + offset, slots[from], n);
      });
}

}  // namespace hvdlite
