// Mailboxes: the point-to-point area of a shared-memory segment (ShmSegment::Mailbox) as
// ShmPointToPoint (shm_point_to_point.h) uses it, and how a message's bytes move between two
// processes through it. Note [Point-to-point through shared memory] there says what the words
// mean and who writes which; this file holds the layout, the doorbells and the copies.
//
// Contract: the layout is the same in every process that maps the segment (sizes are fixed
// here and checked by static_assert). Every method may be called from any thread; the slot
// protocol (state words, compare and swap) is what orders the two processes, and the caller
// (ShmPointToPoint) serialises its own threads.
//
// Note [Large messages copied from both ends]
// One process_vm_readv moves data several times slower than memcpy (it pins the sender's pages
// as it goes; measured: docs/performance.md, Design measurements), so a message of
// kSharedCopyMin (1 MB) or more is copied by both
// ends at once: the receiver publishes where its bytes go and marks the slot copying, and then
// each side claims kChunk (512 KB) chunks from the slot's counter until none are left, the
// receiver reading by process_vm_readv (ReceiverCopy), the sender (whenever a thread of it moves
// its operations along: a waiting caller, or its progress thread, which the receiver's ring
// wakes) writing by process_vm_writev (SenderCopy). The receiver marks the slot taken only once
// the copied count reached the message's size, so the sender never writes into a buffer its
// receiver has given back. A sender that is busy elsewhere leaves every chunk to the receiver;
// one that dies in the middle fails the receive naming it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "point_to_point.h"

namespace hvdlite {

class ShmChannel;

// A rank's line: its doorbell.
struct MailBell {
  std::atomic<uint32_t> ring;     // bumped by every ring
  std::atomic<int32_t> sleepers;  // threads asleep (or about to be) on `ring`
  std::atomic<int32_t> closed;    // 1 once the rank's path closed (shutdown, abort, exit)
  char unused[52];
};

// An ordered pair's line, before its slots.
struct MailPair {
  std::atomic<uint64_t> posted;  // 1 + the sequence number of the last message posted
  char unused[56];
};

// One slot: a message.
struct Mail {
  static constexpr int64_t kInline = 704;  // bytes that travel in the slot itself
  // the slot's states
  enum : uint32_t { kEmpty = 0, kFull = 1, kClaimed = 2, kTaken = 3, kCopying = 4 };
  // the verdict (answer[6]): what the receiver did with the message
  enum : int64_t { kRefused = 0, kAccepted = 1, kUnreadable = 2 };

  std::atomic<uint32_t> state;
  std::atomic<uint32_t> failed;  // kCopying: a chunk the sender copied failed
  uint64_t seq;
  uint64_t address;  // the sender's bytes, when they are not inline
  // kCopying (Note [Large messages copied from both ends]): the receiver's bytes, and how many
  // bytes either side has claimed and copied so far
  uint64_t into;
  std::atomic<uint64_t> claimed;
  std::atomic<uint64_t> copied;
  int64_t unused[2];
  int64_t sent[message_words::kWords];    // the sender's words
  int64_t answer[message_words::kWords];  // the receiver's words and verdict
  char payload[kInline];
};

class Mailboxes {
 public:
  static constexpr int kSlots = 16;
  static constexpr int64_t kSlotBytes = 1024;
  static constexpr int64_t kSharedCopyMin = 1 << 20;
  static constexpr int64_t kChunk = 512 << 10;

  // `area`: ShmSegment::Mailbox() of a segment of `size` ranks.
  Mailboxes(char* area, int size) : area_(area), size_(size) {}

  MailBell& Bell(int rank) const;
  MailPair& Pair(int source, int destination) const;
  Mail& Slot(int source, int destination, int i) const;
  // Wakes `rank`'s sleepers, if any (a futex wake only when one sleeps).
  void Ring(int rank) const;

  // Note [Large messages copied from both ends]. The receiver's side, on a slot it claimed:
  // copies `bytes` into `into` from `pid` (with the sender's help, whom it rings); "" or what
  // went wrong. The sender's side: copies chunks of `mail` from `from` into `pid` while any are
  // unclaimed; true if it copied one.
  std::string ReceiverCopy(Mail& mail, int source, int64_t pid, char* into, int64_t bytes,
                           std::chrono::milliseconds timeout) const;
  static bool SenderCopy(Mail& mail, int64_t pid, const char* from, int64_t bytes);
  // Copies `bytes` at `offset` between this process's `local` and `pid`'s `remote` (read: from
  // remote into local; else the other way); "" or what went wrong.
  static std::string CopyWith(int64_t pid, bool read, char* local, uint64_t remote, int64_t offset, int64_t bytes);

  // ShmPointToPoint::PingPongFloor: a word each way through the probe line.
  double PingPongFloor(int rank, int rounds) const;

 private:
  char* const area_;
  const int size_;
};

static_assert(sizeof(MailBell) == 64, "a bell is a cache line");
static_assert(sizeof(MailPair) == 64, "a pair's count is a cache line");
static_assert(sizeof(Mail) == Mailboxes::kSlotBytes, "a slot is 1 KB");

}  // namespace hvdlite
