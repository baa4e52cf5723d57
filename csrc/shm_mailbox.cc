#include "shm_mailbox.h"

#include "futex.h"
#include "shm_segment.h"

#include <sched.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace hvdlite {

using Clock = std::chrono::steady_clock;

MailBell& Mailboxes::Bell(int rank) const {
  return *reinterpret_cast<MailBell*>(area_ + 64 * static_cast<size_t>(rank));
}

MailPair& Mailboxes::Pair(int source, int destination) const {
  const size_t pair_bytes = 64 + kSlots * kSlotBytes;
  char* pairs = area_ + 64 * static_cast<size_t>(size_ + 1);  // after the bells and the probe line
  return *reinterpret_cast<MailPair*>(pairs + (static_cast<size_t>(source) * size_ + destination) * pair_bytes);
}

Mail& Mailboxes::Slot(int source, int destination, int i) const {
  char* pair = reinterpret_cast<char*>(&Pair(source, destination));
  return *reinterpret_cast<Mail*>(pair + 64 + i * kSlotBytes);
}

void Mailboxes::Ring(int rank) const {
  MailBell& bell = Bell(rank);
  bell.ring.fetch_add(1);
  if (bell.sleepers.load() > 0) FutexWakeAll(&bell.ring);
}

std::string Mailboxes::CopyWith(int64_t pid, bool read, char* local, uint64_t remote, int64_t offset, int64_t bytes) {
  int64_t done = 0;
  while (done < bytes) {
    iovec mine{local + offset + done, static_cast<size_t>(bytes - done)};
    iovec theirs{reinterpret_cast<void*>(remote + offset + done), static_cast<size_t>(bytes - done)};
    const ssize_t moved = read ? process_vm_readv(static_cast<pid_t>(pid), &mine, 1, &theirs, 1, 0)
                               : process_vm_writev(static_cast<pid_t>(pid), &mine, 1, &theirs, 1, 0);
    if (moved < 0) return std::strerror(errno);
    if (moved == 0) return "no bytes moved";
    done += moved;
  }
  return "";
}

std::string Mailboxes::ReceiverCopy(Mail& mail, int source, int64_t pid, char* into, int64_t bytes,
                                    std::chrono::milliseconds timeout) const {
  mail.into = reinterpret_cast<uint64_t>(into);
  mail.claimed.store(0);
  mail.copied.store(0);
  mail.failed.store(0);
  mail.state.store(Mail::kCopying, std::memory_order_release);
  Ring(source);
  std::string error;
  for (;;) {
    const int64_t offset = static_cast<int64_t>(mail.claimed.fetch_add(kChunk));
    if (offset >= bytes) break;
    const int64_t length = std::min(kChunk, bytes - offset);
    if (error.empty()) error = CopyWith(pid, true, into, mail.address, offset, length);
    mail.copied.fetch_add(static_cast<uint64_t>(length));
  }
  // the sender may still be copying its last chunk
  const std::string peer = "rank " + std::to_string(source);
  unsigned spins = 0;
  const Clock::time_point start = Clock::now();
  while (static_cast<int64_t>(mail.copied.load(std::memory_order_acquire)) < bytes) {
    Relax();
    if ((++spins & 4095) != 0) continue;
    if (spins > (1u << 20)) sched_yield();  // a sender this slow is stopped or starved
    if (!ShmSegment::Running(pid)) return peer + " exited while its message was being copied";
    if (timeout.count() > 0 && Clock::now() - start > timeout) {
      return peer + " did not finish copying its message within the process group's timeout " + ShmSegment::Why(pid);
    }
  }
  if (!error.empty()) return "reading " + std::to_string(bytes) + " bytes from " + peer + " failed: " + error;
  if (mail.failed.load() != 0) return peer + " could not write its message into this process";
  return "";
}

bool Mailboxes::SenderCopy(Mail& mail, int64_t pid, const char* from, int64_t bytes) {
  if (mail.state.load(std::memory_order_acquire) != Mail::kCopying) return false;
  bool did = false;
  for (;;) {
    const int64_t offset = static_cast<int64_t>(mail.claimed.fetch_add(kChunk));
    if (offset >= bytes) break;
    const int64_t length = std::min(kChunk, bytes - offset);
    if (!CopyWith(pid, false, const_cast<char*>(from), mail.into, offset, length).empty()) mail.failed.store(1);
    mail.copied.fetch_add(static_cast<uint64_t>(length), std::memory_order_release);
    did = true;
  }
  return did;
}

double Mailboxes::PingPongFloor(int rank, int rounds) const {
  auto* words = reinterpret_cast<std::atomic<uint64_t>*>(area_ + 64 * static_cast<size_t>(size_));
  std::atomic<uint64_t>& ping = words[0];
  std::atomic<uint64_t>& pong = words[1];
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(30);
  auto await = [&](std::atomic<uint64_t>& word, uint64_t value) {
    unsigned spins = 0;
    while (word.load(std::memory_order_acquire) != value) {
      Relax();
      if ((++spins & 1023) == 0 && Clock::now() > deadline) {
        throw std::runtime_error("ping_pong_floor: the other rank did not answer within 30 s");
      }
    }
  };
  const uint64_t base = rank == 0 ? ping.load() : pong.load();
  const Clock::time_point start = Clock::now();
  for (int i = 1; i <= rounds; ++i) {
    if (rank == 0) {
      ping.store(base + i, std::memory_order_release);
      await(pong, base + i);
    } else {
      await(ping, base + i);
      pong.store(base + i, std::memory_order_release);
    }
  }
  return std::chrono::duration<double>(Clock::now() - start).count() / rounds / 2;
}

}  // namespace hvdlite
