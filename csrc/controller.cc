#include "controller.h"

#include <algorithm>
#include <functional>

#include "agreement.h"
#include "fusion.h"

namespace hvdlite {
namespace {

// Note [Agreement digest]: FNV-1a for strings, a multiply-xorshift step to chain values.
uint64_t HashString(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

uint64_t Chain(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h ^= h >> 31;
  return h * 0xbf58476d1ce4e5b9ULL;
}

}  // namespace

Controller::Controller(int size, double stall_check_seconds, double stall_shutdown_seconds,
                       size_t cache_capacity, bool average_over_contributors)
    : size_(size),
      stall_check_ms_(static_cast<int64_t>(stall_check_seconds * 1000)),
      stall_shutdown_ms_(static_cast<int64_t>(stall_shutdown_seconds * 1000)),
      joined_(size, false),
      cache_(cache_capacity, size),
      average_over_contributors_(average_over_contributors) {}

bool Controller::InStep(const std::vector<RankMessage>& messages) const {
  // Note [Rounds in step]
  // last_joined_ >= 0 exactly while some rank has joined (both are set and cleared together)
  if (!in_step_enabled_ || !pending_.empty() || !groups_.empty() || last_joined_ >= 0) {
    return false;
  }
  const std::vector<Request>& first = messages.front().requests;
  if (first.empty()) return false;
  for (const RankMessage& message : messages) {
    if (message.requests.size() != first.size()) return false;
  }
  for (size_t i = 0; i < first.size(); ++i) {
    if (!first[i].group.empty() || first[i].kind == CollectiveKind::kJoin) return false;
    for (size_t r = 1; r < messages.size(); ++r) {
      const Request& other = messages[r].requests[i];
      if (!other.group.empty() || other.kind == CollectiveKind::kJoin || other.name != first[i].name) return false;
    }
  }
  return true;
}

RoundResult Controller::ProcessRound(std::vector<RankMessage> messages) {
  RoundResult result;
  const int64_t now_ms = messages.front().clock_ms;
  bool any_request = false;
  result.all_outstanding = true;
  const bool in_step = InStep(messages);
  for (int rank = 0; rank < static_cast<int>(messages.size()); ++rank) {
    RankMessage& message = messages[rank];
    if (message.flags & kFlagShutdown) result.shutdown = true;
    if (!(message.flags & kFlagHasOutstanding)) result.all_outstanding = false;
    auto& requests = message.requests;
    any_request = any_request || !requests.empty();
    if (in_step) continue;
    for (size_t i = 0; i < requests.size();) {
      if (requests[i].group.empty()) {
        Record(rank, std::move(requests[i++]), now_ms, &result.ready);
        continue;
      }
      // Note [Grouped operations]: a group's members are consecutive in its rank's message.
      std::vector<Request> members;
      const std::string group = requests[i].group;
      while (i < requests.size() && requests[i].group == group) members.push_back(std::move(requests[i++]));
      RecordGroup(rank, std::move(members), now_ms, &result.ready);
    }
  }
  if (in_step) {
    ++in_step_rounds_;
    // Note [Rounds in step]: each name completes here, in the order of the messages, as the
    // slow path would complete it on the last rank's request; no table entry is made.
    Pending scratch;  // MakeReady moves the requests out and leaves the rest as it was
    scratch.by_rank.resize(size_);
    scratch.submitted.assign(size_, true);
    scratch.count = size_;
    scratch.first_seen_ms = now_ms;
    for (size_t i = 0; i < messages.front().requests.size(); ++i) {
      scratch.sequence = next_sequence_++;
      for (int r = 0; r < size_; ++r) scratch.by_rank[r] = std::move(messages[r].requests[i]);
      Decide(MakeReady(scratch), &result.ready);
    }
  }
  InspectStalls(now_ms, &result);
  result.quiet = !any_request && result.ready.empty();
  ChainDecisions(result.ready);
  return result;
}

void Controller::ChainDecisions(const std::vector<ReadyItem>& ready) {
  for (const ReadyItem& item : ready) {  // Note [Agreement digest]
    decisions_ = Chain(decisions_, HashString(item.request.name));
    decisions_ = Chain(decisions_, static_cast<uint64_t>(item.status.code()) |
                                                (static_cast<uint64_t>(item.contributors) << 8) |
                                                (static_cast<uint64_t>(item.inlined) << 40));
  }
}

bool Controller::CanRepeat(const std::vector<uint32_t>& ids) const {
  return std::all_of(ids.begin(), ids.end(),
                     [this](uint32_t id) { return id < repeatable_.size() && repeatable_[id].has_value(); });
}

RoundResult Controller::ProcessRepeated(const std::vector<uint32_t>& ids,
                                        std::vector<std::map<uint32_t, std::string>>* payloads, bool all_outstanding,
                                        bool all_idle, int64_t now_ms) {
  // Note [Cached rounds]: each id's decision is the one made when its entry was last recorded,
  // from the same requests (a cache hit is a request equal to its entry), so it is made again
  // as it was, with this round's payloads, as the in-step path would (Note [Rounds in step]).
  RoundResult result;
  result.all_outstanding = all_outstanding;
  for (uint32_t id : ids) {
    ReadyItem item = *repeatable_[id];
    const Request& request = item.request;
    const bool inlinable = request.kind == CollectiveKind::kAllreduce ||
                           request.kind == CollectiveKind::kAllgather || request.kind == CollectiveKind::kBroadcast;
    if (inlinable && std::all_of(payloads->begin(), payloads->end(), [id](const auto& p) { return p.count(id) > 0; })) {
      item.inlined = true;
      item.payloads.reserve(size_);
      for (auto& by_id : *payloads) item.payloads.push_back(std::move(by_id[id]));
    }
    cache_.Touch(id);
    ++next_sequence_;
    Decide(std::move(item), &result.ready);
  }
  if (!ids.empty()) ++in_step_rounds_;
  InspectStalls(now_ms, &result);
  result.quiet = all_idle && result.ready.empty();
  ChainDecisions(result.ready);
  return result;
}

void Controller::Remember(int64_t id, ReadyItem& item) {
  if (id < 0) return;
  if (repeatable_.size() <= static_cast<size_t>(id)) repeatable_.resize(id + 1);
  if (!item.status.ok() || !item.joined.empty() || item.contributors != size_ ||
      item.request.kind == CollectiveKind::kAlltoall || !item.request.group.empty()) {
    repeatable_[id].reset();
    return;
  }
  std::vector<std::string> payloads = std::move(item.payloads);  // not copied into the kept one
  item.payloads.clear();
  ReadyItem kept = item;
  item.payloads = std::move(payloads);
  kept.inlined = false;
  kept.last_rank = -1;
  kept.lag_us = 0;
  repeatable_[id] = std::move(kept);
}

uint64_t Controller::Digest() const {
  uint64_t h = Chain(decisions_, cache_.Fingerprint());
  h = Chain(h, pending_.size());
  return Chain(h, groups_.size());
}

Controller::Pending* Controller::Add(int rank, Request&& request, int64_t now_ms,
                                     std::vector<ReadyItem>* ready) {
  auto inserted = pending_.try_emplace(request.name);
  Pending& pending = inserted.first->second;
  if (inserted.second) {
    pending.by_rank.resize(size_);
    pending.submitted.assign(size_, false);
    pending.first_seen_ms = now_ms;
    pending.sequence = next_sequence_++;
    arrival_.emplace(pending.sequence, &inserted.first->first);  // node keys do not move
  }
  if (pending.submitted[rank]) {
    // The tensor queue refuses a name that is already in flight, so this is a bug.
    ReadyItem item;
    item.status = Status::Of(StatusCode::kInternal, KindName(request.kind), request.name,
                             "rank " + std::to_string(rank) + " submitted it twice in one negotiation",
                             {rank});
    item.request = std::move(request);
    ready->push_back(std::move(item));
    return nullptr;
  }
  pending.by_rank[rank] = std::move(request);
  pending.submitted[rank] = true;
  ++pending.count;
  return &pending;
}

void Controller::Record(int rank, Request&& request, int64_t now_ms, std::vector<ReadyItem>* ready) {
  const bool join = request.kind == CollectiveKind::kJoin;
  Pending* pending = Add(rank, std::move(request), now_ms, ready);
  if (pending == nullptr) return;
  if (join) {
    joined_[rank] = true;
    last_joined_ = rank;
    // Names this rank had not submitted may now be complete (Note [Join]); so may the
    // manifests of groups it had not submitted.
    std::vector<std::string> groups;
    for (const auto& [group, state] : groups_) groups.push_back(group);
    for (const std::string& group : groups) CheckManifests(group, ready);
    ReleaseCompleted(ready);
    return;
  }
  if (!Complete(*pending)) return;
  ReadyItem item = MakeReady(*pending);
  Erase(item.request.name);
  Decide(std::move(item), ready);
}

void Controller::RecordGroup(int rank, std::vector<Request>&& members, int64_t now_ms,
                             std::vector<ReadyItem>* ready) {
  const std::string group = members.front().group;
  Group& state = groups_[group];
  state.manifests.resize(size_);
  std::vector<std::string> names;
  for (Request& member : members) {
    names.push_back(member.name);
    Add(rank, std::move(member), now_ms, ready);
  }
  state.manifests[rank] = names;
  if (!CheckManifests(group, ready)) return;
  for (const std::string& name : names) {
    auto it = pending_.find(name);
    if (it == pending_.end() || !Complete(it->second)) continue;
    ReadyItem item = MakeReady(it->second);
    Erase(name);
    Decide(std::move(item), ready);
    if (!groups_.count(group)) return;  // that member failed the group
  }
}

bool Controller::CheckManifests(const std::string& group, std::vector<ReadyItem>* ready) {
  Group& state = groups_.at(group);
  if (state.size > 0) return true;  // already compared and agreed
  // The common case without building any strings: every rank listed the same members.
  const std::vector<std::string>* first = nullptr;
  bool same = true;
  for (int r = 0; r < size_; ++r) {
    if (state.manifests[r].empty()) {
      if (!joined_[r]) return true;  // not every rank has submitted the group yet
      continue;
    }
    if (first == nullptr) first = &state.manifests[r];
    same = same && state.manifests[r] == *first;
  }
  if (first == nullptr) return true;
  if (same) {
    state.size = first->size();
    return true;
  }
  // They differ: describe who listed what, through the same grouping as field mismatches.
  std::vector<int> ranks;
  std::vector<Request> manifests;  // each manifest as a request's name and group size
  for (int r = 0; r < size_; ++r) {
    if (state.manifests[r].empty()) continue;
    ranks.push_back(r);
    Request listed;
    for (const std::string& name : state.manifests[r]) listed.name += (listed.name.empty() ? "'" : ", '") + name + "'";
    listed.group_size = static_cast<int32_t>(state.manifests[r].size());
    manifests.push_back(std::move(listed));
  }
  std::vector<int> differing;
  std::string difference = DescribeDisagreement(ranks, manifests, [](const Request& m) {
    return std::to_string(m.group_size) + (m.group_size == 1 ? " tensor (" : " tensors (") + m.name + ")";
  }, &differing);
  FailGroup(group, Status::Of(StatusCode::kMismatch, "", "", "members differ: " + difference, differing), ready);
  return false;
}

void Controller::FailGroup(const std::string& group, const Status& status, std::vector<ReadyItem>* ready) {
  auto found = groups_.find(group);
  if (found == groups_.end()) return;
  Group state = std::move(found->second);
  groups_.erase(found);
  // Every name any rank listed, in rank order, each once; held members first keep their items.
  std::vector<ReadyItem> failed = std::move(state.held);
  std::vector<std::string> names;
  for (const ReadyItem& item : failed) names.push_back(item.request.name);
  for (const auto& manifest : state.manifests) {
    for (const std::string& name : manifest) {
      if (std::find(names.begin(), names.end(), name) != names.end()) continue;
      names.push_back(name);
      auto it = pending_.find(name);
      if (it == pending_.end()) continue;
      ReadyItem item;
      const Pending& pending = it->second;
      const int first = static_cast<int>(std::find(pending.submitted.begin(), pending.submitted.end(), true) -
                                         pending.submitted.begin());
      item.request = pending.by_rank[first];
      item.request.payload.clear();
      Erase(name);
      failed.push_back(std::move(item));
    }
  }
  const std::string kind = failed.empty() ? "collective" : KindName(failed.front().request.kind);
  // The group's own failure (manifests) has no member as its subject; a member's keeps it.
  Status group_status = status.op().empty() ? Status::Of(status.code(), "grouped " + kind, group, status.reason(), status.ranks())
                                            : status.Prefixed("grouped " + kind + " '" + group + "'");
  for (ReadyItem& item : failed) {
    item.status = group_status;
    ready->push_back(std::move(item));
  }
}

bool Controller::Complete(const Pending& pending) const {
  if (pending.count == size_) return true;
  const Request& any = pending.by_rank[std::find(pending.submitted.begin(), pending.submitted.end(), true) -
                                       pending.submitted.begin()];
  if (any.kind == CollectiveKind::kJoin) return false;
  for (int r = 0; r < size_; ++r) {
    if (!pending.submitted[r] && !joined_[r]) return false;
  }
  return true;
}

void Controller::ReleaseCompleted(std::vector<ReadyItem>* ready) {
  std::vector<std::string> complete;
  for (const auto& [sequence, name] : arrival_) {
    if (Complete(pending_.at(*name))) complete.push_back(*name);
  }
  for (const std::string& name : complete) {
    auto it = pending_.find(name);
    if (it == pending_.end()) continue;  // failed with its group meanwhile
    ReadyItem item = MakeReady(it->second);
    Erase(name);
    Decide(std::move(item), ready);
  }
}

void Controller::Erase(const std::string& name) {
  auto it = pending_.find(name);
  if (it == pending_.end()) return;
  arrival_.erase(it->second.sequence);
  pending_.erase(it);
}

ReadyItem Controller::MakeReady(Pending& pending) {
  // The pending entry is erased once the item is made: its requests are moved, not copied.
  ReadyItem item;
  std::vector<int> ranks;
  std::vector<Request> requests;
  for (int r = 0; r < size_; ++r) {
    if (pending.submitted[r]) {
      ranks.push_back(r);
      requests.push_back(std::move(pending.by_rank[r]));
    } else {
      item.joined.push_back(r);
    }
  }
  item.contributors = static_cast<int>(ranks.size());
  if (ranks.size() > 1) {  // Note [Straggler attribution]
    int64_t first = requests.front().submitted_us, last = first;
    item.last_rank = ranks.front();
    for (size_t i = 1; i < requests.size(); ++i) {
      const int64_t t = requests[i].submitted_us;
      first = std::min(first, t);
      if (t > last) last = t, item.last_rank = ranks[i];
    }
    item.lag_us = last - first;
  }
  item.average_divisor = average_over_contributors_ ? item.contributors : size_;
  // The lowest submitting rank's request becomes the item's, moved in last (payloads go to
  // item.payloads, not into the agreed request).
  const Request& request = requests.front();
  auto finished = [&]() -> ReadyItem {
    item.request = std::move(requests.front());
    item.request.payload.clear();
    return std::move(item);
  };
  auto mismatch = [&](std::string reason, std::vector<int> ranks) {
    return Status::Of(StatusCode::kMismatch, KindName(request.kind), request.name, std::move(reason),
                      std::move(ranks));
  };
  Status agreement = CheckAgreement(ranks, requests);
  if (!agreement.ok()) {
    item.status = agreement;
    return finished();
  }
  // Note [Cached rounds]: an entry that changed forgets its decision at once (a failure below
  // returns before a new one is kept); one decided again as it was keeps the one it has.
  int64_t cached_id = -1;
  if (request.kind != CollectiveKind::kJoin && request.kind != CollectiveKind::kBarrier) {
    bool changed = true;
    cached_id = cache_.Record(ranks, requests, &changed);
    if (cached_id >= 0 && static_cast<size_t>(cached_id) < repeatable_.size()) {
      if (!changed && repeatable_[cached_id].has_value()) {
        cached_id = -1;  // nothing to remember again
      } else {
        repeatable_[cached_id].reset();
      }
    }
  }
  // Note [Inline small tensors]: if every rank sent its data along, the data has arrived.
  const bool inlinable = request.kind == CollectiveKind::kAllreduce ||
                         request.kind == CollectiveKind::kAllgather ||
                         request.kind == CollectiveKind::kBroadcast;
  if (inlinable && item.joined.empty() &&
      std::all_of(requests.begin(), requests.end(), [](const Request& r) { return r.inlined; })) {
    item.inlined = true;
    for (Request& r : requests) item.payloads.push_back(std::move(r.payload));
  }
  if (request.kind == CollectiveKind::kJoin) {
    item.last_joined = last_joined_;
    joined_.assign(size_, false);
    last_joined_ = -1;
  } else if ((request.kind == CollectiveKind::kBroadcast || request.kind == CollectiveKind::kAllgather) &&
             !item.joined.empty()) {
    // Note [Join]: no allgather or broadcast while a rank has joined, as in horovod.torch.
    std::string joined;
    for (int r : item.joined) joined += (joined.empty() ? "" : ", ") + std::to_string(r);
    item.status = mismatch("not supported while " + std::string(item.joined.size() == 1 ? "rank " : "ranks ") +
                               joined + (item.joined.size() == 1 ? " has" : " have") +
                               " joined (a joined rank has no tensor to contribute); call it before join()" +
                               std::string(request.kind == CollectiveKind::kAllgather
                                               ? " (DistributedOptimizer sends sparse gradients by allgather: "
                                                 "pass sparse_as_dense=True)"
                                               : ""),
                           item.joined);
  } else if (request.kind == CollectiveKind::kAllgather) {
    item.rank_dim0.assign(size_, 0);
    for (size_t i = 0; i < ranks.size(); ++i) {
      const auto& shape = requests[i].shape;
      item.rank_dim0[ranks[i]] = shape.empty() ? 1 : shape[0];
    }
  } else if (request.kind == CollectiveKind::kAlltoall) {
    item.rank_splits.assign(size_, std::vector<int64_t>(size_, 0));  // joined ranks send nothing
    for (size_t i = 0; i < ranks.size(); ++i) {
      const int r = ranks[i];
      const Request& mine = requests[i];
      int64_t rows = 0;
      for (int64_t n : mine.splits) rows += n;
      if (static_cast<int>(mine.splits.size()) != size_ || mine.shape.empty() || rows != mine.shape[0]) {
        item.status = mismatch("rank " + std::to_string(r) + " sent splits that do not cover " +
                                   ShapeString(mine.shape) + " across " + std::to_string(size_) + " ranks", {r});
        return finished();
      }
      item.rank_splits[r] = mine.splits;
    }
  }
  ReadyItem done = finished();
  Remember(cached_id, done);
  return done;
}

void Controller::Decide(ReadyItem&& item, std::vector<ReadyItem>* ready) {
  if (item.request.group.empty()) {
    ready->push_back(std::move(item));
    return;
  }
  // Note [Grouped operations]
  const std::string group = item.request.group;
  auto found = groups_.find(group);
  if (found == groups_.end()) {  // cannot happen: members are recorded with their group
    item.status = Status::Of(StatusCode::kInternal, KindName(item.request.kind), item.request.name,
                             "member of unknown group '" + group + "'");
    ready->push_back(std::move(item));
    return;
  }
  if (!item.status.ok()) {
    Status status = item.status;
    found->second.held.push_back(std::move(item));
    FailGroup(group, status, ready);
    return;
  }
  Group& state = found->second;
  state.held.push_back(std::move(item));
  if (state.size == 0 || state.held.size() < state.size) return;
  for (ReadyItem& member : state.held) ready->push_back(std::move(member));
  groups_.erase(found);
}

void Controller::InspectStalls(int64_t now_ms, RoundResult* result) {
  // (an ostringstream costs a locale's set-up in every round of a 4-byte loop; measured:
  // docs/performance.md, Design measurements)
  if ((stall_check_ms_ <= 0 && stall_shutdown_ms_ <= 0) || arrival_.empty()) return;
  std::ostringstream table;
  std::vector<ReadyItem> stalled;
  for (const auto& [sequence, key] : arrival_) {  // arrival order: the same on every rank
    const std::string& name = *key;
    Pending& pending = pending_.at(name);
    const int64_t waited = now_ms - pending.first_seen_ms;
    const bool fail = stall_shutdown_ms_ > 0 && waited >= stall_shutdown_ms_;
    const bool warn = stall_check_ms_ > 0 && waited >= stall_check_ms_ &&
                      (pending.warned_at_ms < 0 || now_ms - pending.warned_at_ms >= stall_check_ms_);
    if (!fail && !warn) continue;
    std::vector<int> missing, present;
    for (int r = 0; r < size_; ++r) {
      if (pending.submitted[r]) {
        present.push_back(r);
      } else if (!joined_[r]) {
        missing.push_back(r);
      }
    }
    const Request& any = pending.by_rank[present.front()];
    const std::string waiting = "missing " + RanksString(missing) + ", submitted by " + RanksString(present);
    table << "\n  " << KindName(any.kind) << " '" << name << "' (waiting " << waited / 1000 << " s): " << waiting;
    pending.warned_at_ms = now_ms;
    if (fail) {
      ReadyItem item;
      item.request = any;
      item.request.payload.clear();
      item.status = Status::Of(StatusCode::kStall, KindName(any.kind), name,
                               "stalled for " + std::to_string(waited / 1000) + " s: " + waiting +
                                   "; failed after " + std::to_string(stall_shutdown_ms_ / 1000) +
                                   " s (HVDLITE_STALL_SHUTDOWN_TIME_SECONDS)",
                               missing);
      stalled.push_back(std::move(item));
    }
  }
  // A stalled member fails its whole group (Note [Grouped operations]).
  for (ReadyItem& item : stalled) {
    if (!pending_.count(item.request.name)) continue;  // failed with its group already
    if (!item.request.group.empty() && groups_.count(item.request.group)) {
      const std::string group = item.request.group;
      const Status status = item.status;
      FailGroup(group, status, &result->ready);
      continue;
    }
    Erase(item.request.name);
    result->ready.push_back(std::move(item));
  }
  if (table.tellp() > 0) {
    result->stall_warning =
        "stall: some ranks have not submitted tensors that others are waiting on "
        "(HVDLITE_STALL_CHECK_TIME_SECONDS):" + table.str();
  }
}

// Note [Flight record] (recorder.h): the pending table as the flight recorder shows it.
std::vector<PendingCollective> Controller::PendingView(int64_t now_ms) const {
  std::vector<PendingCollective> out;
  for (const auto& [sequence, key] : arrival_) {
    const Pending& pending = pending_.at(*key);
    PendingCollective view;
    view.name = *key;
    view.waited_ms = now_ms - pending.first_seen_ms;
    for (int r = 0; r < size_; ++r) {
      if (pending.submitted[r]) {
        if (view.submitted.empty()) {
          view.kind = pending.by_rank[r].kind;
          view.bytes = RequestBytes(pending.by_rank[r]);
        }
        view.submitted.push_back(r);
      } else if (!joined_[r]) {
        view.missing.push_back(r);
      }
    }
    out.push_back(std::move(view));
  }
  return out;
}

}  // namespace hvdlite
