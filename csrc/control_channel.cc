#include "control_channel.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>

namespace hvdlite {

SlotSizer::SlotSizer(int size) : cap_(std::max<int64_t>(kMinSlotBytes, kRoundBytes / std::max(size, 1))) {}

int64_t SlotSizer::Next(const std::vector<int64_t>& lengths) {
  // Note [Slots sized by the last rounds]
  int64_t longest = 0;
  for (int64_t length : lengths) longest = std::max(longest, length);
  longest = std::clamp<int64_t>(longest, 0, cap_);  // a corrupt length cannot overflow below
  const int64_t wanted = longest + longest / 8 + 8 /* the header */;
  const int64_t fitting = std::clamp<int64_t>((wanted + 1023) / 1024 * 1024, kMinSlotBytes, cap_);
  if (fitting >= slot_) {
    slot_ = fitting;
    calm_ = 0;
  } else if (++calm_ >= kCalmRounds) {
    slot_ = fitting;
    calm_ = 0;
  }
  return slot_;
}

ControlChannel::ControlChannel(CollectiveBackend* backend, ShmChannel* shm, int rank, int size,
                               int64_t alltoall_max)
    : backend_(backend), shm_(shm), size_(size), by_alltoall_(size <= alltoall_max && !(backend != nullptr && backend->point_to_point_only())),
      sizer_(size),
      cube_(backend, rank, size) {
  slot_now_ = sizer_.slot();
  if (shm_ == nullptr && by_alltoall_) Resize();
}

std::vector<int> ControlChannel::Peers(int rank, int size, int64_t alltoall_max) {
  if (size > alltoall_max) return Hypercube(nullptr, rank, size).Peers();
  std::vector<int> peers;
  for (int r = 0; r < size; ++r)
    if (r != rank) peers.push_back(r);
  return peers;
}

void ControlChannel::Resize() {
  slot_bytes_ = sizer_.slot();
  slot_now_ = slot_bytes_;
  slot_splits_.assign(size_, slot_bytes_);
  auto options = at::TensorOptions().dtype(at::kByte);
  send_ = at::zeros({slot_bytes_ * size_}, options);
  receive_ = at::zeros({slot_bytes_ * size_}, options);
}

std::vector<std::string> ControlChannel::Exchange(const std::string& mine) {
  if (shm_ != nullptr) {
    std::vector<std::string> messages;
    std::vector<int64_t> lengths;
    if (shm_->Exchange(mine, &messages, &lengths)) return messages;
    return ExchangeLarge(mine, lengths);
  }
  if (!by_alltoall_) return ExchangeByHypercube(mine);
  // Note [Control exchange by alltoall]: the same slot goes to every rank. Only the used part
  // of each copy is written; the rest of the slot is never read.
  auto* send = static_cast<char*>(send_.data_ptr());
  const int64_t length = static_cast<int64_t>(mine.size());
  const bool fits = length <= slot_bytes_ - kHeaderBytes;
  for (int r = 0; r < size_; ++r) {
    char* slot = send + r * slot_bytes_;
    std::memcpy(slot, &length, kHeaderBytes);
    if (fits) std::memcpy(slot + kHeaderBytes, mine.data(), mine.size());
  }
  backend_->Alltoall(receive_, send_, slot_splits_, slot_splits_);
  rounds_.fetch_add(1, std::memory_order_relaxed);

  std::vector<int64_t> lengths(size_);
  int64_t longest = 0;
  const auto* received = static_cast<const char*>(receive_.data_ptr());
  for (int r = 0; r < size_; ++r) {
    std::memcpy(&lengths[r], received + r * slot_bytes_, kHeaderBytes);
    if (lengths[r] < 0) lengths[r] = 0;  // a corrupt length decodes as an empty message
    longest = std::max(longest, lengths[r]);
  }
  std::vector<std::string> messages(size_);
  if (longest <= slot_bytes_ - kHeaderBytes) {
    for (int r = 0; r < size_; ++r) messages[r].assign(received + r * slot_bytes_ + kHeaderBytes, lengths[r]);
  } else {
    second_exchanges_.fetch_add(1, std::memory_order_relaxed);
    messages = ExchangeLarge(mine, lengths);
  }
  // Note [Slots sized by the last rounds]: every rank read the same lengths, so every rank
  // resizes alike, between rounds.
  if (sizer_.Next(lengths) != slot_bytes_) Resize();
  return messages;
}

std::vector<std::string> ControlChannel::ExchangeByHypercube(const std::string& mine) {
  std::vector<std::string> messages = cube_.Allgather(mine, sizer_.slot());
  rounds_.fetch_add(1, std::memory_order_relaxed);
  std::vector<int64_t> lengths(messages.size());
  bool fitted = true;
  for (size_t r = 0; r < messages.size(); ++r) {
    lengths[r] = static_cast<int64_t>(messages[r].size());
    fitted = fitted && lengths[r] <= sizer_.slot() - kHeaderBytes;
  }
  if (!fitted) second_exchanges_.fetch_add(1, std::memory_order_relaxed);
  // Note [Slots sized by the last rounds]: every rank read the same lengths.
  slot_now_ = sizer_.Next(lengths);
  return messages;
}

std::string ControlChannel::Reduce(const std::string& mine, const Hypercube::Combine& combine) {
  std::string combined = cube_.Reduce(mine, combine);
  reductions_.fetch_add(1, std::memory_order_relaxed);
  return combined;
}

std::vector<std::string> ControlChannel::ExchangeLarge(const std::string& mine, const std::vector<int64_t>& lengths) {
  // Someone's message did not fit in a slot: exchange every message at the longest length.
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  std::vector<std::string> messages(size_);
  auto options = at::TensorOptions().dtype(at::kByte);
  at::Tensor big_send = at::empty({longest}, options);
  at::Tensor big_receive = at::empty({longest * size_}, options);
  std::memcpy(big_send.data_ptr(), mine.data(), mine.size());
  std::vector<at::Tensor> slots;
  for (int r = 0; r < size_; ++r) slots.push_back(big_receive.narrow(0, r * longest, longest));
  backend_->Allgather(big_send, slots);
  const auto* big = static_cast<const char*>(big_receive.data_ptr());
  for (int r = 0; r < size_; ++r) {
    messages[r].assign(big + r * longest, std::clamp<int64_t>(lengths[r], 0, longest));
  }
  return messages;
}

}  // namespace hvdlite
