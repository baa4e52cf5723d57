#include "hypercube.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace hvdlite {
namespace {

constexpr int64_t kHeaderBytes = 8;
constexpr int64_t kLargestTransfer = int64_t{1} << 36;  // past this a header is corrupt
constexpr int kFoldInTag = 1000;   // rank r >= P hands its message to r - P
constexpr int kFoldOutTag = 1002;  // and gets every message back
constexpr size_t kReasonBytes = 1000;  // with its two words, within any posted buffer (kReduceSlot)

at::Tensor Bytes(int64_t n) { return at::empty({n}, at::TensorOptions().dtype(at::kByte)); }

int64_t HeaderOf(const at::Tensor& t) {
  int64_t header;
  std::memcpy(&header, t.data_ptr(), kHeaderBytes);
  return header;
}

void PutU32(std::string* out, uint32_t v) { out->append(reinterpret_cast<const char*>(&v), 4); }

bool GetU32(const std::string& in, size_t* at, uint32_t* v) {
  if (in.size() - *at < 4) return false;
  std::memcpy(v, in.data() + *at, 4);
  *at += 4;
  return true;
}

}  // namespace

std::string PackMessages(const std::vector<std::string>& messages, const std::vector<int>& ranks) {
  std::string out;
  PutU32(&out, static_cast<uint32_t>(ranks.size()));
  for (int r : ranks) {
    PutU32(&out, static_cast<uint32_t>(r));
    PutU32(&out, static_cast<uint32_t>(messages[r].size()));
    out += messages[r];
  }
  return out;
}

bool UnpackMessages(const std::string& packed, std::vector<std::string>* messages, std::vector<bool>* have) {
  size_t at = 0;
  uint32_t count;
  if (!GetU32(packed, &at, &count)) return false;
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t rank, length;
    if (!GetU32(packed, &at, &rank) || !GetU32(packed, &at, &length)) return false;
    if (rank >= messages->size() || packed.size() - at < length) return false;
    (*messages)[rank].assign(packed.data() + at, length);
    (*have)[rank] = true;
    at += length;
  }
  return at == packed.size();
}

Hypercube::Hypercube(CollectiveBackend* link, int rank, int size) : link_(link), rank_(rank), size_(size) {
  while (core_ * 2 <= size_) {
    core_ *= 2;
    ++steps_;
  }
}

std::vector<int> Hypercube::Held(int core_rank, int k) const {
  const int base = core_rank & ~((1 << k) - 1);
  std::vector<int> held;
  for (int r = base; r < base + (1 << k); ++r) {
    held.push_back(r);
    if (r + core_ < size_) held.push_back(r + core_);
  }
  return held;
}

std::vector<int> Hypercube::Peers() const {
  if (rank_ >= core_) return {rank_ - core_};
  std::vector<int> peers;
  if (rank_ + core_ < size_) peers.push_back(rank_ + core_);
  for (int k = 0; k < steps_; ++k) peers.push_back(rank_ ^ (1 << k));
  return peers;
}

std::string Hypercube::Swap(int peer, int tag, const std::string* out, int64_t capacity) {
  // capacity: what the peer's transfer may carry in its first part (0: nothing to receive);
  // the same formula gives what ours may carry, from the messages we send (the caller's job).
  at::Tensor in;
  PendingWork receive;
  if (capacity > 0) {
    in = Bytes(kHeaderBytes + capacity);
    receive = link_->StartRecv(in, peer, tag);
  }
  std::vector<at::Tensor> outs;
  std::vector<PendingWork> sends;
  if (out != nullptr) {
    const int64_t total = static_cast<int64_t>(out->size());
    const int64_t first = std::min(total, out_capacity_);
    for (int part = 0; part < 2; ++part) {
      const int64_t begin = part == 0 ? 0 : first, n = part == 0 ? first : total - first;
      if (part == 1 && n == 0) break;
      outs.push_back(Bytes(kHeaderBytes + n));
      auto* p = static_cast<char*>(outs.back().data_ptr());
      std::memcpy(p, &total, kHeaderBytes);
      std::memcpy(p + kHeaderBytes, out->data() + begin, n);
      sends.push_back(link_->StartSend(outs.back(), peer, tag + part));
      ++sent_;
      rests_ += part;
    }
  }
  std::string got;
  if (capacity > 0) {
    receive.Wait();
    const int64_t total = HeaderOf(in);
    const auto* data = static_cast<const char*>(in.data_ptr()) + kHeaderBytes;
    if (total == kFailed) {
      int64_t n = 0;
      std::memcpy(&n, data, kHeaderBytes);
      n = std::clamp<int64_t>(n, 0, capacity - kHeaderBytes);
      throw Forwarded(std::string(data + kHeaderBytes, n));
    }
    if (total < 0 || total > kLargestTransfer) {
      throw std::runtime_error("rank " + std::to_string(peer) + " sent a malformed control transfer");
    }
    got.assign(data, std::min(total, capacity));
    if (total > capacity) {
      at::Tensor rest = Bytes(kHeaderBytes + total - capacity);
      link_->StartRecv(rest, peer, tag + 1).Wait();
      if (HeaderOf(rest) != total) {
        throw Forwarded("rank " + std::to_string(peer) + " stopped the control exchange");
      }
      got.append(static_cast<const char*>(rest.data_ptr()) + kHeaderBytes, total - capacity);
    }
  }
  for (PendingWork& send : sends) send.Wait();
  return got;
}

std::vector<std::string> Hypercube::Allgather(const std::string& mine, int64_t slot) {
  if (!failed_.empty()) throw std::runtime_error(failed_);
  std::vector<std::string> messages(size_);
  std::vector<bool> have(size_, false);
  messages[rank_] = mine;
  have[rank_] = true;
  if (size_ == 1) return messages;
  // A transfer of n messages fits its first part when each message fits its slot.
  auto capacity = [slot](size_t n) { return 4 + static_cast<int64_t>(n) * slot; };
  int current_peer = -1;
  auto take = [&](const std::string& packed, const std::vector<int>& expected) {
    std::vector<bool> came(size_, false);
    if (!UnpackMessages(packed, &messages, &came)) {
      throw std::runtime_error("rank " + std::to_string(current_peer) + " sent a malformed control transfer");
    }
    for (int r : expected) {
      if (!came[r]) {
        throw std::runtime_error("rank " + std::to_string(current_peer) + " left out rank " + std::to_string(r) +
                                 "'s control message");
      }
      have[r] = true;
    }
  };
  try {
    if (rank_ >= core_) {
      // Note [Control exchange by hypercube]: hand ours to rank - P, get every message back.
      current_peer = rank_ - core_;
      const std::string packed = PackMessages(messages, {rank_});
      out_capacity_ = capacity(1);
      Swap(current_peer, kFoldInTag, &packed, 0);
      std::vector<int> others;
      for (int r = 0; r < size_; ++r) {
        if (r != rank_) others.push_back(r);
      }
      take(Swap(current_peer, kFoldOutTag, nullptr, capacity(others.size())), others);
      return messages;
    }
    const int extra = rank_ + core_ < size_ ? rank_ + core_ : -1;
    if (extra >= 0) {
      current_peer = extra;
      take(Swap(extra, kFoldInTag, nullptr, capacity(1)), {extra});
    }
    for (int k = 0; k < steps_; ++k) {
      current_peer = rank_ ^ (1 << k);
      const std::vector<int> held = Held(rank_, k), theirs = Held(current_peer, k);
      const std::string packed = PackMessages(messages, held);
      out_capacity_ = capacity(held.size());
      take(Swap(current_peer, 2 * k, &packed, capacity(theirs.size())), theirs);
    }
    if (extra >= 0) {
      current_peer = extra;
      std::vector<int> theirs;  // every message but the one it sent
      for (int r = 0; r < size_; ++r) {
        if (r != extra) theirs.push_back(r);
      }
      const std::string packed = PackMessages(messages, theirs);
      out_capacity_ = capacity(theirs.size());
      Swap(extra, kFoldOutTag, &packed, 0);
    }
  } catch (const Forwarded& e) {
    Fail(e.what());
  } catch (const std::exception& e) {
    Fail("rank " + std::to_string(rank_) + " could not exchange control messages with rank " +
         std::to_string(current_peer) + ": " + e.what());
  }
  return messages;
}

std::string Hypercube::Reduce(const std::string& mine, const Combine& combine) {
  if (!failed_.empty()) throw std::runtime_error(failed_);
  if (size_ == 1) return mine;
  std::string acc = mine;
  out_capacity_ = kReduceSlot;
  int current_peer = -1;
  try {
    if (rank_ >= core_) {  // hand ours to rank - P, get the combination of all back
      current_peer = rank_ - core_;
      Swap(current_peer, kFoldInTag, &acc, 0);
      return Swap(current_peer, kFoldOutTag, nullptr, kReduceSlot);
    }
    const int extra = rank_ + core_ < size_ ? rank_ + core_ : -1;
    if (extra >= 0) {
      current_peer = extra;
      acc = combine(acc, Swap(extra, kFoldInTag, nullptr, kReduceSlot));
    }
    for (int k = 0; k < steps_; ++k) {
      current_peer = rank_ ^ (1 << k);
      acc = combine(acc, Swap(current_peer, 2 * k, &acc, kReduceSlot));
    }
    if (extra >= 0) {
      current_peer = extra;
      Swap(extra, kFoldOutTag, &acc, 0);
    }
  } catch (const Forwarded& e) {
    Fail(e.what());
  } catch (const std::exception& e) {
    Fail("rank " + std::to_string(rank_) + " could not exchange control messages with rank " +
         std::to_string(current_peer) + ": " + e.what());
  }
  return acc;
}

void Hypercube::Fail(const std::string& why) {
  // Note [Failures travel the hypercube]: every partner, on every tag it may be waiting on.
  failed_ = why;
  const std::string reason = why.substr(0, kReasonBytes);
  std::vector<std::pair<int, int>> targets;  // (peer, tag)
  if (rank_ >= core_) {
    targets.emplace_back(rank_ - core_, kFoldInTag);
  } else {
    if (rank_ + core_ < size_) targets.emplace_back(rank_ + core_, kFoldOutTag);
    for (int k = 0; k < steps_; ++k) targets.emplace_back(rank_ ^ (1 << k), 2 * k);
  }
  for (const auto& [peer, tag] : targets) {
    for (int part = 0; part < 2; ++part) {
      // The first tag gets the reason; the second (exactly sized buffers) the bare header.
      const int64_t n = part == 0 ? static_cast<int64_t>(reason.size()) : 0;
      poison_.push_back(Bytes(kHeaderBytes + (part == 0 ? kHeaderBytes + n : 0)));
      auto* p = static_cast<char*>(poison_.back().data_ptr());
      std::memcpy(p, &kFailed, kHeaderBytes);
      if (part == 0) {
        std::memcpy(p + kHeaderBytes, &n, kHeaderBytes);
        std::memcpy(p + 2 * kHeaderBytes, reason.data(), n);
      }
      try {
        poison_works_.push_back(link_->StartSend(poison_.back(), peer, tag + part));
      } catch (const std::exception&) {
        // That peer's connection is gone too; the others still get theirs.
      }
    }
  }
  throw std::runtime_error(why);
}

}  // namespace hvdlite
