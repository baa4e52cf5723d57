#include "cpu_route.h"

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string>

#include "pipeline.h"

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
    if (local_ == nullptr) {  // alone on this host: the same chunks as the other hosts' channels
      // (Note [Every path sends the same chunks] in pipeline.h), two in flight as theirs are
      const std::vector<Chunk> cut =
          CutChunks(flat.numel(), ShmChannel::kHierarchicalChunk / static_cast<int64_t>(flat.element_size()));
      const int64_t count = static_cast<int64_t>(cut.size());
      std::vector<at::Tensor> parts;
      for (const Chunk& chunk : cut) parts.push_back(flat.narrow(0, chunk.begin, chunk.n));
      WorkWindow window(count, 2, [&](int64_t k) { return cross_->StartAllreduce(parts[k], op); });
      for (int64_t k = 0; k < count && !window.failed(); ++k) {
        window.Ready(k + 1);
        window.Reap(k - 1);
      }
      window.Finish();
      finish(flat);
      return;
    }
    // Finished inside the channel, chunk by chunk, as AllreducePieces does (Note [Every path
    // sends the same chunks] in pipeline.h).
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
    // The cut depends on n and the channels only (Note [Every path sends the same chunks] in
    // pipeline.h): chunks of about n / (width x kChunksPerChannel), within [kStripeBytes,
    // kMaxChunkBytes], the first a quarter of the others (the link idles until it is copied in).
    const int64_t per = std::clamp<int64_t>((n + width * kChunksPerChannel - 1) / (width * kChunksPerChannel),
                                            kStripeBytes / element, kMaxChunkBytes / element);
    const std::vector<Chunk> cut = CutChunks(n, per, per / 4);
    const int64_t count = static_cast<int64_t>(cut.size());
    // Note [Streaming a batch through its buffer]: chunk c is staged in slot c % slots; a buffer
    // that holds all n is one slot per chunk.
    const bool ring = buffer.numel() < n;
    if (ring && !StreamsThrough(buffer.numel() * element)) throw TooSmall(buffer, n, "cannot stream them");
    const int64_t slots = ring ? buffer.numel() / per : count;
    std::vector<at::Tensor> chunks;
    for (int64_t c = 0; c < count; ++c) {
      chunks.push_back(buffer.narrow(0, ring ? (c % slots) * per : cut[c].begin, cut[c].n));
    }
    // One lane per channel: chunk c travels on channel c % width once the channel's chunk
    // before it has ended, and a channel whose chunk ended starts its next one while this
    // thread copies.
    WorkWindow window(count, width, [&](int64_t c) { return channels_[c % width]->StartAllreduce(chunks[c], op); });
    const int64_t step = std::max<int64_t>(1, kPollBytes / element);
    int64_t mapped = 0;  // Note [Prefaulting outputs while the link works]: outputs before it are mapped or written
    // Waits for chunk c (mapping outputs ahead meanwhile) and copies it out a step at a time,
    // looking for ended chunks between steps.
    auto copy_out = [&](int64_t c) {
      const int64_t begin = cut[c].begin, stop = begin + cut[c].n;
      mapped = std::max(mapped, begin);
      try {
        while (staging.prefault && !window.failed() && mapped < n && window.Travelling(c)) {
          const int64_t to = std::min(n, mapped + step);
          staging.prefault(mapped, to);
          mapped = to;
          window.Poll();
        }
      } catch (...) {
        window.Fail(std::current_exception());
      }
      window.Reap(c);
      window.Poll();
      if (window.failed() || !window.Ended(c)) return;
      try {
        staging.finish(chunks[c]);
        for (int64_t at = begin; at < stop; at += step) {
          const int64_t to = std::min(stop, at + step);
          at::Tensor part = chunks[c].narrow(0, at - begin, to - at);
          staging.copy_out(at, to, part);
          window.Poll();
        }
      } catch (...) {
        window.Fail(std::current_exception());
      }
    };
    int64_t out = 0;  // chunks copied out (or given up on), in order
    try {
      for (int64_t c = 0; c < count && !window.failed(); ++c) {
        while (out <= c - slots) copy_out(out++);  // its slot is free once the chunk before in it is out
        if (window.failed()) break;
        staging.copy_in(cut[c].begin, cut[c].begin + cut[c].n, chunks[c]);
        window.Ready(c + 1);  // the first chunk per channel starts as it is filled
        window.Poll();
      }
    } catch (...) {
      window.Fail(std::current_exception());
    }
    while (out < count) copy_out(out++);
    window.Finish();
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

bool ParseCpuRouteKind(const std::string& name, CpuRouteKind* kind) {
  static const std::pair<const char*, CpuRouteKind> kNames[] = {{"hierarchical", CpuRouteKind::kHierarchical},
                                                                {"shared_memory", CpuRouteKind::kSharedMemory},
                                                                {"gloo_channels", CpuRouteKind::kGlooChannels}};
  for (const auto& [spelled, value] : kNames) {
    if (name == spelled) {
      *kind = value;
      return true;
    }
  }
  return false;
}

std::unique_ptr<CpuRoute> MakeCpuRoute(const CpuRouteInputs& in) {
  if (in.channels.empty()) throw std::invalid_argument("a CPU route needs at least one Gloo group");
  switch (in.kind) {
    case CpuRouteKind::kHierarchical:
      if (in.shm == nullptr && in.cross == nullptr) {
        throw std::invalid_argument("a hierarchical route needs a shared-memory channel or a cross-host group");
      }
      return std::make_unique<HierarchicalRoute>(in.shm, in.cross);
    case CpuRouteKind::kSharedMemory:
      if (in.shm == nullptr) throw std::invalid_argument("a shared-memory route needs its channel");
      return std::make_unique<SharedMemoryRoute>(in.shm);
    case CpuRouteKind::kGlooChannels:
      break;
  }
  return std::make_unique<GlooChannelsRoute>(in.channels);
}

}  // namespace hvdlite
