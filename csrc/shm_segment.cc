#include "shm_segment.h"

#include "futex.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
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
#include <iterator>
#include <stdexcept>
#include <thread>

namespace hvdlite {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kSpin = std::chrono::microseconds(20);  // busy, before yielding
constexpr auto kYield = std::chrono::microseconds(500);  // yielding, before sleeping on the futex
constexpr int kCheckMs = 10;                           // a sleeper checks its peers this often

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// The state letter of `pid` in /proc (R, S, D, T for stopped, t for traced, Z...), or 0.
char ProcessState(int64_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  return paren == std::string::npos || paren + 2 >= text.size() ? 0 : text[paren + 2];
}

// False once `pid` has exited (a zombie has exited too); true when unsure.
bool Alive(int64_t pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  return ProcessState(pid) != 'Z';
}

}  // namespace

size_t ShmSegment::HeaderBytes(int size) {
  const size_t bytes = kArrivalsAt + 64 * static_cast<size_t>(size);
  return (bytes + 4095) / 4096 * 4096;
}

int64_t ShmSegment::ChunkBytes(int size) {
  // Two banks of (size + 1) areas within ~32 MB, in multiples of 64 KB (so every dtype's
  // elements divide it), between 256 KB and 4 MB.
  int64_t chunk = (32LL << 20) / (2 * (size + 1));
  chunk = chunk / (64 << 10) * (64 << 10);
  return std::clamp<int64_t>(chunk, 256LL << 10, 4LL << 20);
}

size_t ShmSegment::Bytes(int size, int64_t chunk_bytes) {
  const int64_t chunk = chunk_bytes > 0 ? chunk_bytes : ChunkBytes(size);
  return HeaderBytes(size) + ControlBytes(size) + 2 * static_cast<size_t>(size + 1) * static_cast<size_t>(chunk) +
         MailboxBytes(size);
}

size_t ShmSegment::MailboxBytes(int size) {
  // Note [Point-to-point through shared memory]: a line per rank and one for the floor probe,
  // then a mailbox of 16 KB per ordered pair (its line and 16 slots of 1 KB).
  if (size > kMailboxMaxRanks) return 0;
  const size_t bytes = 64 * static_cast<size_t>(size + 1) + static_cast<size_t>(size) * size * (64 + 16 * 1024);
  return (bytes + 4095) / 4096 * 4096;
}

char* ShmSegment::Mailbox() const {
  if (MailboxBytes(size_) == 0) return nullptr;
  return static_cast<char*>(base_) + bytes_ - MailboxBytes(size_);
}

bool ShmSegment::Running(int64_t pid) { return Alive(pid); }

std::string ShmSegment::Why(int64_t pid) {
  const char state = ProcessState(pid);
  return state == 'T' || state == 't'
             ? "(its process " + std::to_string(pid) + " is stopped: SIGSTOP, a debugger or a suspended job)"
             : "(hung: its process " + std::to_string(pid) + " is alive)";
}

std::string ShmSegment::Create(const std::string& name, int size, int64_t chunk_bytes) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return Errno("shm_open(" + name + ")");
  const off_t bytes = static_cast<off_t>(Bytes(size, chunk_bytes));
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

void ShmSegment::Unlink(const std::string& name) { shm_unlink(name.c_str()); }

ShmSegment::ShmSegment(const std::string& name, int rank, int size, std::vector<int64_t> ranks,
                       std::vector<int64_t> pids, double timeout_seconds, int64_t chunk_bytes)
    : name_(name),
      rank_(rank),
      size_(size),
      ranks_(std::move(ranks)),
      pids_(std::move(pids)),
      timeout_seconds_(timeout_seconds),
      bytes_(Bytes(size, chunk_bytes)),
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
}

ShmSegment::~ShmSegment() {
  if (base_ == nullptr) return;
  Abort();  // anyone still waiting on this rank fails now
  munmap(base_, bytes_);
}

std::atomic<uint64_t>& ShmSegment::Arrived(int rank) const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(base_) + kArrivalsAt + 64 * rank);
}

std::atomic<uint32_t>& ShmSegment::Inside(int rank) const {
  return *reinterpret_cast<std::atomic<uint32_t>*>(static_cast<char*>(base_) + kArrivalsAt + 64 * rank + 8);
}

std::atomic<uint64_t>& ShmSegment::Claims() const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(base_) + kClaimsAt);
}

char* ShmSegment::ControlSlot(int bank, int rank) const {
  return static_cast<char*>(base_) + HeaderBytes(size_) + (static_cast<size_t>(bank) * size_ + rank) * kControlSlot;
}

char* ShmSegment::Slot(int bank, int rank) const {
  return static_cast<char*>(base_) + HeaderBytes(size_) + ControlBytes(size_) +
         (static_cast<size_t>(bank) * (size_ + 1) + rank) * chunk_;
}

void ShmSegment::AwaitPeersOut() const {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (int r = 0; r < size_; ++r) {
    while (r != rank_ && Inside(r).load() != 0 && Alive(pids_[r]) && Clock::now() < deadline) {
      const char state = ProcessState(pids_[r]);
      if (state == 'T' || state == 't') break;  // stopped: it cannot be waited for
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

void ShmSegment::Abort() {
  int32_t none = 0;
  header_->abort.compare_exchange_strong(none, rank_ + 1);
  header_->futex.fetch_add(1);
  FutexWakeAll(&header_->futex);
}

void ShmSegment::ThrowIfAborted() const {
  if (const int32_t aborted = header_->abort.load(); aborted != 0) {
    throw std::runtime_error("rank " + std::to_string(ranks_[aborted - 1]) +
                             " stopped taking part in the shared-memory channel");
  }
}

void ShmSegment::Barrier() {
  const uint64_t target = ++barriers_;
  Arrived(rank_).store(target);
  header_->futex.fetch_add(1);
  if (header_->sleepers.load() > 0) FutexWakeAll(&header_->futex);
  Wait(target);
}

void ShmSegment::Wait(uint64_t target) {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_seconds_));
  auto last_check = start;
  bool yielded = false, slept = false;
  for (int r = 0; r < size_; ++r) {
    std::atomic<uint64_t>& arrived = Arrived(r);
    unsigned spins = 0;
    while (arrived.load() < target) {
      ThrowIfAborted();
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
        const std::string why = " " + Why(pids_[r]);
        throw std::runtime_error("rank " + std::to_string(ranks_[r]) + " did not reach the shared-memory channel within " +
                                 std::to_string(static_cast<int64_t>(timeout_seconds_)) + " s" + why);
      }
    }
  }
}

}  // namespace hvdlite
