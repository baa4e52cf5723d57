// ShmChannel: allreduce, allgather, broadcast and the negotiation's exchange through one
// shared-memory segment (ShmSegment, shm_segment.h: the layout, the barrier, liveness and
// abort), for the ranks of an engine that all run on one host. This class holds the algorithms
// over that segment.
//
// Contract: its collectives (Exchange, Allreduce, AllreducePieces, Allgather, Broadcast) are
// called by every rank of the channel in the same order, on whichever thread runs the engine's
// rounds (Note [A waiting caller runs the round] in round_driver.h), so one call at a time; the
// channel takes no lock. A collective throws std::runtime_error naming the rank when a peer
// exited, aborted or timed out, after aborting the segment so its peers fail at once too. The
// counters for tests may be read from any thread.
//
// Note [Shared-memory allreduce]
// On one host, a Gloo allreduce still moves every byte through loopback TCP: system calls,
// kernel copies and wake-ups on the cores that also run the ranks' compute. Through a shared
// segment each rank copies its data in once, reduces its own share of everyone's data, and
// copies the whole result out once: faster than Gloo for large buffers and small ones alike
// (measured: docs/performance.md, Design measurements).
//
// The segment holds two data banks, each with one slot per rank and one result area of the
// segment's chunk size (shm_segment.h). A buffer is processed in chunks of at most that,
// alternating banks:
//   1. copy my chunk into my slot of the bank; barrier;
//   2. reduce my share (elements [rank*share, (rank+1)*share) of the chunk) over every rank's
//      slot into the bank's result area; barrier;
//   3. copy the bank's whole result area into my chunk of the buffer.
// Note [Own share straight from the input]: no rank reads share r of rank r's slot, so rank r
// copies only the other shares in and reduces its own straight out of its input, where that
// lies in the batch's dtype, in segments of 64 KB or more on average (a fused batch's
// members), and needs no prescale; else it copies it in as well: a choice each rank makes
// alone, since peers read the same slots either way. For 2 ranks that saves half of step 1,
// a fifth of the bytes each rank moves (measured: docs/performance.md, Design measurements);
// the values summed, and their order, are the same.
// Step 3 of chunk k needs no third barrier: chunk k+2 reuses the bank, and every rank writes
// it only after the first barrier of chunk k+1, which no rank passes before all have left
// chunk k. Every rank sums in the same order (rank 0's value first), and every rank copies the
// same result area, so every rank receives bit-identical results.
//
// Barriers wait as Note [Barrier waits] (shm_segment.h) says: spin, yield while a caller
// waits, sleep on a futex, check the peers' pids, give up at the timeout naming the rank.
//
// Note [Control exchange through shared memory]
// The same segment also carries the negotiation round (ControlChannel::Exchange) of an engine
// whose ranks all share the host: each rank writes its message into its slot of a control
// bank (64 KB), one barrier, everyone reads every slot; banks alternate, so a bank is written
// again only after a later barrier, which no rank passes before it has read the bank. A message
// too large for a slot travels by Gloo (the caller's fallback). The Gloo alltoall this replaces
// was the whole cost of a small collective (measured: docs/performance.md, Design
// measurements).
//
// A rank whose channel is destroyed (its engine shut down) or that fails inside it sets the
// abort word, so ranks still waiting on it fail at once, as a closed Gloo connection makes them.
//
// Note [Single-copy allreduce]
// The staged path above makes about five passes over the data per rank (copy in, read every
// share, write the result, copy the whole result out). Where the kernel lets the job's
// processes read and write each other's memory (process_vm_readv/writev, "CMA": same user, no
// ptrace restriction between them), a large allreduce skips the segment's data banks: each rank
// publishes where its input and output bytes are (a list of spans in its slot of the next bank),
// one barrier, then the ranks claim 256 KB blocks of the elements from a counter in the header
// (Claims). Whoever claims a block reduces it straight out of every rank's input (its own by
// plain loads, the others' by process_vm_readv into a block that stays in cache), applies
// `finish` to it, and writes it straight into every rank's output (process_vm_writev; its own by
// memcpy); a second barrier ends the collective, after which no one touches this rank's memory.
// Each block is read and written by the one rank that claimed it, so in-place allreduces are
// safe without further barriers. Every rank combines the contributions in rank order, element
// by element as the staged path's kernels do, so the two paths give bit-identical results.
// Claiming rather than a fixed share per rank matters in a training step: with one core per
// rank, a rank still in its backward pass shares its core with its engine thread while a rank
// that finished waits, so the waiting rank's engine takes most of the blocks (measured:
// docs/performance.md, Design measurements). Every rank resets the counter before the first
// barrier: all of them passed the previous single-copy allreduce's closing barrier, so none
// still claims, and none claims before that first barrier. tests/multirank/test_single_copy.py
// slows one rank (HVDLITE_TEST_SHM_CLAIM_DELAY_US) and checks that the others take its blocks.
// CMA moves data into a cached block several times slower than memcpy does, so below
// kSingleCopyMinBytes (8 MB, where the two crossed in bench/one_host.py) the staged path, whose
// slots stay in cache and which makes no system calls, is faster. Since each rank reads its
// own share in place (Note [Own share straight from the input]) the two come close from 8 to
// 32 MB, so the threshold stays (measured: docs/performance.md, Design measurements).
//
// Whether the job may use it is checked once, when the channel opens (hvdlite/_runtime/
// groups.py): every rank publishes the address of a probe word (ProbeAddress), every rank reads
// and writes every peer's (CanReach), and single copy is on only where all of them could
// (EnableSingleCopy on every rank or none), since both barriers and the bank alternation must
// match on every rank. A rank that fails in the middle sets the abort word, which its peers
// check before every block, and waits for them to leave (their Inside word) before it returns,
// so no peer writes into tensors it frees afterwards; a peer that is stopped (SIGSTOP) is not
// waited for, and could still write one block when it resumes. HVDLITE_SINGLE_COPY=0 keeps the
// staged path. A prescaled batch through pieces is scaled into its output first (or in place),
// so what peers read is the scaled data, as a fused buffer's is. The hierarchical route keeps
// the staged path (its `across` runs per chunk).
//
// Every rank takes this path for the same collectives: Python opens the channel on every rank
// or on none (hvdlite/_runtime/groups.py), and the executor uses it for every CPU allreduce.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <unistd.h>

#include "pipeline.h"
#include "shm_segment.h"
#include "types.h"

namespace hvdlite {

class ShmChannel {
 public:
  // Maps the segment (ShmSegment's constructor, whose arguments these are).
  ShmChannel(const std::string& name, int rank, int size, std::vector<int64_t> ranks, std::vector<int64_t> pids,
             double timeout_seconds, int64_t chunk_bytes = 0);
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // The segment, for what else travels through it (Note [Point-to-point through shared memory]).
  const ShmSegment& segment() const { return segment_; }
  // Note [Yield only while a caller waits] (shm_segment.h).
  void YieldWhile(const std::atomic<int>* count) { segment_.YieldWhile(count); }
  uint64_t waits_yielded() const { return segment_.waits_yielded(); }
  uint64_t waits_slept() const { return segment_.waits_slept(); }
  // Chunks whose share this rank reduced straight from its input (Note [Own share straight
  // from the input]; tests).
  uint64_t straight_shares() const { return straight_shares_.load(); }
  // Blocks of single-copy allreduces this rank reduced (Note [Single-copy allreduce]; tests).
  uint64_t single_copy_blocks() const { return single_copy_blocks_.load(); }

  // Every rank's bytes (Note [Control exchange through shared memory]). False when some rank's
  // message is larger than a slot: `lengths` then holds every rank's length for the fallback.
  bool Exchange(const std::string& mine, std::vector<std::string>* out, std::vector<int64_t>* lengths);

  // In place; op is kSum, kMin, kMax or kProduct. Throws std::runtime_error naming the rank
  // when a peer exited, aborted or timed out. With `across` (Note [Hierarchical allreduce] in
  // cpu_route.h), each chunk's reduction over these ranks is handed to `across` on rank 0 of the
  // channel, which starts its allreduce with the other hosts and returns its pending work; the chunk is
  // copied out once that wait returned, after the next chunk has been reduced here and its own
  // allreduce started. Every rank of the channel must pass `across` or none. `finish` (the
  // average and postscale) is applied inside, as AllreducePieces applies it, so ranks that take
  // either entry agree.
  using StartAcross = std::function<PendingWork(at::Tensor&)>;
  void Allreduce(at::Tensor& flat, ReduceOp op, const StartAcross& across = nullptr,
                 const std::function<void(at::Tensor&)>& finish = nullptr);

  // Note [Fusing straight into shared memory]
  // A fused batch of dense CPU tensors skips the fusion buffer: each member's bytes are copied
  // straight into this rank's slot, and the result area straight out into each member's
  // output, half the copies of buffer-then-slot. Scaling rides along: `prescale` runs on this
  // rank's slot after its copy in, `finish` (the average and postscale) on this rank's share of
  // the result before the second barrier, so each element is scaled once, by one rank, and
  // every rank copies out the same bytes. With `across` (hierarchical), `finish` runs on rank 0
  // of the channel after `across`, on the whole chunk. A piece's `in` and `out` may be the
  // same memory; pieces that otherwise share memory are refused (PiecesOverlap). This entry and
  // Allreduce are interchangeable between ranks (Note [Every path sends the same chunks] in
  // pipeline.h): both run the same chunks and barriers (Run) and scale at the same points.
  using Hook = std::function<void(at::Tensor&)>;
  // `bytes` counts the batch's dtype. Where `own` is another dtype (Note [Casting on the wire]
  // in executor.h), `in` and `out` hold as many elements of `own`, cast on the copies in and out;
  // such pieces never take the single-copy path (peers would read the uncast memory).
  struct Piece {
    const char* in;
    char* out;
    int64_t bytes;
    c10::ScalarType own = c10::ScalarType::Undefined;  // Undefined: the batch's dtype
  };
  // True when some piece's memory overlaps another piece's, or a piece's `in` and `out`
  // overlap without being the same: chunk k is copied out before chunk k + 1 is copied in, so
  // such a batch (the same tensor twice in a group, say) must go through a fusion buffer.
  static bool PiecesOverlap(const std::vector<Piece>& pieces, c10::ScalarType dtype);
  void AllreducePieces(const std::vector<Piece>& pieces, c10::ScalarType dtype, ReduceOp op,
                       const Hook& prescale, const Hook& finish, const StartAcross& across = nullptr);

  // Note [Shared-memory allgather and broadcast]
  // Collectives that only move data use the same banks, chunk by chunk, with one barrier per
  // chunk: each rank (Allgather) or the root (Broadcast) copies its chunk into its slot, one
  // barrier, and every rank copies the slots it needs out. A bank is written again two chunks
  // later, after the next chunk's barrier, which no rank passes before every rank has copied
  // out of it, the same argument as the allreduce's (and both kinds alternate the same banks).
  // Every rank's `input` has the same byte count (the executor pads uneven allgathers), so
  // every rank runs the same chunks. outputs[r] receives rank r's bytes; `root` is an engine
  // rank (ranks[i] of the constructor).
  void Allgather(const at::Tensor& input, std::vector<at::Tensor>& outputs);
  void Broadcast(at::Tensor& tensor, int root);

  // Note [Single-copy allreduce]: the probe and the switch (every rank or none).
  uint64_t ProbeAddress() { return reinterpret_cast<uint64_t>(&probe_word_); }
  uint64_t ProbeValue() const { return probe_word_; }
  // Whether this process can read the word at `address` in `pid` (it must hold `value`) and write
  // it back, through process_vm_readv/writev.
  static bool CanReach(int64_t pid, uint64_t address, uint64_t value);
  void EnableSingleCopy(int64_t min_bytes) {
    single_copy_allowed_ = true;
    single_copy_min_.store(min_bytes);
  }
  // For benchmarks and tests, once allowed: the smallest allreduce that takes the path (0: none).
  // Every rank must change it between the same two collectives. False where not allowed.
  bool SetSingleCopyMin(int64_t min_bytes) {
    if (single_copy_allowed_) single_copy_min_.store(min_bytes);
    return single_copy_allowed_;
  }
  // Whether an allreduce of `bytes` takes the single-copy path (the same on every rank).
  bool SingleCopy(int64_t bytes) const {
    const int64_t min = single_copy_min_.load(std::memory_order_relaxed);
    return min > 0 && bytes >= min;
  }
  bool single_copy_enabled() const { return single_copy_min_.load() > 0; }
  int64_t single_copy_min() const { return single_copy_min_.load(); }
  static constexpr int64_t kSingleCopyMinBytes = 8LL << 20;

  // Note [Hierarchical allreduce]: every host cuts buffers at the same element counts, so the
  // cross-host allreduces of the hosts' first ranks match; one chunk size for every host.
  static constexpr int64_t kHierarchicalChunk = 2LL << 20;

 private:
  // The chunk loop of both allreduces: `fill(to, offset, n)` copies this rank's elements
  // [offset, offset + n) to `to` (in its slot; calls come in increasing offsets),
  // `drain(result, offset, n)` copies them out of `result`. `prepare` runs on this rank's
  // filled slot and `finish` on its reduced share (both may be empty); `across` as for
  // Allreduce. `direct(offset, n, segments)` (Note [Own share straight from the input])
  // returns true after setting where this rank's elements [offset, offset + n) lie in memory,
  // as segments in element order, or false where some cast or they are too scattered.
  using Copy = std::function<void(char*, int64_t, int64_t)>;
  struct Stretch {  // elements of one rank's share lying together in memory
    const char* data;
    int64_t n;  // elements
  };
  using Direct = std::function<bool(int64_t, int64_t, std::vector<Stretch>*)>;
  // Note [Own share straight from the input]: a share is reduced a segment at a time (each
  // one operator call, a few microseconds) only where its segments average at least this.
  static constexpr int64_t kStraightSegmentBytes = 64LL << 10;
  void Run(int64_t total, c10::ScalarType dtype, ReduceOp op, const Copy& fill, const Copy& drain,
           const Direct& direct, const Hook& prepare, const Hook& finish, const StartAcross& across);
  // The chunk loop of Allgather and Broadcast (Note [Shared-memory allgather and broadcast]):
  // per chunk of `bytes`, `fill` writes into this bank's slots, one barrier, `drain` reads them.
  void Move(int64_t bytes, const std::function<void(char** slots, int64_t offset, int64_t n)>& fill,
            const std::function<void(char** slots, int64_t offset, int64_t n)>& drain);
  // Note [Single-copy allreduce]: one span list for the input and one for the output, each
  // {address, bytes} in element order; `finish` as in Run.
  struct Span {
    uint64_t address;
    uint64_t bytes;
  };
  // A rank publishes its lists in its slot of the bank: the two counts (input spans, output
  // spans), then the input spans and the output spans. A slot holds at most a chunk's bytes.
  static constexpr size_t kSpanListHeader = 2 * sizeof(uint64_t);
  static constexpr uint64_t kMaxSpans = uint64_t{1} << 40;  // a count past this is corrupt
  static size_t SpanListBytes(uint64_t in, uint64_t out) { return kSpanListHeader + sizeof(Span) * (in + out); }
  void SingleCopyPieces(const std::vector<Piece>& pieces, c10::ScalarType dtype, ReduceOp op, const Hook& prescale,
                        const Hook& finish);
  void RunSingleCopy(const std::vector<Span>& in, const std::vector<Span>& out, int64_t total,
                     c10::ScalarType dtype, ReduceOp op, const Hook& finish);
  static constexpr uint64_t kProbeMagic = 0x68766c6974652d31ULL;

  ShmSegment segment_;
  const int rank_;  // the segment's rank and size
  const int size_;
  std::atomic<uint64_t> straight_shares_{0};
  std::atomic<uint64_t> single_copy_blocks_{0};
  int bank_ = 0;
  int control_bank_ = 0;
  int64_t test_delay_ms_ = 0;  // HVDLITE_TEST_SHM_DELAY_MS, a test hook (see the constructor)
  int64_t test_claim_delay_us_ = 0;  // HVDLITE_TEST_SHM_CLAIM_DELAY_US, likewise
  // Note [Single-copy allreduce]: whether the probe allowed it, and 0 (off) or the smallest
  // allreduce it takes.
  bool single_copy_allowed_ = false;
  std::atomic<int64_t> single_copy_min_{0};
  volatile uint64_t probe_word_ = kProbeMagic ^ static_cast<uint64_t>(getpid());
  at::Tensor blocks_;  // the single-copy path's two cache-sized blocks
};

}  // namespace hvdlite
