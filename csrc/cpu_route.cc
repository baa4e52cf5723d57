#include "cpu_route.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>

namespace hvdlite {
namespace {

// Note [Hierarchical allreduce] (cpu_route.h)
class HierarchicalRoute : public CpuRoute {
 public:
  HierarchicalRoute(ShmChannel* local, CollectiveBackend* cross) : local_(local), cross_(cross) {}
  std::string name() const override { return "the hierarchical allreduce"; }

  bool FusesInPlace(int64_t, bool) const override { return local_ != nullptr; }
  void AllreducePieces(const std::vector<ShmChannel::Piece>& pieces, c10::ScalarType dtype, ReduceOp op,
                       const Hook& prescale, const Hook& finish) override {
    // The host's sum goes across hosts, chunk by chunk.
    local_->AllreducePieces(pieces, dtype, op, prescale, finish,
                            [&](at::Tensor& host_sum) { return cross_->StartAllreduce(host_sum, op); });
  }

  void AllreduceFlat(at::Tensor& flat, ReduceOp op, const Hook& finish) override {
    if (local_ == nullptr) {  // alone on this host: the same cuts as the other hosts' channels,
      // two in flight as theirs are
      const int64_t per = ShmChannel::kHierarchicalChunk / static_cast<int64_t>(flat.element_size());
      std::vector<at::Tensor> parts;
      for (int64_t offset = 0; offset < flat.numel(); offset += per) {
        parts.push_back(flat.narrow(0, offset, std::min(per, flat.numel() - offset)));
      }
      std::function<void()> previous;
      std::exception_ptr failure;
      for (at::Tensor& part : parts) {
        try {
          std::function<void()> wait = cross_->StartAllreduce(part, op);
          if (previous) previous();
          previous = std::move(wait);
        } catch (...) {
          failure = std::current_exception();
          break;
        }
      }
      if (previous) {  // the last one started is waited for before anything is thrown
        try {
          previous();
        } catch (...) {
          if (!failure) failure = std::current_exception();
        }
      }
      if (failure) std::rethrow_exception(failure);
      finish(flat);
      return;
    }
    // Finished inside the channel, chunk by chunk, as AllreducePieces does: a rank that fused
    // through a buffer and one that fused straight into the segment must leave the same bytes
    // there (Note [Fusing straight into shared memory]).
    local_->Allreduce(
        flat, op, [&](at::Tensor& host_sum) { return cross_->StartAllreduce(host_sum, op); }, finish);
  }

 private:
  ShmChannel* local_;  // null when this rank is alone on its host
  CollectiveBackend* cross_;
};

// Note [Shared-memory allreduce] (shm_channel.h)
class SharedMemoryRoute : public CpuRoute {
 public:
  explicit SharedMemoryRoute(ShmChannel* shm) : shm_(shm) {}
  std::string name() const override {
    return shm_->single_copy_enabled() ? "shared memory (single copy from " +
                                             std::to_string(shm_->single_copy_min() >> 20) + " MB)"
                                       : "shared memory";
  }

  bool FusesInPlace(int64_t bytes, bool casts) const override { return !casts || !shm_->SingleCopy(bytes); }
  void AllreducePieces(const std::vector<ShmChannel::Piece>& pieces, c10::ScalarType dtype, ReduceOp op,
                       const Hook& prescale, const Hook& finish) override {
    shm_->AllreducePieces(pieces, dtype, op, prescale, finish);
  }

  void AllreduceFlat(at::Tensor& flat, ReduceOp op, const Hook& finish) override {
    shm_->Allreduce(flat, op, nullptr, finish);  // finished inside, as above
  }

  bool MovesData() const override { return true; }
  void Allgather(const at::Tensor& input, std::vector<at::Tensor>& outputs) override {
    shm_->Allgather(input, outputs);
  }
  void Broadcast(at::Tensor& tensor, int root) override { shm_->Broadcast(tensor, root); }

 private:
  ShmChannel* shm_;
};

// Note [CPU channels] (cpu_route.h)
class GlooChannelsRoute : public CpuRoute {
 public:
  explicit GlooChannelsRoute(std::vector<CollectiveBackend*> channels) : channels_(std::move(channels)) {}
  std::string name() const override { return channels_.front()->name(); }

  static constexpr int64_t kStripeBytes = 8LL << 20;
  static constexpr int64_t kMaxChunkBytes = 16LL << 20;
  static constexpr int64_t kChunksPerChannel = 4;
  static constexpr int64_t kPollBytes = 1LL << 20;  // copied out between looks for ended chunks

  // Note [CPU channels]: below two stripes' worth (or with one channel) one allreduce; above,
  // the pipelined chunks, whoever calls, so the cut never depends on how a rank filled the buffer.
  bool Chunked(int64_t bytes) const { return channels_.size() >= 2 && bytes >= 2 * kStripeBytes; }

  // Note [Streaming a batch through its buffer]: room for two of the largest chunks.
  bool StreamsThrough(int64_t buffer_bytes) const override {
    return channels_.size() >= 2 && buffer_bytes >= 2 * kMaxChunkBytes;
  }

  void AllreduceFlat(at::Tensor& flat, ReduceOp op, const Hook& finish) override {
    if (Chunked(flat.numel() * static_cast<int64_t>(flat.element_size()))) {
      auto nothing = [](int64_t, int64_t, at::Tensor&) {};
      AllreduceStaged(flat, flat.numel(), op, {nothing, finish, nothing, {}});
      return;
    }
    channels_.front()->Allreduce(flat, op);
    finish(flat);
  }

  // Note [Pipelined fusion over channels] (cpu_route.h)
  void AllreduceStaged(at::Tensor& buffer, int64_t n, ReduceOp op, const Staging& staging) override {
    const int64_t element = static_cast<int64_t>(buffer.element_size());
    if (!Chunked(n * element)) {
      CpuRoute::AllreduceStaged(buffer, n, op, staging);
      return;
    }
    const int64_t width = static_cast<int64_t>(channels_.size());
    // The cut depends on n and the channels only: chunks of about n / (width x
    // kChunksPerChannel), within [kStripeBytes, kMaxChunkBytes].
    const int64_t per = std::clamp<int64_t>((n + width * kChunksPerChannel - 1) / (width * kChunksPerChannel),
                                            kStripeBytes / element, kMaxChunkBytes / element);
    // Note [Streaming a batch through its buffer]: chunk c is staged in slot c % slots; a buffer
    // that holds all n is one slot per chunk.
    const bool ring = buffer.numel() < n;
    if (ring && !StreamsThrough(buffer.numel() * element)) throw TooSmall(buffer, n, "cannot stream them");
    // The first chunk is a quarter of the others: the link idles until it is copied in.
    std::vector<at::Tensor> chunks;
    std::vector<int64_t> begins;
    const int64_t slots = ring ? buffer.numel() / per : std::numeric_limits<int64_t>::max();
    for (int64_t offset = 0; offset < n;) {
      const int64_t length = std::min(chunks.empty() ? per / 4 : per, n - offset);
      const int64_t c = static_cast<int64_t>(chunks.size());
      begins.push_back(offset);
      chunks.push_back(buffer.narrow(0, ring ? (c % slots) * per : offset, length));
      offset += length;
    }
    const int64_t count = static_cast<int64_t>(chunks.size());
    std::vector<std::function<void()>> waits(count);
    std::vector<std::function<bool()>> done(count);
    std::vector<char> started(count, 0), ended(count, 0);
    int64_t copied = 0;  // chunks copied in
    std::exception_ptr failure;
    // Starts chunk c once it is copied in and its channel's chunk before it has ended.
    auto start = [&](int64_t c) {
      if (failure || c >= count || started[c] || c >= copied || (c >= width && !ended[c - width])) return;
      started[c] = 1;
      try {
        waits[c] = channels_[c % width]->StartAllreduce(chunks[c], op, &done[c]);
      } catch (...) {
        failure = std::current_exception();
      }
    };
    // Waits for chunk c (once, where it started) and starts the next chunk of its channel.
    auto reap = [&](int64_t c) {
      if (!waits[c]) return;
      auto wait = std::move(waits[c]);
      waits[c] = nullptr;
      try {
        wait();
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      ended[c] = 1;
      start(c + width);
    };
    // Whether chunk c has ended, without blocking (false where the backend cannot tell).
    auto ended_yet = [&](int64_t c) {
      try {
        return waits[c] && done[c] && done[c]();
      } catch (...) {  // the probe failed: the in-order wait will say why
        return false;
      }
    };
    // Reaps, without blocking, every chunk in flight that has ended: a channel starts its next
    // chunk while this thread copies, not after.
    auto poll = [&] {
      for (int64_t c = 0; c < count; ++c) {
        if (ended_yet(c)) reap(c);
      }
    };
    const int64_t step = std::max<int64_t>(1, kPollBytes / element);
    int64_t mapped = 0;  // Note [Prefaulting outputs while the link works]: outputs before it are mapped or written
    // Waits for chunk c (mapping outputs ahead meanwhile) and copies it out a step at a time,
    // looking for ended chunks between steps. Every started chunk is waited for before
    // anything is thrown.
    auto copy_out = [&](int64_t c) {
      mapped = std::max(mapped, begins[c]);
      try {
        while (staging.prefault && !failure && mapped < n && waits[c] && !ended_yet(c)) {
          const int64_t to = std::min(n, mapped + step);
          staging.prefault(mapped, to);
          mapped = to;
          poll();
        }
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      reap(c);
      poll();
      if (failure || !ended[c]) return;
      try {
        staging.finish(chunks[c]);
        for (int64_t at = begins[c], stop = begins[c] + chunks[c].numel(); at < stop; at += step) {
          const int64_t to = std::min(stop, at + step);
          at::Tensor part = chunks[c].narrow(0, at - begins[c], to - at);
          staging.copy_out(at, to, part);
          poll();
        }
      } catch (...) {
        failure = std::current_exception();
      }
    };
    int64_t out = 0;  // chunks copied out (or given up on), in order
    try {
      for (int64_t c = 0; c < count && !failure; ++c) {  // the first chunk per channel starts as it is filled
        while (out <= c - slots) copy_out(out++);  // its slot is free once the chunk before in it is out
        if (failure) break;
        staging.copy_in(begins[c], begins[c] + chunks[c].numel(), chunks[c]);
        copied = c + 1;
        start(c);
        poll();
      }
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
    while (out < count) copy_out(out++);
    if (failure) std::rethrow_exception(failure);
  }

 private:
  std::vector<CollectiveBackend*> channels_;
};

}  // namespace

std::logic_error CpuRoute::TooSmall(const at::Tensor& buffer, int64_t n, const char* why) {
  return std::logic_error("a staging buffer of " + std::to_string(buffer.numel()) + " elements for " +
                          std::to_string(n) + " on a route that " + why);
}

at::Tensor CpuRoute::CoverAll(at::Tensor& buffer, int64_t n) {
  if (buffer.numel() < n) throw TooSmall(buffer, n, "stages everything at once");
  return buffer.numel() == n ? buffer : buffer.narrow(0, 0, n);
}

std::unique_ptr<CpuRoute> ChooseCpuRoute(const CpuRouteInputs& in) {
  using Candidate = std::unique_ptr<CpuRoute> (*)(const CpuRouteInputs&);
  // Note [CPU routes]: in order of preference; each returns null where the job cannot use it.
  static const Candidate kCandidates[] = {
      [](const CpuRouteInputs& i) -> std::unique_ptr<CpuRoute> {
        if (!i.hierarchical) return nullptr;
        return std::make_unique<HierarchicalRoute>(i.shm, i.cross);
      },
      [](const CpuRouteInputs& i) -> std::unique_ptr<CpuRoute> {
        if (i.shm == nullptr) return nullptr;
        return std::make_unique<SharedMemoryRoute>(i.shm);
      },
      [](const CpuRouteInputs& i) -> std::unique_ptr<CpuRoute> {
        return std::make_unique<GlooChannelsRoute>(i.channels);
      },
  };
  for (Candidate candidate : kCandidates) {
    if (auto route = candidate(in)) return route;
  }
  return nullptr;  // unreachable: the last candidate always applies
}

}  // namespace hvdlite
