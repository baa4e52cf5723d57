// The single-copy allreduce of ShmChannel (Note [Single-copy allreduce] in shm_channel.h).
#include <ATen/Functions.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "kernels.h"
#include "shm_channel.h"

namespace hvdlite {
namespace {

// Bytes reduced per step: large enough that a process_vm_readv call moves many pages, small
// enough that a block and its partner stay in cache (256 KB was the fastest block size
// measured: docs/performance.md, Design measurements, Note [Single-copy allreduce]).
constexpr int64_t kBlockBytes = 256LL << 10;
constexpr size_t kMaxIov = IOV_MAX;

// Where byte `at` of a span list lies: the span's index and the offset inside it. `starts`
// holds each span's first byte.
std::pair<size_t, uint64_t> Locate(const std::vector<uint64_t>& starts, uint64_t at) {
  const size_t i = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), at) - starts.begin()) - 1;
  return {i, at - starts[i]};
}

}  // namespace

bool ShmChannel::CanReach(int64_t pid, uint64_t address, uint64_t value) {
  uint64_t word = 0;
  iovec local{&word, sizeof(word)}, remote{reinterpret_cast<void*>(address), sizeof(word)};
  if (process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0) != sizeof(word) || word != value) {
    return false;
  }
  return process_vm_writev(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0) == sizeof(word);
}

void ShmChannel::SingleCopyPieces(const std::vector<Piece>& pieces, c10::ScalarType dtype, ReduceOp op,
                                  const Hook& prescale, const Hook& finish) {
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  const auto options = at::TensorOptions().dtype(dtype);
  int64_t total_bytes = 0;
  for (const Piece& piece : pieces) total_bytes += piece.bytes;
  std::vector<Span> in, out;
  in.reserve(pieces.size());
  out.reserve(pieces.size());
  for (const Piece& piece : pieces) {
    if (prescale) {
      // Peers must read scaled data, as they would from a fused buffer: scale into the output
      // (which the result overwrites anyway) and publish that as the input.
      if (piece.out != piece.in) std::memcpy(piece.out, piece.in, piece.bytes);
      at::Tensor scaled = at::from_blob(piece.out, {piece.bytes / element}, options);
      prescale(scaled);
      in.push_back({reinterpret_cast<uint64_t>(piece.out), static_cast<uint64_t>(piece.bytes)});
    } else {
      in.push_back({reinterpret_cast<uint64_t>(piece.in), static_cast<uint64_t>(piece.bytes)});
    }
    out.push_back({reinterpret_cast<uint64_t>(piece.out), static_cast<uint64_t>(piece.bytes)});
  }
  if (static_cast<int64_t>(SpanListBytes(in.size(), out.size())) <= segment_.chunk_bytes()) {
    RunSingleCopy(in, out, total_bytes / element, dtype, op, finish);
    return;
  }
  // More pieces than this rank's slot can list (tens of thousands): through one buffer here,
  // still on the single-copy path, as every rank is.
  at::Tensor buffer = at::empty({total_bytes / element}, options);
  char* at = static_cast<char*>(buffer.data_ptr());
  for (const Span& span : in) {
    std::memcpy(at, reinterpret_cast<const char*>(span.address), span.bytes);
    at += span.bytes;
  }
  const Span whole{reinterpret_cast<uint64_t>(buffer.data_ptr()), static_cast<uint64_t>(total_bytes)};
  RunSingleCopy({whole}, {whole}, total_bytes / element, dtype, op, finish);
  at = static_cast<char*>(buffer.data_ptr());
  for (const Span& span : out) {
    std::memcpy(reinterpret_cast<char*>(span.address), at, span.bytes);
    at += span.bytes;
  }
}

void ShmChannel::RunSingleCopy(const std::vector<Span>& in, const std::vector<Span>& out, int64_t total,
                               c10::ScalarType dtype, ReduceOp op, const Hook& finish) {
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  const auto options = at::TensorOptions().dtype(dtype);
  const int bank = bank_;  // the bank the next staged chunk would take (Note [Shared-memory allreduce])
  bank_ ^= 1;
  try {
    if (test_delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(test_delay_ms_));
    char* mine = segment_.Slot(bank, rank_);
    const uint64_t counts[2] = {in.size(), out.size()};
    std::memcpy(mine, counts, sizeof(counts));
    std::memcpy(mine + kSpanListHeader, in.data(), sizeof(Span) * in.size());
    std::memcpy(mine + kSpanListHeader + sizeof(Span) * in.size(), out.data(), sizeof(Span) * out.size());
    // Every rank left the last single-copy allreduce's closing barrier, so none claims from the
    // counter any more; every rank resets it, and none claims before the barrier below.
    segment_.Claims().store(0);
    segment_.Inside(rank_).store(1);
    segment_.Barrier();

    // Every rank's lists, with each span's first byte (for Locate).
    struct Lists {
      std::vector<Span> spans[2];
      std::vector<uint64_t> starts[2];
    };
    std::vector<Lists> lists(size_);
    for (int r = 0; r < size_; ++r) {
      const char* slot = segment_.Slot(bank, r);
      uint64_t n[2];
      std::memcpy(n, slot, sizeof(n));
      if (n[0] > kMaxSpans || n[1] > kMaxSpans || SpanListBytes(n[0], n[1]) > static_cast<uint64_t>(segment_.chunk_bytes())) {
        throw std::runtime_error("shared memory: rank " + std::to_string(segment_.engine_rank(r)) + " published a corrupt span list");
      }
      const char* at = slot + kSpanListHeader;
      for (int d = 0; d < 2; ++d) {
        lists[r].spans[d].resize(n[d]);
        std::memcpy(lists[r].spans[d].data(), at, sizeof(Span) * n[d]);
        at += sizeof(Span) * n[d];
        uint64_t sum = 0;
        for (const Span& span : lists[r].spans[d]) {
          lists[r].starts[d].push_back(sum);
          sum += span.bytes;
        }
        if (sum != static_cast<uint64_t>(total * element)) {
          throw std::runtime_error("shared memory: rank " + std::to_string(segment_.engine_rank(r)) + " offers " +
                                   std::to_string(sum) + " bytes to a single-copy allreduce of " +
                                   std::to_string(total * element));
        }
      }
    }

    if (!blocks_.defined()) blocks_ = at::empty({2 * kBlockBytes}, at::TensorOptions().dtype(at::kByte));
    char* const block[2] = {static_cast<char*>(blocks_.data_ptr()), static_cast<char*>(blocks_.data_ptr()) + kBlockBytes};
    std::vector<iovec> remote;
    remote.reserve(kMaxIov);

    // Moves bytes [at, at + bytes) of rank r's list `d` (0 in, 1 out) from (d = 0) or to (d = 1)
    // `buffer`: by memcpy for this rank, by process_vm_readv/writev for a peer.
    auto transfer = [&](int r, int d, uint64_t at, uint64_t bytes, char* buffer) {
      const std::vector<Span>& spans = lists[r].spans[d];
      auto [i, within] = Locate(lists[r].starts[d], at);
      uint64_t done = 0;
      while (done < bytes) {
        remote.clear();
        uint64_t batch = 0;
        while (done + batch < bytes && remote.size() < kMaxIov) {
          const uint64_t n = std::min(spans[i].bytes - within, bytes - done - batch);
          remote.push_back({reinterpret_cast<void*>(spans[i].address + within), n});
          batch += n;
          within += n;
          if (within == spans[i].bytes) ++i, within = 0;
        }
        if (r == rank_) {
          char* cursor = buffer + done;
          for (const iovec& v : remote) {
            if (d == 0) std::memcpy(cursor, v.iov_base, v.iov_len);
            else std::memcpy(v.iov_base, cursor, v.iov_len);
            cursor += v.iov_len;
          }
        } else {
          iovec local{buffer + done, batch};
          const pid_t pid = static_cast<pid_t>(segment_.pid(r));
          const ssize_t moved = d == 0 ? process_vm_readv(pid, &local, 1, remote.data(), remote.size(), 0)
                                       : process_vm_writev(pid, &local, 1, remote.data(), remote.size(), 0);
          if (moved != static_cast<ssize_t>(batch)) {
            const int error = moved < 0 ? errno : EFAULT;
            if (error == ESRCH) {
              throw std::runtime_error("rank " + std::to_string(segment_.engine_rank(r)) + " (pid " + std::to_string(segment_.pid(r)) +
                                       ") exited (seen in the shared-memory channel)");
            }
            throw std::runtime_error(std::string("shared memory: ") + (d == 0 ? "reading" : "writing") + " rank " +
                                     std::to_string(segment_.engine_rank(r)) + "'s tensor failed: " + std::strerror(error));
          }
        }
        done += batch;
      }
    };
    // Rank r's contribution to bytes [at, at + bytes): a pointer into this rank's own input
    // where one span holds them, else a copy in `buffer`.
    auto contribution = [&](int r, uint64_t at, uint64_t bytes, char* buffer) -> const char* {
      if (r == rank_) {
        auto [i, within] = Locate(lists[r].starts[0], at);
        if (lists[r].spans[0][i].bytes - within >= bytes) {
          return reinterpret_cast<const char*>(lists[r].spans[0][i].address + within);
        }
      }
      transfer(r, 0, at, bytes, buffer);
      return buffer;
    };

    // Blocks are claimed from the shared counter, each by one rank: a rank whose core is free
    // (its own backward pass over) takes more of them than one whose core is still computing.
    const int64_t per_block = kBlockBytes / element;  // whole cache lines
    const uint64_t block_count = static_cast<uint64_t>((total + per_block - 1) / per_block);
    uint64_t reduced = 0;  // blocks this rank claimed (single_copy_blocks_, for tests)
    for (uint64_t claimed = segment_.Claims().fetch_add(1); claimed < block_count; claimed = segment_.Claims().fetch_add(1), ++reduced) {
      segment_.ThrowIfAborted();  // a peer failed: stop touching its memory
      const int64_t offset = static_cast<int64_t>(claimed) * per_block;
      const int64_t n = std::min(per_block, total - offset);
      const uint64_t at = static_cast<uint64_t>(offset * element), bytes = static_cast<uint64_t>(n * element);
      // The sum goes straight into this rank's output where one span holds the block and this
      // rank's own input is read by the first Combine (ranks 0 and 1), so an in-place output
      // overwrites nothing still to be read; else into a block, copied out with the peers'.
      char* target = block[0];
      if (rank_ <= 1) {
        auto [i, within] = Locate(lists[rank_].starts[1], at);
        const Span& span = lists[rank_].spans[1][i];
        if (span.bytes - within >= bytes) target = reinterpret_cast<char*>(span.address + within);
      }
      at::Tensor sum = at::from_blob(target, {n}, options);
      // In rank order, as the staged path: rank 0's value first.
      const char* first = contribution(0, at, bytes, block[0]);
      const char* second = contribution(1, at, bytes, block[1]);
      Combine(sum, at::from_blob(const_cast<char*>(first), {n}, options),
              at::from_blob(const_cast<char*>(second), {n}, options), op);
      for (int r = 2; r < size_; ++r) {
        const char* next = contribution(r, at, bytes, block[1]);
        Combine(sum, sum, at::from_blob(const_cast<char*>(next), {n}, options), op);
      }
      if (finish) finish(sum);
      for (int r = 0; r < size_; ++r) {
        if (r != rank_ || target == block[0]) transfer(r, 1, at, bytes, target);
      }
      if (test_claim_delay_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(test_claim_delay_us_));
    }
    single_copy_blocks_ += reduced;
    segment_.Barrier();  // every block is in every output; no one reads this rank's input any more
    segment_.Inside(rank_).store(0);
  } catch (...) {
    segment_.Inside(rank_).store(0);
    segment_.Abort();
    segment_.AwaitPeersOut();
    throw;
  }
}

}  // namespace hvdlite
