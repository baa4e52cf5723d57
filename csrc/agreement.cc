// The agreement check: whether the requests that the ranks made for one name agree in every
// field that must agree (kind, dtype, device, op, root, scale factors, shape), and if not, the
// kMismatch status that names the field, who has what and the ranks that differ. Pure
// functions of their arguments; the controller calls them on whichever thread runs the round.
#include "agreement.h"

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

}  // namespace

std::string DescribeDisagreement(const std::vector<int>& ranks, const std::vector<Request>& by_rank,
                                 const std::function<std::string(const Request&)>& value_of,
                                 std::vector<int>* differing) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (size_t i = 0; i < by_rank.size(); ++i) {
    std::string value = value_of(by_rank[i]);
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == value; });
    if (it == groups.end()) {
      groups.push_back({value, {ranks[i]}});
    } else {
      it->second.push_back(ranks[i]);
    }
  }
  if (groups.size() == 1) return "";
  std::ostringstream out;
  for (size_t i = 0; i < groups.size(); ++i) {
    out << (i ? "; " : "") << RanksString(groups[i].second)
        << (groups[i].second.size() == 1 ? " has " : " have ") << groups[i].first;
    if (i > 0) differing->insert(differing->end(), groups[i].second.begin(), groups[i].second.end());
  }
  std::sort(differing->begin(), differing->end());
  return out.str();
}

namespace {

bool IsReduction(CollectiveKind kind) {
  return kind == CollectiveKind::kAllreduce || kind == CollectiveKind::kReducescatter;
}

bool CarriesData(CollectiveKind kind) {
  return kind != CollectiveKind::kBarrier && kind != CollectiveKind::kJoin;
}

// Kinds whose ranks may send different numbers of rows along dimension 0.
bool RowsMayDiffer(CollectiveKind kind) {
  return kind == CollectiveKind::kAllgather || kind == CollectiveKind::kAlltoall;
}

// The common case, checked without building any strings: every rank's request matches the
// first one in every field that must agree.
bool ObviouslyAgree(const std::vector<Request>& by_rank) {
  const Request& first = by_rank.front();
  const bool rows_differ = RowsMayDiffer(first.kind);
  for (size_t i = 1; i < by_rank.size(); ++i) {
    const Request& r = by_rank[i];
    if (r.kind != first.kind || r.dtype != first.dtype || r.device_type != first.device_type ||
        r.op != first.op || r.root != first.root || r.prescale != first.prescale ||
        r.postscale != first.postscale || r.group != first.group || r.group_size != first.group_size ||
        r.shape.size() != first.shape.size())
      return false;
    if (!std::equal(r.shape.begin() + (rows_differ && !r.shape.empty() ? 1 : 0), r.shape.end(),
                    first.shape.begin() + (rows_differ && !first.shape.empty() ? 1 : 0)))
      return false;
  }
  return true;
}

}  // namespace

Status CheckAgreement(const std::vector<int>& ranks, const std::vector<Request>& by_rank) {
  if (ObviouslyAgree(by_rank)) return Status::Ok();
  const Request& first = by_rank.front();
  const bool data = CarriesData(first.kind);
  struct Field {
    const char* what;
    bool applies;
    std::function<std::string(const Request&)> value_of;
  };
  const std::vector<Field> fields = {
      {"operation", true, [](const Request& r) { return std::string(KindName(r.kind)); }},
      {"device", data, [](const Request& r) { return DeviceName(r.device_type); }},
      {"dtype", data, [](const Request& r) { return DtypeName(r.dtype); }},
      {"reduce op", IsReduction(first.kind),
       [](const Request& r) { return std::string(ReduceOpName(r.op)); }},
      {"root rank", first.kind == CollectiveKind::kBroadcast,
       [](const Request& r) { return std::to_string(r.root); }},
      {"prescale factor", IsReduction(first.kind),
       [](const Request& r) { return Number(r.prescale); }},
      {"postscale factor", IsReduction(first.kind),
       [](const Request& r) { return Number(r.postscale); }},
      {"shape", data && !RowsMayDiffer(first.kind),
       [](const Request& r) { return ShapeString(r.shape); }},
      {"number of dimensions", RowsMayDiffer(first.kind),
       [](const Request& r) { return std::to_string(r.shape.size()); }},
      {"shape beyond the first dimension", RowsMayDiffer(first.kind),
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
    std::vector<int> differing;
    std::string difference = DescribeDisagreement(ranks, by_rank, field.value_of, &differing);
    if (!difference.empty()) {
      return Status::Of(StatusCode::kMismatch, KindName(first.kind), first.name,
                        std::string(field.what) + " mismatch: " + difference, differing);
    }
  }
  return Status::Ok();
}

}  // namespace hvdlite
