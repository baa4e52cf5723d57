// Waiting on a word of shared memory, for the segment's barriers (shm_segment.cc) and the
// point-to-point mailboxes (shm_point_to_point.cc): a pause between polls, and a futex to
// sleep on (shared between processes: no FUTEX_PRIVATE_FLAG).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <ctime>

namespace hvdlite {

// One busy-wait step that lets a sibling hyperthread run.
inline void Relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Sleeps while `word` holds `seen`, at most `timeout_ms`.
inline void FutexWait(std::atomic<uint32_t>* word, uint32_t seen, int timeout_ms) {
  timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

inline void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace hvdlite
