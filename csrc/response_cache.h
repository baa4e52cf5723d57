// ResponseCache: the requests each rank made for names that were negotiated before, so a
// repeated request travels as a 4-byte id instead of its full description. Owned by the
// Controller and used by whichever thread holds the engine's round lock (Note [A waiting caller
// runs the round] in round_driver.h); no locking of its own.
//
// Note [Response cache]
// Training loops submit the same names with the same shapes every step. Every rank keeps an
// identical cache: the Controller records each ready name's per-rank requests in the order it
// emits them, the same on every rank (Note [Replicated negotiation] in controller.h), so ids
// and evictions agree everywhere without any extra message. A sender looks its new request up
// in the cache as it stood after the previous round; receivers resolve ids against the same
// state, because decoding happens before the round is processed. Anything that differs from
// the cached request (a new name, another shape or op) is sent in full, and the cache entry is
// replaced when that name is ready again. Least recently used entries are evicted past
// HVDLITE_CACHE_CAPACITY (0 disables the cache).
#pragma once

#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include "message.h"

namespace hvdlite {

class ResponseCache {
 public:
  ResponseCache(size_t capacity, int size);

  // The id under which `rank` last made exactly this request, or -1.
  int32_t Lookup(int rank, const Request& request) const;
  // Fills `out` with `rank`'s request cached under `id`; false if there is none.
  bool Resolve(int rank, uint32_t id, Request* out) const;
  // Records the requests `ranks` made for a name that just became ready (by_rank[i] is
  // ranks[i]'s; payloads are not kept); returns its id, or -1 with no cache. `changed`: false
  // when the entry already held exactly these requests (where given).
  int64_t Record(const std::vector<int>& ranks, const std::vector<Request>& by_rank, bool* changed = nullptr);
  // `id` was used again as it stands (Note [Cached rounds] in cached_round.h): most recent now.
  void Touch(uint32_t id) { recency_.splice(recency_.begin(), recency_, entries_[id].recency); }

  size_t entries() const { return by_name_.size(); }
  bool enabled() const { return capacity_ > 0; }
  uint32_t id_space() const { return static_cast<uint32_t>(entries_.size()); }
  // Which names sit under which ids, as one number (Note [Agreement digest] in controller.h).
  uint64_t Fingerprint() const { return fingerprint_ ^ entries_.size(); }
  // Forgets everything (a test hook that makes one rank's cache diverge).
  void Clear();

 private:
  // Every rank's request, as indices into the distinct ones: where every rank sent the same
  // request, one copy and 4 bytes per rank (a ResNet-50 step at 16,384 ranks: 587 MB of
  // tables with a copy per rank; docs/performance.md).
  static constexpr uint32_t kAbsent = UINT32_MAX;  // the rank has no request under this name
  struct Entry {
    std::string name;
    std::vector<Request> distinct;
    std::vector<uint32_t> of_rank;  // index into distinct, or kAbsent
    std::list<uint32_t>::iterator recency;
  };
  size_t capacity_;
  int size_;
  std::vector<Entry> entries_;                       // indexed by id
  std::unordered_map<std::string, uint32_t> by_name_;
  std::list<uint32_t> recency_;                      // most recently used first
  uint64_t fingerprint_ = 0;                         // XOR of IdHash over (id, name)
};

}  // namespace hvdlite
