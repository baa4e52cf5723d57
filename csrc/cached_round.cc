#include "cached_round.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "engine.h"
#include "timeline.h"

namespace hvdlite {
namespace {

// [u32 bitmap bytes][kWords x u64, ANDed][bitmap, ANDed][u32 sections][u32 rank, u32 length, section]...
// A section: [u32 entries][u32 id, u32 length, payload]...
enum Word { kFlags, kSettings, kNotSettings, kState, kNotState, kClock, kBase, kSpace, kWords };
constexpr uint64_t kClean = 1, kOutstanding = 2, kIdle = 4;
constexpr uint64_t kAll = ~uint64_t{0};
constexpr uint32_t kMaxBitmapBytes = 1u << 24;

struct Parsed {
  uint64_t words[kWords];
  std::string bitmap;
  std::map<uint32_t, std::string> sections;  // by rank
};

void PutU32(std::string* out, uint32_t v) { out->append(reinterpret_cast<const char*>(&v), 4); }

bool GetU32(const std::string& in, size_t* at, uint32_t* v) {
  if (in.size() - *at < 4) return false;
  std::memcpy(v, in.data() + *at, 4);
  *at += 4;
  return true;
}

std::string Encode(const Parsed& p) {
  std::string out;
  PutU32(&out, static_cast<uint32_t>(p.bitmap.size()));
  out.append(reinterpret_cast<const char*>(p.words), sizeof(p.words));
  out += p.bitmap;
  PutU32(&out, static_cast<uint32_t>(p.sections.size()));
  for (const auto& [rank, section] : p.sections) {  // ascending rank: canonical
    PutU32(&out, rank);
    PutU32(&out, static_cast<uint32_t>(section.size()));
    out += section;
  }
  return out;
}

bool Parse(const std::string& in, Parsed* p) {
  size_t at = 0;
  uint32_t bitmap_bytes = 0, count = 0;
  if (!GetU32(in, &at, &bitmap_bytes) || bitmap_bytes > kMaxBitmapBytes) return false;
  if (in.size() - at < sizeof(p->words) + bitmap_bytes) return false;
  std::memcpy(p->words, in.data() + at, sizeof(p->words));
  at += sizeof(p->words);
  p->bitmap.assign(in.data() + at, bitmap_bytes);
  at += bitmap_bytes;
  if (!GetU32(in, &at, &count) || count > (in.size() - at) / 8) return false;
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t rank = 0, length = 0;
    if (!GetU32(in, &at, &rank) || !GetU32(in, &at, &length) || in.size() - at < length) return false;
    if (!p->sections.emplace(rank, in.substr(at, length)).second) return false;
    at += length;
  }
  return at == in.size();
}

bool ParseSection(const std::string& in, std::map<uint32_t, std::string>* payloads) {
  size_t at = 0;
  uint32_t count = 0;
  if (!GetU32(in, &at, &count) || count > (in.size() - at) / 8) return false;
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t id = 0, length = 0;
    if (!GetU32(in, &at, &id) || !GetU32(in, &at, &length) || in.size() - at < length) return false;
    (*payloads)[id] = in.substr(at, length);
    at += length;
  }
  return at == in.size();
}

}  // namespace

std::string EncodeOffer(const CachedOffer& offer) {
  Parsed p;
  p.words[kFlags] = kAll & ~((offer.clean ? 0 : kClean) | (offer.outstanding ? 0 : kOutstanding) |
                              (offer.idle ? 0 : kIdle));
  p.words[kSettings] = offer.settings_digest;
  p.words[kNotSettings] = ~offer.settings_digest;
  p.words[kState] = offer.state_digest;
  p.words[kNotState] = ~offer.state_digest;
  p.words[kClock] = offer.rank == 0 ? static_cast<uint64_t>(offer.clock_ms) : kAll;
  p.words[kBase] = offer.rank == 0 ? static_cast<uint64_t>(offer.base_us) : kAll;
  p.words[kSpace] = offer.id_space | (static_cast<uint64_t>(~offer.id_space) << 32);
  p.bitmap.assign((offer.id_space + 7) / 8, '\0');
  for (uint32_t id : offer.ids) {
    if (id < offer.id_space) p.bitmap[id / 8] = static_cast<char>(p.bitmap[id / 8] | (1 << (id % 8)));
  }
  if (!offer.payloads.empty()) {
    std::string section;
    PutU32(&section, static_cast<uint32_t>(offer.payloads.size()));
    for (const auto& [id, payload] : offer.payloads) {
      PutU32(&section, id);
      PutU32(&section, static_cast<uint32_t>(payload.size()));
      section += payload;
    }
    p.sections.emplace(static_cast<uint32_t>(offer.rank), std::move(section));
  }
  return Encode(p);
}

std::string CombineOffers(const std::string& a, const std::string& b) {
  Parsed x, y;
  if (!Parse(a, &x) || !Parse(b, &y)) throw std::runtime_error("a malformed cached-round offer");
  for (int w = 0; w < kWords; ++w) x.words[w] &= y.words[w];
  // A shorter bitmap (another id space: the digests then disagree too) reads as zeros, so the
  // result has the longer length whichever comes first.
  const size_t common = std::min(x.bitmap.size(), y.bitmap.size());
  x.bitmap.resize(std::max(x.bitmap.size(), y.bitmap.size()), '\0');
  for (size_t i = 0; i < x.bitmap.size(); ++i) {
    x.bitmap[i] = i < common ? static_cast<char>(x.bitmap[i] & y.bitmap[i]) : '\0';
  }
  for (auto& [rank, section] : y.sections) {
    if (!x.sections.emplace(rank, std::move(section)).second) {
      throw std::runtime_error("two cached-round offers both carry rank " + std::to_string(rank) + "'s payloads");
    }
  }
  return Encode(x);
}

Status ReadVerdict(const std::string& combined, int size, CachedVerdict* out) {
  Parsed p;
  if (!Parse(combined, &p)) return Status(StatusCode::kInternal, "a malformed cached-round verdict");
  CachedVerdict v;
  v.all_clean = (p.words[kFlags] & kClean) != 0;
  v.all_outstanding = (p.words[kFlags] & kOutstanding) != 0;
  v.all_idle = (p.words[kFlags] & kIdle) != 0;
  v.agree = (p.words[kSettings] | p.words[kNotSettings]) == kAll && (p.words[kState] | p.words[kNotState]) == kAll &&
            ((p.words[kSpace] & 0xffffffffu) | (p.words[kSpace] >> 32)) == 0xffffffffu;
  v.clock_ms = static_cast<int64_t>(p.words[kClock]);
  v.base_us = static_cast<int64_t>(p.words[kBase]);
  const uint32_t space = static_cast<uint32_t>(p.words[kSpace] & 0xffffffffu);
  if (v.agree && p.bitmap.size() != (space + 7) / 8) {
    return Status(StatusCode::kInternal, "a cached-round verdict whose bitmap does not match its id space");
  }
  for (uint32_t id = 0; id < p.bitmap.size() * 8; ++id) {
    if (p.bitmap[id / 8] & (1 << (id % 8))) v.ready.push_back(id);
  }
  v.payloads.resize(size);
  for (const auto& [rank, section] : p.sections) {
    if (rank >= static_cast<uint32_t>(size) || !ParseSection(section, &v.payloads[rank])) {
      return Status(StatusCode::kInternal, "a malformed cached-round payload section");
    }
  }
  *out = std::move(v);
  return Status::Ok();
}

// The engine's side: its offer, and the round decided from the verdict.

bool Engine::CachedRound(RankMessage* mine, CachedVerdict* decided, int64_t* cache_hits) {
  // Note [Cached rounds]
  CachedOffer offer;
  offer.rank = rank_;
  offer.outstanding = (mine->flags & kFlagHasOutstanding) != 0;
  offer.settings_digest = mine->settings_digest;
  offer.state_digest = mine->state_digest;
  offer.clock_ms = mine->clock_ms;
  offer.base_us = mine->base_us;
  offer.id_space = controller_.id_space();
  const int64_t now_us = MonotonicMicros();
  offer.idle = mine->requests.empty();
  offer.clean = controller_.Settled() && (mine->flags & ~static_cast<uint32_t>(kFlagHasOutstanding)) == 0 &&
                (held_since_us_ == 0 || now_us - held_since_us_ <= kHoldMs * 1000);
  std::vector<uint32_t> ids;
  for (const Request& r : mine->requests) {
    const int32_t id = r.group.empty() ? controller_.CacheLookup(rank_, r) : -1;
    if (id < 0 || !offer.clean) {
      offer.clean = false;
      break;
    }
    ids.push_back(static_cast<uint32_t>(id));
    if (r.inlined) offer.payloads.emplace(static_cast<uint32_t>(id), r.payload);
  }
  if (offer.clean) offer.ids = ids;
  else offer.payloads.clear();
  CachedVerdict& verdict = *decided;
  Status read = ReadVerdict(channel_.Reduce(EncodeOffer(offer), CombineOffers), size_, &verdict);
  if (!read.ok()) throw std::runtime_error("rank " + std::to_string(rank_) + ": " + read.message());
  if (!verdict.all_clean || !verdict.agree) return false;
  // What is not ready everywhere stays here, in its order, for the next round.
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!std::binary_search(verdict.ready.begin(), verdict.ready.end(), ids[i])) {
      held_.push_back(std::move(mine->requests[i]));
    }
  }
  held_since_us_ = held_.empty() ? 0 : (held_since_us_ != 0 ? held_since_us_ : now_us);
  *cache_hits = static_cast<int64_t>(ids.size());
  cached_rounds_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

RoundResult Engine::DecideCached(CachedVerdict& verdict) {
  // Note [Cached rounds]: each ready id's decision is repeated from the controller's memory.
  if (controller_.CanRepeat(verdict.ready)) {
    return controller_.ProcessRepeated(verdict.ready, &verdict.payloads, verdict.all_outstanding, verdict.all_idle,
                                       verdict.clock_ms);
  }
  // An entry without a decision to repeat: every rank's requests for the ready ids, from the
  // cache, in id order, decided as a full round would decide them.
  std::vector<RankMessage> messages(size_);
  for (int r = 0; r < size_; ++r) {
    RankMessage& m = messages[r];
    m.flags = verdict.all_outstanding ? kFlagHasOutstanding : 0;
    m.clock_ms = verdict.clock_ms;
    m.base_us = verdict.base_us;
    m.requests.resize(verdict.ready.size());
    for (size_t i = 0; i < verdict.ready.size(); ++i) {
      Request& request = m.requests[i];
      if (!controller_.CacheResolve(r, verdict.ready[i], &request)) {
        throw std::runtime_error("rank " + std::to_string(rank_) + " has no cached request of rank " +
                                 std::to_string(r) + " under id " + std::to_string(verdict.ready[i]));
      }
      auto payload = verdict.payloads[r].find(verdict.ready[i]);
      request.inlined = payload != verdict.payloads[r].end();
      if (request.inlined) request.payload = std::move(payload->second);
      request.submitted_us = verdict.base_us;  // no lag: Note [Cached rounds]
    }
  }
  return controller_.ProcessRound(std::move(messages));
}

}  // namespace hvdlite
