"""This rank's own failure, reported once to whoever launched it.

Note [Failure reports]
When one rank fails, the others fail after it, and the launcher's summary must name the one
that started it. So hvd.init() installs a sys.excepthook (chained to the previous one) that
records a rank's uncaught exception: rank, host, pid, time, type, message, where it was raised
(the innermost frame outside hvdlite and torch) and the last frames. A failure caused by a peer
(ShutdownError, RankFailureError, a StallError naming only other ranks) is
marked as a consequence, with the ranks it points at. The record goes
  - to hvdliterun's rendezvous store, under keys.failure(rank) (a fresh connection from the
    HVDLITE_RENDEZVOUS_* variables, so it works even when init() itself failed);
  - under torchrun, to TORCHELASTIC_ERROR_FILE in torchrun's error-file format, so torchrun's
    own summary names it.
The same record gives the shutdown at exit its reason ("exiting after RuntimeError: ..."),
which the other ranks' errors quote. hvdlite.runner.run's rank task reports the exception its
function raised the same way. A rank that exits non-zero without an exception reports nothing;
the launcher then goes by its exit code.
"""

import json
import math
import os
import socket
import sys
import time
import traceback

from .. import exceptions
from . import state as _state
from .._job import keys
from .._job.rendezvous import LauncherStore

_CONSEQUENCES = (exceptions.ShutdownError, exceptions.RankFailureError)


def _rank():
    for name in ("HVDLITE_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _consequence_of(exc, rank):
    """The ranks a failure points at when it was caused by them, else None."""
    ranks = [r for r in (getattr(exc, "ranks", None) or []) if r != rank]
    if isinstance(exc, _CONSEQUENCES):
        return ranks
    if isinstance(exc, exceptions.StallError) and ranks \
            and rank not in (exc.ranks or []):
        return ranks
    return None


def _where(tb):
    frames = traceback.extract_tb(tb)
    if not frames:
        return None
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hvdlite/, not _runtime/
    outside = [f for f in frames
               if not os.path.abspath(f.filename).startswith(package) and "/torch/" not in f.filename]
    frame = (outside or frames)[-1]
    return {"file": os.path.basename(frame.filename), "line": frame.lineno}


def record_for(exc, tb=None):
    rank = _rank()
    tb = tb if tb is not None else exc.__traceback__
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
            "type": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else "",
            "where": _where(tb),
            "traceback": "".join(traceback.format_tb(tb)[-5:]) + "".join(traceback.format_exception_only(type(exc), exc)),
            "consequence_of": _consequence_of(exc, rank)}


def _deliver(record):
    env = os.environ
    from .._job.wire import RendezvousError
    try:
        launcher = LauncherStore.from_env(env)
    except ValueError:  # a port that is not a number: the exit code still tells the launcher
        launcher = None
    if launcher is not None:
        try:
            client = launcher.client(rank=record["rank"], connect_timeout=3.0)
            client.call(b"SET", [keys.failure(record["rank"]).encode(), json.dumps(record).encode()])
            client.close()
        except (RendezvousError, OSError, ValueError):
            pass  # the launcher may be gone; the exit code still tells it something
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if path:
        # torchrun's format (what its @record decorator writes). torchrun names the failure with
        # the earliest timestamp, in whole seconds, and breaks ties by local rank; a root cause
        # rounds its time down and a consequence (which happened after it) rounds up, so a tie
        # can never put a consequence first.
        seconds = math.floor(record["time"]) if record["consequence_of"] is None else math.ceil(record["time"])
        message = f"{record['type']}: {record['message']}"
        if record["where"]:
            message += f" ({record['where']['file']}, line {record['where']['line']})"
        data = {"message": {"message": message, "extraInfo": {
            "py_callstack": record["traceback"], "timestamp": str(seconds)}}}
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            pass


def report(exc, tb=None):
    """Reports `exc` as this rank's failure (once per process); returns the record."""
    process = _state.process
    if process.failure_report is None:
        process.failure_report = record_for(exc, tb)
        _deliver(process.failure_report)
    return process.failure_report


def exit_reason():
    """Why this process shuts hvdlite down at exit, for the other ranks' errors ('' if unknown)."""
    reported = _state.process.failure_report
    if reported is None:
        return ""
    return f"exiting after {reported['type']}: {reported['message']}"


def install():
    """Chains a sys.excepthook that reports uncaught exceptions (idempotent)."""
    if _state.process.failure_hook_installed:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if not issubclass(exc_type, KeyboardInterrupt):
            try:
                report(exc, tb)
            except Exception:  # noqa: BLE001 - reporting must never hide the error itself
                pass
        previous(exc_type, exc, tb)

    sys.excepthook = hook
    _state.process.failure_hook_installed = True
