#include "message.h"

#include <algorithm>
#include <cstring>

namespace hvdlite {
namespace {

// "HVL" and the protocol version: catches a peer speaking something else.
constexpr uint32_t kMagic = 0x48564c00 + kProtocolVersion;
constexpr uint32_t kMaxNameBytes = 1u << 20;
constexpr uint32_t kMaxDims = 64;
constexpr uint32_t kMaxSplits = 1u << 20;
constexpr uint32_t kMaxPayloadBytes = 1u << 20;
constexpr uint8_t kTagFull = 0;
constexpr uint8_t kTagCached = 1;         // cache id only: the common case in a training loop
constexpr uint8_t kTagCachedInline = 2;   // cache id plus inline payload
constexpr uint32_t kMaxRequests = 1u << 24;
constexpr uint32_t kMaxReasonBytes = 4096;

class Writer {
 public:
  template <typename T>
  void Put(T value) {
    char bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));
    out_.append(bytes, sizeof(T));
  }
  void PutString(const std::string& s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  Reader(const char* data, size_t size) : data_(data), left_(size) {}
  template <typename T>
  bool Get(T* value) {
    if (left_ < sizeof(T)) return false;
    std::memcpy(value, data_, sizeof(T));
    data_ += sizeof(T);
    left_ -= sizeof(T);
    return true;
  }
  bool GetString(std::string* s, uint32_t max_bytes) {
    uint32_t n = 0;
    if (!Get(&n) || n > max_bytes || n > left_) return false;
    s->assign(data_, n);
    data_ += n;
    left_ -= n;
    return true;
  }
  size_t left() const { return left_; }

 private:
  const char* data_;
  size_t left_;
};

// Names come from Python str objects, so they are UTF-8; anything else is corruption (and
// would fail later, when an error message carrying the name is turned into a Python str).
bool ValidUtf8(const std::string& s) {
  auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = byte(i);
    if (c < 0x80) {
      ++i;
      continue;
    }
    // Strict UTF-8 (as Python decodes it): no overlong forms, surrogates or code points past
    // U+10FFFF. `low`/`high` bound the second byte; later ones are 0x80..0xBF.
    size_t length = 0;
    unsigned char low = 0x80, high = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) length = 2;
    else if (c == 0xE0) length = 3, low = 0xA0;
    else if (c == 0xED) length = 3, high = 0x9F;
    else if (c >= 0xE1 && c <= 0xEF) length = 3;
    else if (c == 0xF0) length = 4, low = 0x90;
    else if (c >= 0xF1 && c <= 0xF3) length = 4;
    else if (c == 0xF4) length = 4, high = 0x8F;
    else return false;
    if (s.size() - i < length) return false;
    if (byte(i + 1) < low || byte(i + 1) > high) return false;
    for (size_t k = 2; k < length; ++k) {
      if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return false;
    }
    i += length;
  }
  return true;
}

bool ReadRequest(Reader& in, Request* r) {
  uint8_t kind = 0, op = 0;
  uint32_t ndim = 0;
  if (!in.GetString(&r->name, kMaxNameBytes) || !ValidUtf8(r->name) || !in.Get(&kind) || !in.Get(&r->dtype) ||
      !in.Get(&r->device_type) || !in.Get(&op) || !in.Get(&r->root) || !in.Get(&r->prescale) ||
      !in.Get(&r->postscale) || !in.Get(&ndim))
    return false;
  if (kind >= kNumCollectiveKinds || op > kMaxReduceOp || ndim > kMaxDims) return false;
  r->kind = static_cast<CollectiveKind>(kind);
  r->op = static_cast<ReduceOp>(op);
  r->shape.resize(ndim);
  for (uint32_t d = 0; d < ndim; ++d) {
    if (!in.Get(&r->shape[d]) || r->shape[d] < 0) return false;
  }
  uint32_t nsplits = 0;
  if (!in.GetString(&r->group, kMaxNameBytes) || !ValidUtf8(r->group) || !in.Get(&r->group_size) ||
      r->group_size < 0 || !in.Get(&nsplits) || nsplits > kMaxSplits)
    return false;
  r->splits.resize(nsplits);
  for (uint32_t i = 0; i < nsplits; ++i) {
    if (!in.Get(&r->splits[i]) || r->splits[i] < 0) return false;
  }
  return true;
}

bool ReadPayload(Reader& in, Request* r) {
  uint8_t inlined = 0;
  if (!in.Get(&inlined) || inlined > 1) return false;
  r->inlined = inlined == 1;
  return in.GetString(&r->payload, kMaxPayloadBytes);
}

// Note [Submission times]: microseconds from `base_us` to `submitted_us`, clamped.
int32_t SinceBase(int64_t submitted_us, int64_t base_us) {
  constexpr int64_t kLimit = 2100000000;  // 35 minutes
  return static_cast<int32_t>(std::max(-kLimit, std::min(kLimit, submitted_us - base_us)));
}

void WritePayload(Writer& out, const Request& r) {
  out.Put<uint8_t>(r.inlined ? 1 : 0);
  out.PutString(r.payload);
}

}  // namespace

bool Request::SameAs(const Request& o) const {
  return name == o.name && kind == o.kind && dtype == o.dtype && device_type == o.device_type &&
         op == o.op && root == o.root && prescale == o.prescale && postscale == o.postscale &&
         shape == o.shape && group == o.group && group_size == o.group_size && splits == o.splits;
}

bool PeekDigests(const char* data, size_t size, uint64_t* settings, uint64_t* state) {
  Reader in(data, size);
  uint32_t magic = 0;
  return in.Get(&magic) && magic == kMagic && in.Get(settings) && in.Get(state);
}

std::string EncodeRankMessage(const RankMessage& message, const CacheLookup& lookup) {
  Writer out;
  out.Put<uint32_t>(kMagic);
  out.Put<uint64_t>(message.settings_digest);
  out.Put<uint64_t>(message.state_digest);
  out.Put<uint32_t>(message.flags);
  out.Put<int64_t>(message.clock_ms);
  out.Put<int64_t>(message.base_us);
  if (message.flags & kFlagTuned) {
    out.Put<int64_t>(message.tuned.fusion_threshold_bytes);
    out.Put<double>(message.tuned.cycle_time_ms);
  }
  if (message.flags & kFlagShutdown) out.PutString(message.shutdown_reason);
  out.Put<uint32_t>(static_cast<uint32_t>(message.requests.size()));
  for (const Request& r : message.requests) {
    const int32_t id = lookup ? lookup(r) : -1;
    const int32_t since = SinceBase(r.submitted_us, message.base_us);
    if (id >= 0) {
      out.Put<uint8_t>(r.inlined ? kTagCachedInline : kTagCached);
      out.Put<int32_t>(since);
      out.Put<uint32_t>(static_cast<uint32_t>(id));
      if (r.inlined) out.PutString(r.payload);
      continue;
    }
    out.Put<uint8_t>(kTagFull);
    out.Put<int32_t>(since);
    out.PutString(r.name);
    out.Put<uint8_t>(static_cast<uint8_t>(r.kind));
    out.Put<int8_t>(r.dtype);
    out.Put<int8_t>(r.device_type);
    out.Put<uint8_t>(static_cast<uint8_t>(r.op));
    out.Put<int32_t>(r.root);
    out.Put<double>(r.prescale);
    out.Put<double>(r.postscale);
    out.Put<uint32_t>(static_cast<uint32_t>(r.shape.size()));
    for (int64_t d : r.shape) out.Put<int64_t>(d);
    out.PutString(r.group);
    out.Put<int32_t>(r.group_size);
    out.Put<uint32_t>(static_cast<uint32_t>(r.splits.size()));
    for (int64_t n : r.splits) out.Put<int64_t>(n);
    WritePayload(out, r);
  }
  return out.Take();
}

// The shortest request on the wire: its tag, `since` and a cached id. A count that the bytes
// left cannot hold is corrupt before any request is read, so a flipped count byte costs no
// allocation of millions of Requests (it once took seconds and gigabytes to reject).
constexpr size_t kMinRequestBytes = sizeof(uint8_t) + sizeof(int32_t) + sizeof(uint32_t);

Status DecodeRankMessage(const char* data, size_t size, RankMessage* out,
                         const CacheResolve& resolve) {
  Reader in(data, size);
  uint32_t magic = 0, count = 0;
  RankMessage message;
  auto read_tuned = [&] {  // Note [Autotune]: present with kFlagTuned, right after the clock
    TunedParams& t = message.tuned;
    return !(message.flags & kFlagTuned) ||
           (in.Get(&t.fusion_threshold_bytes) && in.Get(&t.cycle_time_ms) &&
            t.fusion_threshold_bytes >= 0 && t.cycle_time_ms >= 0.0 && t.cycle_time_ms <= 60000.0);
  };
  if (!in.Get(&magic) || magic != kMagic || !in.Get(&message.settings_digest) ||
      !in.Get(&message.state_digest) || !in.Get(&message.flags) ||
      !in.Get(&message.clock_ms) || !in.Get(&message.base_us) || !read_tuned() ||
      ((message.flags & kFlagShutdown) && !in.GetString(&message.shutdown_reason, kMaxReasonBytes)) ||
      !in.Get(&count) || count > kMaxRequests || count > in.left() / kMinRequestBytes) {
    return Status(StatusCode::kInternal, "malformed control message header (" +
                                             std::to_string(size) + " bytes)");
  }
  message.requests.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    uint8_t tag = 0;
    int32_t since = 0;
    bool ok = in.Get(&tag) && in.Get(&since);
    if (ok && (tag == kTagCached || tag == kTagCachedInline)) {
      uint32_t id = 0;
      Request& r = message.requests[i];
      ok = in.Get(&id) && resolve && resolve(id, &r);
      r.submitted_us = since;
      r.inlined = tag == kTagCachedInline;
      r.payload.clear();
      if (ok && r.inlined) ok = in.GetString(&r.payload, kMaxPayloadBytes);
      if (!ok) {
        return Status(StatusCode::kInternal, "malformed control message: request " +
                                                 std::to_string(i) + " refers to an unknown cached request");
      }
      continue;
    }
    if (!ok || tag != kTagFull || !ReadRequest(in, &message.requests[i]) ||
        !ReadPayload(in, &message.requests[i])) {
      return Status(StatusCode::kInternal, "malformed control message: request " +
                                               std::to_string(i) + " of " +
                                               std::to_string(count) + " is corrupt");
    }
    message.requests[i].submitted_us = since;
  }
  if (in.left() != 0) {
    return Status(StatusCode::kInternal, "malformed control message: " +
                                             std::to_string(in.left()) + " trailing bytes");
  }
  *out = std::move(message);
  return Status::Ok();
}

}  // namespace hvdlite
