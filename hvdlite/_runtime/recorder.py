"""The flight recorder's Python half: dump files with every thread's stack.

Note [Dump files]
One daemon thread per process ("hvdlite-recorder", started by the first init() or hvdlite
process group) waits on the engine's doorbell (Note [Dump requests] in csrc/recorder.h). When it
rings (SIGUSR1, a stall warning or failure, another rank's dump signal) it writes one JSON record
for this rank: the reasons, every engine's flight record (recent rounds, the collectives pending
now with the ranks that submitted them and those missing, what the engine thread is doing), and
the Python stack of every thread, with the innermost frame of the main thread that is the user's
own ("where": outside hvdlite, torch and the standard library). The record goes to
``<job dir>/dumps/<id>/rank<r>.json`` and, under hvdliterun, to the launcher's store
(keys.dump), where the launcher merges every rank's into one report (hvdlite/_job/dumps.py).
The id is the same on every rank for a job-wide dump (the engine's label and round), so the
files of one event share a directory. The job directory is HVDLITE_JOB_DIR (hvdliterun sets
it), else ``<tmp>/hvdlite-jobs/<job>`` named after the launcher's job id or rank 0's pid.
A signal whose job-wide round never comes (the engine thread is stuck in a collective) still
dumps this rank, under an id of its own, after DUMP_SIGNAL_WAIT seconds.
HVDLITE_FLIGHT_RECORDER=0 turns all of it off: no thread, no signal handler.
"""

import atexit
import json
import os
import signal
import socket
import sys
import sysconfig
import tempfile
import threading
import time
import traceback

from . import state as _state
from .native import _core
from .._job import keys
from .._job.rendezvous import LauncherStore

DUMP_SIGNAL_WAIT = 2.5   # seconds a signalled rank waits for the job-wide round (heartbeat <= 1 s)
PENDING_TIMEOUT = 2.5    # seconds an engine thread has to list its pending collectives
_STOP = "hvdlite: the recorder stops"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hvdlite/
_LIBRARY = tuple(p for p in {sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")} if p)


def enabled():
    return os.environ.get("HVDLITE_FLIGHT_RECORDER", "1") != "0"


def start(rank):
    """Starts the recorder thread and the SIGUSR1 handler once per process (idempotent), and
    registers this process as `rank` in the job directory (Note [Job directory] in
    runner/dump.py: only registered processes are sent SIGUSR1)."""
    process = _state.process
    if not enabled():
        return
    _register(rank)
    with process.lock:  # callers do not hold it (init() starts this after its own section)
        if process.recorder_thread is not None:
            return
        _core.install_dump_signal(signal.SIGUSR1)
        thread = threading.Thread(target=_loop, name="hvdlite-recorder", daemon=True)
        process.recorder_thread = thread
    thread.start()
    atexit.register(_stop, thread)


def _register(rank):
    directory = os.path.join(job_dir(_state.peek()), "ranks")
    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{rank}.pid")
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        _state.process.recorder_pidfiles.add(path)
    except OSError:
        pass  # dumps still go to the store; only `hvdliterun --dump` cannot find this rank


def _stop(thread):
    """At exit, before the interpreter stops its daemon threads: a thread stopped inside the
    GIL-released wait would be unwound through C++ destructors, which aborts the process
    ("terminate called without an active exception")."""
    _state.process.recorder_stopping.set()
    for path in _state.process.recorder_pidfiles:
        try:
            with open(path) as f:
                mine = f.read().strip() == str(os.getpid())
            if mine:
                os.unlink(path)
            ranks = os.path.dirname(path)
            os.rmdir(ranks)  # the last rank out leaves no empty directories behind; rmdir
            os.rmdir(os.path.dirname(ranks))  # refuses while another rank or a dump is in it
        except OSError:
            pass
    _core.ring_dump("", _STOP)
    thread.join(timeout=PENDING_TIMEOUT + 2.0)


def _loop():
    count = 0
    stopping = _state.process.recorder_stopping
    while not stopping.is_set():
        rings = [ring for ring in _core.wait_dump(1.0) if ring[1] != _STOP]
        if not rings or stopping.is_set():
            continue
        if not any(ident for ident, _ in rings):  # a signal: wait for the job-wide round
            deadline = time.monotonic() + DUMP_SIGNAL_WAIT
            while time.monotonic() < deadline:
                more = _core.wait_dump(max(0.01, deadline - time.monotonic()))
                rings += more
                if any(ident for ident, _ in more):
                    break
        else:  # rings from several engines of one event come together
            rings += _core.wait_dump(0.05)
        count += 1
        try:
            write(rings, count)
        except Exception as exc:  # noqa: BLE001 - a dump must never take the process down
            print(f"hvdlite: could not write a flight-recorder dump: {exc!r}", file=sys.stderr, flush=True)


def job_dir(state=None):
    """Note [Dump files]: this job's directory (not created)."""
    given = os.environ.get("HVDLITE_JOB_DIR")
    if given:
        return given
    job = (os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID")
           or (f"pid{state.peers[0]['pid']}" if state is not None and state.peers else f"pid{os.getpid()}"))
    return os.path.join(tempfile.gettempdir(), "hvdlite-jobs", str(job))


def engines(state):
    """(label, engine) of every engine this process runs."""
    found = []
    if state is not None:
        for set_id, runtime in sorted(state.sets.items()):
            if runtime.engine is not None:
                found.append(("global" if set_id == 0 else f"set{set_id}", runtime.engine))
    found.extend(_state.process.backend_engines)
    return found


def _is_users(filename):
    path = os.path.abspath(filename)
    return not (path.startswith(_PACKAGE) or "/torch/" in path or path.startswith(_LIBRARY)
                or filename.startswith("<"))


def _threads():
    names = {t.ident: t for t in threading.enumerate()}
    out, where = [], None
    for ident, frame in sys._current_frames().items():
        thread = names.get(ident)
        if thread is not None and thread.name == "hvdlite-recorder":
            continue
        stack = traceback.extract_stack(frame)
        frames = [{"file": f.filename, "line": f.lineno, "function": f.name, "code": f.line or ""} for f in stack]
        main = thread is threading.main_thread()
        out.append({"name": thread.name if thread else f"thread {ident}", "ident": ident, "main": main,
                    "stack": frames})
        if main:
            users = [f for f in frames if _is_users(f["file"])]
            inner = frames[-1] if frames else None
            if users:
                where = dict(users[-1])
                if inner is not None and inner is not users[-1] and not _is_users(inner["file"]):
                    where["inside"] = f"{inner['function']} ({os.path.basename(inner['file'])}:{inner['line']})"
    return out, where


def collect(ident, reasons, state):
    """This rank's record for dump `ident` (Note [Dump files])."""
    threads, where = _threads()
    records = {}
    for label, engine in engines(state):
        try:
            records[label] = {"rank": engine.rank, "size": engine.size, **engine.flight_record(PENDING_TIMEOUT)}
        except Exception as exc:  # noqa: BLE001 - a stopped engine still leaves the rest
            records[label] = {"error": repr(exc)}
    for label, backend in _state.process.backends:  # who waits for whom, point to point
        if label in records:
            records[label]["point_to_point"] = _core.pending_point_to_point(backend)
    if state is not None:
        rank, size = state.topology.rank, state.topology.size
    else:  # only torch.distributed groups of the backend: the first one's rank and size
        # (an elastic worker between generations has none: the place it last had)
        first = next(iter(engines(state)), None)
        last = os.environ.get("HVDLITE_RANK")
        rank, size = ((first[1].rank, first[1].size) if first else
                      (int(last), None) if last and last.isdigit() else (os.getpid(), None))
    return {"id": ident, "reasons": reasons, "rank": rank, "size": size, "host": socket.gethostname(),
            "pid": os.getpid(), "time": time.time(), "engines": records, "threads": threads, "where": where}


def write(rings, count):
    state = _state.peek()
    ident = next((i for i, _ in rings if i), "") or f"signal-{os.getpid()}-{count}"
    if state is not None:
        ident = f"{state.prefix.strip('/').replace('/', '-')}-{ident}"
    reasons = list(dict.fromkeys(reason for _, reason in rings))
    record = collect(ident, reasons, state)
    directory = os.path.join(job_dir(state), "dumps", ident)
    record["directory"] = directory
    data = json.dumps(record)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank{record['rank']}.json")
    scratch = f"{path}.{os.getpid()}.tmp"
    with open(scratch, "w") as f:
        f.write(data)
    os.replace(scratch, path)
    _deliver(ident, record["rank"], data)
    return path


def _deliver(ident, rank, data):
    """Under hvdliterun: the record to the launcher's store (its reporter merges them)."""
    try:
        launcher = LauncherStore.from_env(os.environ)
    except ValueError:
        return
    if launcher is None:
        return
    from .._job.wire import RendezvousError
    try:
        client = launcher.client(rank=rank, connect_timeout=3.0)
        client.call(b"SET", [keys.dump(ident, rank).encode(), data.encode()])
        client.call(b"SET", [keys.DUMP_LATEST.encode(), ident.encode()])
        client.close()
    except (RendezvousError, OSError, ValueError):
        pass  # the file is written; the launcher may be gone
