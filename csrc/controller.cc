#include "controller.h"

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <functional>
#include <sstream>

namespace hvdlite {
namespace {

std::string DtypeName(int8_t dtype) {
  if (dtype < 0 || dtype >= static_cast<int8_t>(c10::ScalarType::NumOptions)) return "dtype?";
  return c10::toString(static_cast<c10::ScalarType>(dtype));
}

std::string DeviceName(int8_t device_type) {
  if (device_type < 0 || device_type >= static_cast<int8_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES))
    return "device?";
  return c10::DeviceTypeName(static_cast<c10::DeviceType>(device_type), /*lower_case=*/true);
}

std::string Number(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

// If the ranks' values of one field differ, describes who has what:
// "rank 0 has [17, 3]; ranks 1, 2 have [18, 3]".
std::string DescribeDisagreement(const std::vector<Request>& by_rank,
                                 const std::function<std::string(const Request&)>& value_of) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(by_rank.size()); ++r) {
    std::string value = value_of(by_rank[r]);
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == value; });
    if (it == groups.end()) {
      groups.push_back({value, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (groups.size() == 1) return "";
  std::ostringstream out;
  for (size_t i = 0; i < groups.size(); ++i) {
    out << (i ? "; " : "") << RanksString(groups[i].second)
        << (groups[i].second.size() == 1 ? " has " : " have ") << groups[i].first;
  }
  return out.str();
}

bool IsReduction(CollectiveKind kind) { return kind == CollectiveKind::kAllreduce; }

}  // namespace

std::string CheckAgreement(const std::vector<Request>& by_rank) {
  const Request& first = by_rank.front();
  const std::string prefix = std::string(KindName(first.kind)) + " of '" + first.name + "': ";
  struct Field {
    const char* what;
    bool applies;
    std::function<std::string(const Request&)> value_of;
  };
  const std::vector<Field> fields = {
      {"operation", true, [](const Request& r) { return std::string(KindName(r.kind)); }},
      {"device", true, [](const Request& r) { return DeviceName(r.device_type); }},
      {"dtype", true, [](const Request& r) { return DtypeName(r.dtype); }},
      {"reduce op", IsReduction(first.kind),
       [](const Request& r) { return std::string(ReduceOpName(r.op)); }},
      {"root rank", first.kind == CollectiveKind::kBroadcast,
       [](const Request& r) { return std::to_string(r.root); }},
      {"prescale factor", IsReduction(first.kind),
       [](const Request& r) { return Number(r.prescale); }},
      {"postscale factor", IsReduction(first.kind),
       [](const Request& r) { return Number(r.postscale); }},
      {"shape", first.kind != CollectiveKind::kAllgather,
       [](const Request& r) { return ShapeString(r.shape); }},
      {"number of dimensions", first.kind == CollectiveKind::kAllgather,
       [](const Request& r) { return std::to_string(r.shape.size()); }},
      {"shape beyond the first dimension", first.kind == CollectiveKind::kAllgather,
       [](const Request& r) {
         return ShapeString(std::vector<int64_t>(r.shape.begin() + std::min<size_t>(1, r.shape.size()),
                                                 r.shape.end()));
       }},
      {"group", true,
       [](const Request& r) {
         return r.group.empty() ? std::string("no group")
                                : "group '" + r.group + "' of " + std::to_string(r.group_size);
       }},
  };
  for (const Field& field : fields) {
    if (!field.applies) continue;
    std::string difference = DescribeDisagreement(by_rank, field.value_of);
    if (!difference.empty()) return prefix + field.what + " mismatch: " + difference;
  }
  return "";
}

Controller::Controller(int size, double stall_check_seconds, double stall_shutdown_seconds)
    : size_(size),
      stall_check_ms_(static_cast<int64_t>(stall_check_seconds * 1000)),
      stall_shutdown_ms_(static_cast<int64_t>(stall_shutdown_seconds * 1000)) {}

RoundResult Controller::ProcessRound(const std::vector<RankMessage>& messages) {
  RoundResult result;
  const int64_t now_ms = messages.front().clock_ms;
  bool any_request = false;
  result.all_outstanding = true;
  for (int rank = 0; rank < static_cast<int>(messages.size()); ++rank) {
    const RankMessage& message = messages[rank];
    if (message.flags & kFlagShutdown) result.shutdown = true;
    if (!(message.flags & kFlagHasOutstanding)) result.all_outstanding = false;
    for (const Request& request : message.requests) {
      any_request = true;
      Record(rank, request, now_ms, &result.ready);
    }
  }
  InspectStalls(now_ms, &result);
  result.quiet = !any_request && result.ready.empty();
  return result;
}

void Controller::Record(int rank, const Request& request, int64_t now_ms,
                        std::vector<ReadyItem>* ready) {
  auto inserted = pending_.try_emplace(request.name);
  Pending& pending = inserted.first->second;
  if (inserted.second) {
    pending.by_rank.resize(size_);
    pending.submitted.assign(size_, false);
    pending.first_seen_ms = now_ms;
  }
  if (pending.submitted[rank]) {
    // The tensor queue refuses a name that is already in flight, so this is a bug.
    ReadyItem item;
    item.request = request;
    item.status = Status(StatusCode::kInternal, std::string(KindName(request.kind)) + " of '" +
                                                    request.name + "': rank " +
                                                    std::to_string(rank) +
                                                    " submitted it twice in one negotiation");
    ready->push_back(std::move(item));
    return;
  }
  pending.by_rank[rank] = request;
  pending.submitted[rank] = true;
  if (++pending.count < size_) return;
  ReadyItem item = MakeReady(request.name, pending);
  pending_.erase(inserted.first);
  Release(std::move(item), ready);
}

ReadyItem Controller::MakeReady(const std::string& name, Pending& pending) {
  ReadyItem item;
  item.request = pending.by_rank.front();
  std::string mismatch = CheckAgreement(pending.by_rank);
  if (!mismatch.empty()) {
    item.status = Status(StatusCode::kMismatch, mismatch);
  } else if (item.request.kind == CollectiveKind::kAllgather) {
    for (const Request& r : pending.by_rank) item.rank_dim0.push_back(r.shape.empty() ? 1 : r.shape[0]);
  }
  (void)name;
  return item;
}

void Controller::Release(ReadyItem item, std::vector<ReadyItem>* ready) {
  if (item.request.group.empty()) {
    ready->push_back(std::move(item));
    return;
  }
  const std::string group = item.request.group;
  const int32_t group_size = item.request.group_size;
  auto& members = held_groups_[group];
  members.push_back(std::move(item));
  if (static_cast<int32_t>(members.size()) < group_size) return;
  // A grouped operation succeeds or fails as a whole.
  const ReadyItem* failed = nullptr;
  for (const ReadyItem& member : members) {
    if (!member.status.ok()) {
      failed = &member;
      break;
    }
  }
  if (failed) {
    Status status(failed->status.code(), "grouped operation '" + group +
                                             "' failed: " + failed->status.message());
    for (ReadyItem& member : members) member.status = status;
  }
  for (ReadyItem& member : members) ready->push_back(std::move(member));
  held_groups_.erase(group);
}

void Controller::InspectStalls(int64_t now_ms, RoundResult* result) {
  if (stall_check_ms_ <= 0 && stall_shutdown_ms_ <= 0) return;
  std::ostringstream table;
  std::vector<std::string> to_fail;
  for (auto& [name, pending] : pending_) {
    const int64_t waited = now_ms - pending.first_seen_ms;
    const bool fail = stall_shutdown_ms_ > 0 && waited >= stall_shutdown_ms_;
    const bool warn = stall_check_ms_ > 0 && waited >= stall_check_ms_ &&
                      (pending.warned_at_ms < 0 || now_ms - pending.warned_at_ms >= stall_check_ms_);
    if (!fail && !warn) continue;
    std::vector<int> missing, present;
    for (int r = 0; r < size_; ++r) (pending.submitted[r] ? present : missing).push_back(r);
    const Request& any = pending.by_rank[present.front()];
    std::string line = std::string(KindName(any.kind)) + " '" + name + "' (waiting " +
                       std::to_string(waited / 1000) + " s): missing " + RanksString(missing) +
                       ", submitted by " + RanksString(present);
    table << "\n  " << line;
    pending.warned_at_ms = now_ms;
    if (fail) {
      ReadyItem item;
      item.request = any;
      item.status = Status(StatusCode::kStall,
                           "stalled: " + line + "; failed after " +
                               std::to_string(stall_shutdown_ms_ / 1000) +
                               " s (HVDLITE_STALL_SHUTDOWN_TIME_SECONDS)");
      result->ready.push_back(std::move(item));
      to_fail.push_back(name);
    }
  }
  for (const std::string& name : to_fail) pending_.erase(name);
  if (table.tellp() > 0) {
    result->stall_warning =
        "stall: some ranks have not submitted tensors that others are waiting on "
        "(HVDLITE_STALL_CHECK_TIME_SECONDS):" + table.str();
  }
}

}  // namespace hvdlite
