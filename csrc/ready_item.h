// ReadyItem: one decision of a negotiation round, the same on every rank: a tensor that every
// rank has submitted (or a failure to report for it). The controller makes them, the planner
// batches them and the executor runs them. Pure data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "message.h"
#include "status.h"

namespace hvdlite {

struct ReadyItem {
  Request request;                 // the agreed request (the lowest submitting rank's)
  std::vector<int64_t> rank_dim0;  // allgather: every rank's first dimension (0 if joined)
  std::vector<std::vector<int64_t>> rank_splits;  // alltoall: [sender][receiver] rows
  std::vector<int> joined;         // ranks that take part with a neutral input (Note [Join])
  int contributors = 0;            // ranks that submitted it
  int average_divisor = 0;         // what an Average divides by (Note [Join] in controller.h)
  int last_joined = -1;            // join: the rank that joined last
  bool inlined = false;            // every rank's data came with its request (payloads)
  std::vector<std::string> payloads;  // by rank, when inlined (Note [Inline small tensors])
  Status status;                   // not ok: this tensor fails on every rank with this status
  // Note [Straggler attribution] (recorder.h): the contributor that submitted it last, and how
  // long after the first (job clock); -1 and 0 with fewer than two contributors.
  int last_rank = -1;
  int64_t lag_us = 0;
};

}  // namespace hvdlite
