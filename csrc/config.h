// Config: every tunable of the core, filled once from HVDLITE_* variables when an engine is
// created. Parsing is strict and an invalid value is an error naming the variable and the
// value. Immutable after creation (the engine keeps a const copy), so any thread may read it
// without a lock. Each variable is one row of the table in config.cc (Note [One table of
// settings]), which parsing, the job-wide list and the digest all read.
//
// Note [Job-wide settings]
// The replicated controller is correct only while every rank feeds it the same inputs (Note
// [Replicated negotiation] in controller.h), and most settings are such inputs: the fusion
// threshold decides the batches, the cache capacity the ids on the wire, the inline limit and
// the stall times what a round decides. So those settings are the job's, not a rank's:
// hvd.init() takes rank 0's values of the variables in JobWideVariables() (published once
// through the rendezvous store) and hands every engine the same mapping; a rank whose own
// environment differs logs a warning naming the variable. The log level, the timeline path
// and the autotune log stay per rank. As a defence in depth every control message carries
// JobWideDigest() of the settings in force, and a rank whose digest differs stops the job
// with an error naming it before anything is decided (engine.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "status.h"
#include "types.h"

namespace hvdlite {

struct Config {
  // HVDLITE_FUSION_THRESHOLD: bytes per fused buffer; 0 disables fusion.
  int64_t fusion_threshold_bytes = 64LL * 1024 * 1024;
  // HVDLITE_CYCLE_TIME: milliseconds; the shortest time between the starts of two consecutive
  // busy cycles, which lets tensors that arrive close together share one fused collective.
  // An engine that has been idle starts a cycle as soon as a request arrives.
  double cycle_time_ms = 0.5;
  // HVDLITE_IDLE_HEARTBEAT_MS: how often an idle engine still joins a negotiation round, so a
  // peer that waits on it can progress, check for stalls and notice failures.
  // Shortened to 100 ms for two seconds after activity (Note [Cycle policy] in engine.h).
  double idle_heartbeat_ms = 1000.0;
  // HVDLITE_STALL_CHECK_TIME_SECONDS: warn about tensors some ranks have not submitted.
  double stall_check_seconds = 60.0;
  // HVDLITE_STALL_SHUTDOWN_TIME_SECONDS: fail such tensors after this long (0 = never).
  // Shorter than the process groups' 300 s timeout, so a stall is reported as a stall.
  double stall_shutdown_seconds = 240.0;
  // HVDLITE_CACHE_CAPACITY: names whose requests are remembered (Note [Response cache]);
  // 0 disables the cache.
  int64_t cache_capacity = 1024;
  // HVDLITE_INLINE_BYTES: CPU tensors up to this size travel inside the negotiation round
  // (Note [Inline small tensors]); 0 disables inlining.
  int64_t inline_bytes = 512;
  // HVDLITE_GATHER_BYTES / HVDLITE_GATHER_MAX_MS: a round with less than this many new bytes
  // waits for more, for a waiting caller, or this long (Note [Gathering by size] in engine.h);
  // 0 bytes disables the hold.
  int64_t gather_bytes = 4LL << 20;
  double gather_max_ms = 100.0;
  // HVDLITE_CPU_CHANNELS: Gloo process groups that carry CPU data; large allreduces are cut
  // into chunks spread over them (Note [CPU channels] in cpu_route.h). Rank 0's value applies
  // to the job.
  int64_t cpu_channels = 4;
  // HVDLITE_CONTROL_ALLTOALL_MAX: engines of up to this many ranks exchange negotiation
  // messages across hosts by one alltoall, larger ones by recursive doubling (Note [Control
  // exchange by alltoall] in control_channel.h). Rank 0's value applies to the job.
  int64_t control_alltoall_max = 16;
  // HVDLITE_CONTROL_LINK: 1 (default) sends negotiation across hosts over the control link's
  // own connections, by recursive doubling (Note [Control link] in control_link.h); 0 through
  // a Gloo group, as HVDLITE_CONTROL_ALLTOALL_MAX says. Rank 0's value applies to the job.
  bool control_link = true;
  // HVDLITE_CACHED_ROUNDS: 1 (default) lets those larger engines settle a steady round by a
  // reduction of a few words per rank (Note [Cached rounds] in cached_round.h); 0: every round
  // carries every rank's message. Rank 0's value applies to the job.
  bool cached_rounds = true;
  // HVDLITE_SHARED_MEMORY: 1 (default) lets an engine whose ranks all run on one host allreduce
  // CPU tensors through shared memory (Note [Shared-memory allreduce] in shm_channel.h); 0
  // keeps everything on Gloo. Rank 0's value applies to the job.
  bool shared_memory = true;
  // HVDLITE_SINGLE_COPY: 1 (default) lets such an engine allreduce large CPU tensors straight
  // between the ranks' memory where the kernel allows it (Note [Single-copy allreduce] in
  // shm_channel.h); 0 keeps the staged path. Rank 0's value applies to the job.
  bool single_copy = true;
  // HVDLITE_SHM_POINT_TO_POINT: 1 (default) lets a torch.distributed group whose ranks all run
  // on one host send and receive through its segment (Note [Point-to-point through shared
  // memory] in shm_point_to_point.h); 0 sends through Gloo. Rank 0's value applies to the job.
  bool shm_point_to_point = true;
  // HVDLITE_HIERARCHICAL_ALLREDUCE: 1 makes an engine whose ranks span several hosts reduce
  // CPU tensors inside each host first (Note [Hierarchical allreduce] in cpu_route.h); 0
  // (default) runs one flat allreduce over every rank. Rank 0's value applies to the job.
  bool hierarchical_allreduce = false;
  // HVDLITE_CALLER_ROUNDS: 1 (default) lets a caller that blocks on a small result (or on
  // allreduces it has sent before) run the negotiation round itself when the background thread
  // is idle (Note [A waiting caller runs the round] in round_driver.h); 0 leaves every round to the
  // background thread. Per rank.
  bool caller_rounds = true;
  // HVDLITE_AUTOTUNE: 1 makes rank 0 search the fusion threshold and cycle time during the
  // first samples of the job (Note [Autotune] in autotune.h); the two above are its start.
  bool autotune = false;
  // HVDLITE_AUTOTUNE_SAMPLE_SECONDS: the wall time each autotune sample covers.
  double autotune_sample_seconds = 0.5;
  // HVDLITE_AUTOTUNE_LOG: rank 0 appends one CSV line per autotune sample to this file.
  std::string autotune_log_path;
  // HVDLITE_TIMELINE: path of a Chrome trace to write (see timeline.h); empty: none.
  std::string timeline_path;
  // HVDLITE_LOG_LEVEL: trace, debug, info, warning (default) or error.
  LogLevel log_level = LogLevel::kWarning;
  // HVDLITE_JOIN_AVERAGE: what an Average divides by while some ranks have joined (Note [Join]
  // in controller.h): "size" (every rank of the set, as horovod.torch and DDP's Join) or
  // "contributors" (only the ranks that submitted data).
  bool average_over_contributors = false;
  // HVDLITE_STRAGGLER_REPORT_SECONDS: rank 0 logs the consistently last rank this often (Note
  // [Straggler attribution] in recorder.h); 0 (default) never.
  double straggler_report_seconds = 0.0;
  // HVDLITE_STRAGGLER_MIN_LAG_MS: the median lag below which no rank is called a straggler.
  double straggler_min_lag_ms = 10.0;
  // HVDLITE_FLIGHT_RECORDER_ROUNDS: rounds each engine remembers for dumps (Note [Flight
  // record] in recorder.h); 0 remembers none.
  int64_t flight_recorder_rounds = 64;
  // HVDLITE_TEST_FORGET_CACHE_AT_ROUND: a test hook (per rank): after this many negotiation
  // rounds this rank's controller forgets its response cache, so its state diverges from the
  // other ranks' the way a bug would make it (Note [Agreement digest] in controller.h). -1: never.
  int64_t test_forget_cache_round = -1;

  // Reads the variables through `lookup` (getenv in production, a map in unit tests).
  static Status FromLookup(const std::function<const char*(const char*)>& lookup, Config* out);
};

// The variables of Note [Job-wide settings], in a fixed order.
const std::vector<std::string>& JobWideVariables();
// A digest of the job-wide fields of `config` (Note [Job-wide settings]).
uint64_t JobWideDigest(const Config& config);

// Hands every shown field of `config` to the callback of its type, under its Python name
// (Note [One table of settings] in config.cc); the binding builds _parse_config's dict so.
struct SettingVisitor {
  std::function<void(const char*, int64_t)> integer;
  std::function<void(const char*, double)> number;
  std::function<void(const char*, bool)> flag;
  std::function<void(const char*, const std::string&)> text;
};
void VisitSettings(const Config& config, const SettingVisitor& visit);

}  // namespace hvdlite
