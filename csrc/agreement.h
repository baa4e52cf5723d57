// The agreement check (Note [Replicated negotiation] in controller.h): whether the requests
// that the ranks made for one name agree in every field that must agree, and the error that
// names the field, who has what and the ranks that differ. Pure functions; the controller
// calls them on whichever thread runs the round.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "message.h"
#include "status.h"

namespace hvdlite {

// Compares the requests that `ranks` made for one name (by_rank[i] is ranks[i]'s). Returns Ok
// when they agree, else the kMismatch status naming the field, the values and the ranks that
// differ from the lowest rank.
Status CheckAgreement(const std::vector<int>& ranks, const std::vector<Request>& by_rank);

// If the ranks' values of one field differ, describes who has what ("rank 0 has [17, 3];
// ranks 1, 2 have [18, 3]") and adds the ranks whose value differs from the lowest rank's to
// `differing`; "" where they all agree.
std::string DescribeDisagreement(const std::vector<int>& ranks, const std::vector<Request>& by_rank,
                                 const std::function<std::string(const Request&)>& value_of,
                                 std::vector<int>* differing);

}  // namespace hvdlite
