#include "shm_channel.h"

#include <ATen/Functions.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "kernels.h"

namespace hvdlite {
namespace {

// Note [Casting on the wire] (executor.h): a piece whose memory is of another dtype than the batch.
bool Casts(const ShmChannel::Piece& piece, c10::ScalarType dtype) {
  return piece.own != c10::ScalarType::Undefined && piece.own != dtype;
}

// The bytes a piece's memory spans (`bytes` counts the batch's elements of `element` bytes).
uintptr_t OwnBytes(const ShmChannel::Piece& piece, size_t element) {
  if (piece.own == c10::ScalarType::Undefined) return static_cast<uintptr_t>(piece.bytes);
  return static_cast<uintptr_t>(piece.bytes / static_cast<int64_t>(element)) * c10::elementSize(piece.own);
}

}  // namespace

ShmChannel::ShmChannel(const std::string& name, int rank, int size, std::vector<int64_t> ranks,
                       std::vector<int64_t> pids, double timeout_seconds, int64_t chunk_bytes)
    : segment_(name, rank, size, std::move(ranks), std::move(pids), timeout_seconds, chunk_bytes),
      rank_(rank),
      size_(size) {
  // Test hook (tests/multirank/test_shared_memory.py): this rank pauses inside every allreduce
  // before its first barrier, so a test can kill it while the others wait in the channel.
  if (const char* delay = std::getenv("HVDLITE_TEST_SHM_DELAY_MS")) test_delay_ms_ = std::atoll(delay);
  // Test hook (tests/multirank/test_single_copy.py): this rank pauses after every block it
  // reduces in a single-copy allreduce, so its peers claim the rest.
  if (const char* delay = std::getenv("HVDLITE_TEST_SHM_CLAIM_DELAY_US")) test_claim_delay_us_ = std::atoll(delay);
}

bool ShmChannel::Exchange(const std::string& mine, std::vector<std::string>* out, std::vector<int64_t>* lengths) {
  constexpr int64_t kHeader = 8;
  const int bank = control_bank_;
  control_bank_ ^= 1;
  const int64_t length = static_cast<int64_t>(mine.size());
  char* slot = segment_.ControlSlot(bank, rank_);
  std::memcpy(slot, &length, kHeader);
  if (length <= ShmSegment::kControlSlot - kHeader) std::memcpy(slot + kHeader, mine.data(), mine.size());
  try {
    segment_.Barrier();
  } catch (...) {
    segment_.Abort();
    throw;
  }
  lengths->assign(size_, 0);
  int64_t longest = 0;
  for (int r = 0; r < size_; ++r) {
    std::memcpy(&(*lengths)[r], segment_.ControlSlot(bank, r), kHeader);
    (*lengths)[r] = std::max<int64_t>((*lengths)[r], 0);
    longest = std::max(longest, (*lengths)[r]);
  }
  if (longest > ShmSegment::kControlSlot - kHeader) return false;
  out->assign(size_, std::string());
  for (int r = 0; r < size_; ++r) (*out)[r].assign(segment_.ControlSlot(bank, r) + kHeader, (*lengths)[r]);
  return true;
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
      [&](int64_t offset, int64_t n, std::vector<Stretch>* own) {
        own->assign(1, Stretch{data + offset * element, n});
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
      [&](int64_t offset, int64_t n, std::vector<Stretch>* own) {  // Note [Own share straight from the input]
        own->clear();
        bool casts = false;
        walk(direct_cursor, offset * element, nullptr);
        walk(direct_cursor, (offset + n) * element, [&](const Piece& piece, int64_t at, int64_t bytes) {
          casts = casts || Casts(piece, dtype);
          own->push_back(Stretch{piece.in + at, bytes / element});
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
  const std::vector<Chunk> cut = CutChunks(total, segment_.chunk_bytes() / element);
  const int64_t count = static_cast<int64_t>(cut.size());
  const int first_bank = bank_;  // chunk k takes bank first_bank ^ (k & 1)
  auto bank_of = [first_bank](int64_t k) { return first_bank ^ static_cast<int>(k & 1); };
  // Note [Hierarchical allreduce] (cpu_route.h): chunk k's host sum travels across hosts while
  // chunk k + 1 is reduced here (two lanes). Rank 0 of the channel starts it; the others have
  // nothing to wait for. Without `across` the window stays empty.
  WorkWindow travelling(across ? count : 0, 2, !across ? WorkWindow::Start() : [&](int64_t k) {
    if (rank_ != 0) return PendingWork();
    at::Tensor reduced = at::from_blob(segment_.Result(bank_of(k)), {cut[k].n}, options);
    return across(reduced);
  });
  auto arrive = [&](int64_t k) {  // the job's sum is in: scale once, then everyone copies out
    travelling.Reap(k);
    travelling.ThrowIfFailed();
    if (rank_ == 0 && finish) {
      at::Tensor reduced = at::from_blob(segment_.Result(bank_of(k)), {cut[k].n}, options);
      finish(reduced);
    }
    segment_.Barrier();
    drain(segment_.Result(bank_of(k)), cut[k].begin, cut[k].n);
  };
  std::vector<Stretch> own;
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
      char* slot = segment_.Slot(bank, rank_);
      if (!straight) {
        fill(slot, offset, n);
        own.assign(1, Stretch{slot + begin * element, end - begin});
      } else {
        straight_shares_.fetch_add(1, std::memory_order_relaxed);
        if (begin > 0) fill(slot, offset, begin);
        if (n > end) fill(slot + end * element, offset + end, n - end);
      }
      if (prepare) {
        at::Tensor mine = at::from_blob(slot, {n}, options);
        prepare(mine);
      }
      segment_.Barrier();
      if (end > begin) {
        int64_t first = begin;  // the segment's first element in the chunk
        for (const Stretch& segment : own) {
          auto view = [&](const char* area) {
            return at::from_blob(const_cast<char*>(area) + first * element, {segment.n}, options);
          };
          auto source = [&](int r) {  // rank r's contribution to this segment
            return r == rank_ ? at::from_blob(const_cast<char*>(segment.data), {segment.n}, options)
                              : view(segment_.Slot(bank, r));
          };
          at::Tensor result = view(segment_.Result(bank));
          Combine(result, source(0), source(1), op);
          for (int r = 2; r < size_; ++r) Combine(result, result, source(r), op);
          first += segment.n;
        }
        at::Tensor result = at::from_blob(segment_.Result(bank) + begin * element, {end - begin}, options);
        if (finish && !across) finish(result);
      }
      segment_.Barrier();
      if (!across) {
        drain(segment_.Result(bank), offset, n);
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
    segment_.Abort();
    travelling.ThrowIfFailed();
  }
}

void ShmChannel::Move(int64_t bytes, const std::function<void(char** slots, int64_t offset, int64_t n)>& fill,
                      const std::function<void(char** slots, int64_t offset, int64_t n)>& drain) {
  std::vector<char*> slots(size_);
  try {
    if (test_delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(test_delay_ms_));
    for (const Chunk& chunk : CutChunks(bytes, segment_.chunk_bytes())) {
      const int64_t offset = chunk.begin, n = chunk.n;
      const int bank = bank_;
      bank_ ^= 1;
      for (int r = 0; r < size_; ++r) slots[r] = segment_.Slot(bank, r);
      fill(slots.data(), offset, n);
      segment_.Barrier();
      drain(slots.data(), offset, n);
    }
  } catch (...) {
    segment_.Abort();
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
  const std::vector<int64_t>& ranks = segment_.engine_ranks();
  const auto found = std::find(ranks.begin(), ranks.end(), static_cast<int64_t>(root));
  if (found == ranks.end()) throw std::runtime_error("shared memory: broadcast from rank " + std::to_string(root) +
                                                      ", which is not in this channel");
  const int from = static_cast<int>(found - ranks.begin());
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
