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
  if (!entry.present[rank] || !entry.by_rank[rank].SameAs(request)) return -1;
  return static_cast<int32_t>(it->second);
}

bool ResponseCache::Resolve(int rank, uint32_t id, Request* out) const {
  if (id >= entries_.size() || rank < 0 || rank >= size_) return false;
  const Entry& entry = entries_[id];
  if (entry.name.empty() || !entry.present[rank]) return false;
  *out = entry.by_rank[rank];
  return true;
}

void ResponseCache::Record(const std::vector<int>& ranks, const std::vector<Request>& by_rank) {
  if (capacity_ == 0) return;
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
    entry.by_rank.assign(size_, Request());
    entry.present.assign(size_, false);
    by_name_[name] = id;
    fingerprint_ ^= IdHash(id, name);
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    entry.by_rank[ranks[i]] = by_rank[i];
    entry.by_rank[ranks[i]].payload.clear();
    entry.by_rank[ranks[i]].inlined = false;
    entry.present[ranks[i]] = true;
  }
}

void ResponseCache::Clear() {
  entries_.clear();
  by_name_.clear();
  recency_.clear();
  fingerprint_ = 0;
}

}  // namespace hvdlite
