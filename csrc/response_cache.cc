#include "response_cache.h"

#include <iterator>

namespace hvdlite {
namespace {

uint64_t IdHash(uint32_t id, const std::string& name) {
  uint64_t h = 1469598103934665603ULL ^ id;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ULL;
  return h;
}

}  // namespace

ResponseCache::ResponseCache(size_t capacity, int size) : capacity_(capacity), size_(size) {}

int32_t ResponseCache::Lookup(int rank, const Request& request) const {
  auto it = by_name_.find(request.name);
  if (it == by_name_.end()) return -1;
  const Entry& entry = entries_[it->second];
  if (entry.of_rank[rank] == kAbsent || !entry.distinct[entry.of_rank[rank]].SameAs(request)) return -1;
  return static_cast<int32_t>(it->second);
}

bool ResponseCache::Resolve(int rank, uint32_t id, Request* out) const {
  if (id >= entries_.size() || rank < 0 || rank >= size_) return false;
  const Entry& entry = entries_[id];
  if (entry.name.empty() || entry.of_rank[rank] == kAbsent) return false;
  *out = entry.distinct[entry.of_rank[rank]];
  return true;
}

int64_t ResponseCache::Record(const std::vector<int>& ranks, const std::vector<Request>& by_rank, bool* changed) {
  if (changed != nullptr) *changed = true;
  if (capacity_ == 0) return -1;
  const std::string& name = by_rank.front().name;
  uint32_t id;
  auto found = by_name_.find(name);
  const bool is_new = found == by_name_.end();
  // A name seen before moves its recency node to the front (splice: no allocation, so a
  // round that only repeats names allocates nothing here that outlives it).
  if (!is_new) {
    id = found->second;
    recency_.splice(recency_.begin(), recency_, entries_[id].recency);
  } else if (entries_.size() < capacity_) {
    id = static_cast<uint32_t>(entries_.size());
    entries_.emplace_back();
    recency_.push_front(id);
  } else {
    id = recency_.back();  // evict the least recently used name
    recency_.splice(recency_.begin(), recency_, std::prev(recency_.end()));
    by_name_.erase(entries_[id].name);
    fingerprint_ ^= IdHash(id, entries_[id].name);
  }
  Entry& entry = entries_[id];
  entry.recency = recency_.begin();
  if (is_new) {
    entry.name = name;
    entry.distinct.clear();
    entry.of_rank.assign(size_, kAbsent);
    by_name_[name] = id;
    fingerprint_ ^= IdHash(id, name);
  }
  // A name decided again as it was (a training loop's steady state) changes nothing and
  // allocates nothing.
  bool same = !is_new;
  for (size_t i = 0; same && i < ranks.size(); ++i) {
    const uint32_t k = entry.of_rank[ranks[i]];
    same = k != kAbsent && entry.distinct[k].SameAs(by_rank[i]);
  }
  if (same) {
    if (changed != nullptr) *changed = false;
    return id;
  }
  // Rebuilt rank by rank, each request shared with the rank before when equal (where every
  // rank sent the same request, one copy): ranks that did not take part keep theirs.
  std::vector<Request> distinct;
  std::vector<uint32_t> of_rank(size_, kAbsent);
  size_t next = 0;
  for (int r = 0; r < size_; ++r) {
    const Request* request = nullptr;
    if (next < ranks.size() && ranks[next] == r) {
      request = &by_rank[next++];
    } else if (entry.of_rank[r] != kAbsent) {
      request = &entry.distinct[entry.of_rank[r]];
    }
    if (request == nullptr) continue;
    if (distinct.empty() || !distinct.back().SameAs(*request)) {
      distinct.push_back(*request);
      distinct.back().payload.clear();
      distinct.back().inlined = false;
    }
    of_rank[r] = static_cast<uint32_t>(distinct.size() - 1);
  }
  entry.distinct = std::move(distinct);
  entry.of_rank = std::move(of_rank);
  return id;
}

void ResponseCache::Clear() {
  entries_.clear();
  by_name_.clear();
  recency_.clear();
  fingerprint_ = 0;
}

}  // namespace hvdlite
