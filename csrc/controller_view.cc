// Controller::PendingView: the pending table as the flight recorder shows it (Note [Flight
// record] in recorder.h), kept apart from the negotiation itself.
#include "controller.h"
#include "fusion.h"

namespace hvdlite {

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
