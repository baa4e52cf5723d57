"""Flight-recorder dumps on the launcher's side (Note [Dump files] in hvdlite/_runtime/recorder.py).

Note [Job directory]
Every hvdliterun job has a directory, ``<tmp>/hvdlite-jobs/<host>-<launcher pid>``, handed to
the ranks as HVDLITE_JOB_DIR (on other hosts the same path, created there when needed), or the
one the user names in HVDLITE_JOB_DIR, which the launcher's reports then follow too. Each
rank that runs hvdlite's recorder registers its pid under ``ranks/`` (so only processes that
handle SIGUSR1 are ever sent it: its default action ends a process), and dumps land under
``dumps/<id>/``. The launcher's DumpReporter watches the store for new dumps
(keys.DUMP_LATEST), waits for every rank's record or REPORT_WAIT seconds, prints the merged
report and writes it next to the records as ``report.txt``. ``hvdliterun --dump [DIR]`` signals
the lowest registered rank of a running job (the newest on this machine by default), which
makes every rank dump in the same round, and prints the report once it is written.
"""
import glob
import os
import signal
import socket
import tempfile
import threading
import time
from typing import IO, Dict, Optional

from hvdlite._job import dumps, keys

REPORT_WAIT = 5.0      # seconds the reporter waits for the ranks that have not written yet
DUMP_TIMEOUT = 15.0    # seconds `hvdliterun --dump` waits for a dump to appear


def jobs_root() -> str:
    return os.path.join(tempfile.gettempdir(), "hvdlite-jobs")


def new_job_dir() -> str:
    """Note [Job directory]: this launcher's (not created until something is written)."""
    return os.path.join(jobs_root(), f"{socket.gethostname()}-{os.getpid()}")


def registered_ranks(job_dir: str) -> Dict[int, int]:
    """rank -> pid of the live processes that registered in `job_dir`."""
    found = {}
    for path in glob.glob(os.path.join(job_dir, "ranks", "*.pid")):
        try:
            rank = int(os.path.basename(path)[:-4])
            with open(path) as f:
                pid = int(f.read().strip())
            os.kill(pid, 0)
        except (ValueError, OSError):
            continue
        found[rank] = pid
    return found


class DumpReporter:
    """Prints one merged report per dump the ranks send to the store (Note [Job directory])."""

    def __init__(self, server, job_dir: str, write) -> None:
        self._server, self.job_dir, self._write = server, job_dir, write
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvdliterun-dumps", daemon=True)

    def start(self) -> "DumpReporter":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=REPORT_WAIT + 2.0)

    def _loop(self) -> None:
        seen = self._server.get(keys.DUMP_LATEST)
        while not self._stop.wait(0.25):
            latest = self._server.get(keys.DUMP_LATEST)
            if latest is None or latest == seen:
                continue
            seen = latest
            self._report(latest.decode(errors="replace"))

    def _records(self, ident: str) -> Dict[int, dict]:
        return self._server.records_under(keys.dump(ident, ""))

    def _report(self, ident: str) -> None:
        deadline = time.monotonic() + REPORT_WAIT
        records = self._records(ident)
        while time.monotonic() < deadline and not self._stop.is_set():
            size = max((r.get("size") or 0) for r in records.values()) if records else 0
            if records and len(records) >= size:
                break
            time.sleep(0.1)
            records = self._records(ident)
        text = dumps.report(records)
        directory = os.path.join(self.job_dir, "dumps", ident)
        try:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "report.txt"), "w") as f:
                f.write(text)
        except OSError:
            pass
        self._write("".join(f"hvdliterun: {line}\n" for line in text.splitlines()))


def _newest_running_job() -> Optional[str]:
    candidates = [d for d in glob.glob(os.path.join(jobs_root(), "*")) if registered_ranks(d)]
    return max(candidates, key=os.path.getmtime) if candidates else None


def dump_command(target: str, out: IO[str], err: IO[str]) -> int:
    """``hvdliterun --dump [DIR]``: asks a running job for a dump and prints the report."""
    job_dir = target or _newest_running_job()
    if not job_dir:
        err.write(f"hvdliterun: error: --dump: no running hvdlite job on this machine (looked in {jobs_root()})\n")
        return 1
    ranks = registered_ranks(job_dir)
    if not ranks:
        err.write(f"hvdliterun: error: --dump: no live rank of {job_dir} runs hvdlite's flight recorder\n")
        return 1
    root = os.path.join(job_dir, "dumps")
    before = set(os.listdir(root)) if os.path.isdir(root) else set()
    rank = min(ranks)
    os.kill(ranks[rank], signal.SIGUSR1)
    deadline = time.monotonic() + DUMP_TIMEOUT
    fresh = None
    while time.monotonic() < deadline and fresh is None:
        time.sleep(0.2)
        now = set(os.listdir(root)) if os.path.isdir(root) else set()
        fresh = next(iter(sorted(now - before)), None)
    if fresh is None:
        err.write(f"hvdliterun: error: --dump: rank {rank} (pid {ranks[rank]}) wrote no dump within "
                  f"{DUMP_TIMEOUT:g} s\n")
        return 1
    directory = os.path.join(root, fresh)
    report = os.path.join(directory, "report.txt")
    deadline = time.monotonic() + REPORT_WAIT + 2.0
    while time.monotonic() < deadline and not os.path.exists(report):
        time.sleep(0.2)
    if os.path.exists(report):  # the launcher merged every host's records
        with open(report) as f:
            out.write(f.read())
    else:  # no launcher reporter (torchrun, srun): this host's records
        out.write(dumps.report(dumps.read_dir(directory)))
    return 0
