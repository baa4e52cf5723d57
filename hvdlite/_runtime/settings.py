"""Job-wide settings and the build check, agreed by every rank at init().

Note [Job-wide settings] (csrc/config.h) says why the settings that feed the replicated
controller must be the job's, not a rank's. At init() every rank publishes a record in the
rendezvous store: its hvdlite version, native build and protocol, the job-wide HVDLITE_*
variables set in its environment, and any error its own settings raise. After every rank's
record is read (the reading is a rendezvous of all ranks), every rank reaches the same verdict
from the same records:
  - ranks running different builds fail init() on every rank, naming the builds;
  - a rank whose settings are invalid fails init() on every rank, naming the rank and value;
  - otherwise each rank runs with rank 0's job-wide variables plus its own per-rank ones (log
    level, timeline, autotune log), and logs one warning per job-wide variable whose own value
    differs from rank 0's.
"""

import os
import sys

from .. import __version__
from .native import _core
from ..exceptions import MismatchError, SettingsError

# A test hook: a rank with this set runs with its own job-wide values, so that tests can show
# what the per-round settings digest does when ranks do differ (tests/multirank/test_agreement.py).
_TEST_OWN_SETTINGS = "HVDLITE_TEST_OWN_JOB_SETTINGS"


# horovodrun's variables that mean the same as hvdlite's (same units); HOROVOD_LOG_LEVEL's
# "fatal" has no hvdlite level and is read as "error".
HOROVOD_ALIASES = {f"HOROVOD_{name}": f"HVDLITE_{name}" for name in (
    "FUSION_THRESHOLD", "CYCLE_TIME", "CACHE_CAPACITY", "TIMELINE", "STALL_CHECK_TIME_SECONDS",
    "STALL_SHUTDOWN_TIME_SECONDS", "LOG_LEVEL", "AUTOTUNE", "AUTOTUNE_LOG", "HIERARCHICAL_ALLREDUCE")}


def with_aliases(env, rank=0, warn=True):
    """`env` with HOROVOD_* variables read as their HVDLITE_* names (the HVDLITE_ name wins,
    with one warning when both are set and differ)."""
    out = dict(env)
    for alias, name in HOROVOD_ALIASES.items():
        value = env.get(alias)
        if not value:
            continue
        if alias == "HOROVOD_LOG_LEVEL":
            value = {"fatal": "error"}.get(value.lower(), value.lower())
        if env.get(name):
            if env[name] != value and warn:
                print(f"[hvdlite rank {rank}] WARNING: both {name}={env[name]} and {alias}={env[alias]} "
                      f"are set; {name} is used", file=sys.stderr, flush=True)
            continue
        out[name] = value
    if env.get("HOROVOD_STALL_CHECK_DISABLE") == "1" and not env.get("HVDLITE_STALL_CHECK_TIME_SECONDS"):
        out["HVDLITE_STALL_CHECK_TIME_SECONDS"] = "0"
    return out


def _job_wide(env):
    return {name: env[name] for name in _core.JOB_WIDE_SETTINGS if env.get(name)}


def _per_rank(env):
    return {name: value for name, value in env.items()
            if name.startswith("HVDLITE_") and name not in _core.JOB_WIDE_SETTINGS}


def _error(mapping):
    try:
        _core._parse_config(mapping)
    except ValueError as exc:
        return str(exc)
    return None


def own_record(rank, env=None):
    """What this rank publishes about its build and settings."""
    env = with_aliases(os.environ if env is None else env, rank)
    own = _job_wide(env)
    # Only the values this rank will run with are validated here: its per-rank variables and,
    # on rank 0, the job-wide ones (the others' job-wide values are not used).
    error = _error({**_per_rank(env), **(own if rank == 0 else {})})
    return {"version": __version__, "build": _core.BUILD_ID, "protocol": _core.PROTOCOL_VERSION,
            "settings": own, "error": error}


def _build(record):
    return f"hvdlite {record['version']} (build {record['build']}, protocol {record['protocol']})"


def check_records(records):
    """Raises on every rank if the ranks' builds differ or any rank's settings are invalid."""
    builds = {}
    for r, record in enumerate(records):
        builds.setdefault(_build(record), []).append(r)
    if len(builds) > 1:
        described = "; ".join(f"{'rank' if len(ranks) == 1 else 'ranks'} "
                              f"{', '.join(map(str, ranks))} {'runs' if len(ranks) == 1 else 'run'} {build}"
                              for build, ranks in builds.items())
        differing = sorted(r for build, ranks in builds.items() if 0 not in ranks for r in ranks)
        raise MismatchError(f"hvdlite.init(): the ranks run different hvdlite builds: {described}; "
                            "install the same hvdlite on every host", op="init", ranks=differing)
    errors = [(r, record["error"]) for r, record in enumerate(records) if record.get("error")]
    if errors:
        described = "; ".join(f"rank {r}: {error}" for r, error in errors)
        raise SettingsError(f"hvdlite.init(): invalid settings on {'rank' if len(errors) == 1 else 'ranks'} "
                            f"{', '.join(str(r) for r, _ in errors)} (job-wide settings are rank 0's): "
                            f"{described}", op="init", ranks=[r for r, _ in errors])


def in_force(records, rank, env=None):
    """The HVDLITE_* mapping this rank's engines run with; warns about overridden values."""
    env = with_aliases(os.environ if env is None else env, rank, warn=False)
    ours = _job_wide(env)
    if env.get(_TEST_OWN_SETTINGS) == "1":
        return {**_per_rank(env), **ours}
    theirs = records[0]["settings"]
    if rank != 0:
        for name in _core.JOB_WIDE_SETTINGS:
            if ours.get(name) != theirs.get(name):
                mine = ours.get(name, "unset")
                in_effect = theirs.get(name, "unset (the default)")
                print(f"[hvdlite rank {rank}] WARNING: {name}={mine} on this rank differs from rank 0's "
                      f"{in_effect}; rank 0's value is in force for the whole job "
                      "(job-wide settings, see the README's configuration table)",
                      file=sys.stderr, flush=True)
    return {**_per_rank(env), **theirs}
