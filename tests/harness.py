"""Runs a test function on N real ranks: separate processes on 127.0.0.1 with a hard timeout.

    results = run_ranks(2, "tests.multirank.test_allreduce", "check_sum", arg1, ...)

Each rank is its own process (forked from a zygote that has imported torch: tests/zygote.py)
with the variables hvdliterun would set (HVDLITE_RANK, ..., rendezvous on a TCPStore this
process hosts on a free port) and one torch thread. The function (module-level, named by module
and attribute) runs with (*args) and its return value comes back pickled, in rank order. A rank that fails raises AssertionError carrying its traceback; a job
past its timeout is killed and the error names the ranks that had not finished.
"""

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import weakref

import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_BOOT = r"""
import importlib, pickle, sys, traceback
args_path, result_path = sys.argv[1], sys.argv[2]
with open(args_path, "rb") as f:
    module, attr, args = pickle.load(f)
try:
    fn = getattr(importlib.import_module(module), attr)
    result = fn(*args)
except BaseException:
    traceback.print_exc()
    sys.stderr.flush()
    sys.exit(1)
with open(result_path, "wb") as f:
    pickle.dump(result, f)
"""


class RankFailed(AssertionError):
    pass


def rank_env(rank, size, port, extra=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HVDLITE_", "OMPI_", "PMI_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT")}
    env.update({
        "HVDLITE_RANK": str(rank), "HVDLITE_SIZE": str(size),
        "HVDLITE_LOCAL_RANK": str(rank), "HVDLITE_LOCAL_SIZE": str(size),
        "HVDLITE_CROSS_RANK": "0", "HVDLITE_CROSS_SIZE": "1",
        "HVDLITE_RENDEZVOUS_ADDR": "127.0.0.1", "HVDLITE_RENDEZVOUS_PORT": str(port),
        "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


_ZYGOTES = {}  # rank index -> tests/zygote.py's Zygote
_IMPORT_TIME = ("OMP_", "MKL_", "KMP_", "TORCH_", "PYTORCH_", "LD_", "PYTHON")  # read by `import torch`


def _start_rank(rank, argv, env, out_path):
    """A rank process running _BOOT: forked from rank index `rank`'s zygote (tests/zygote.py)
    unless the job sets a variable that `import torch` reads, or HVDLITE_TEST_FRESH_RANKS=1."""
    base = {k: v for k, v in rank_env(0, 1, 0).items() if not k.startswith("HVDLITE_")}
    fresh = os.environ.get("HVDLITE_TEST_FRESH_RANKS") == "1" or any(
        env.get(k) != base.get(k) for k in set(env) | set(base) if k.startswith(_IMPORT_TIME))
    if not fresh:
        from tests.zygote import Zygote
        if rank not in _ZYGOTES:
            _ZYGOTES[rank] = Zygote(base, REPO)
        try:
            return _ZYGOTES[rank].start(_BOOT, ["-c", *argv], env, out_path, REPO)
        except RuntimeError:
            del _ZYGOTES[rank]  # a zygote that died: this rank starts fresh, the next job makes a new one
    with open(out_path, "wb") as out:
        return subprocess.Popen([sys.executable, "-c", _BOOT, *argv], env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=REPO)


class Job:
    """N rank processes running one function; start() then wait(), or use run_ranks()."""

    def __init__(self, size, module, attr, *args, env=None, rank_env_extra=None):
        self.size = size
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        self.dir = tempfile.mkdtemp(prefix="hvdlite-test-")
        weakref.finalize(self, shutil.rmtree, self.dir, True)  # outputs stay readable while the Job lives
        self.procs = []
        for rank in range(size):
            args_path = os.path.join(self.dir, f"args.{rank}")
            with open(args_path, "wb") as f:
                pickle.dump((module, attr, args), f)
            extra = dict(env or {})
            extra.update((rank_env_extra or {}).get(rank, {}))
            extra.setdefault("HVDLITE_JOB_DIR", os.path.join(self.dir, "job"))  # dumps go with the Job
            self.procs.append(_start_rank(rank, [args_path, os.path.join(self.dir, f"result.{rank}")],
                                          rank_env(rank, size, self.store.port, extra),
                                          os.path.join(self.dir, f"out.{rank}")))
        self.started = time.monotonic()

    def output(self, rank):
        """What `rank` has printed so far; "" before it has opened its output (a rank forked from
        a zygote opens it itself, after start() returned)."""
        try:
            with open(os.path.join(self.dir, f"out.{rank}"), "rb") as f:
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_output(self, rank, text, timeout=30):
        """Waits until `rank` has printed `text`; fails if it exits first or takes too long."""
        deadline = time.monotonic() + timeout
        while text not in self.output(rank):
            assert time.monotonic() < deadline, f"rank {rank} never printed {text!r}:\n{self.output(rank)}"
            assert self.procs[rank].poll() is None, f"rank {rank} exited early:\n{self.output(rank)}"
            time.sleep(0.05)

    def kill(self, rank):
        self.procs[rank].kill()

    def wait(self, timeout=60, allow_failure=()):
        """Results in rank order; ranks in allow_failure may fail (their result is None)."""
        deadline = self.started + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        hung = [r for r, p in enumerate(self.procs) if p.poll() is None]
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if hung:
            tails = "\n".join(f"--- rank {r} output:\n{self.output(r)[-3000:]}" for r in hung)
            raise RankFailed(f"ranks {hung} still running after {timeout} s (killed)\n{tails}")
        results = []
        for rank, proc in enumerate(self.procs):
            if proc.returncode != 0:
                if rank in allow_failure:
                    results.append(None)
                    continue
                raise RankFailed(f"rank {rank} exited with {proc.returncode}:\n{self.output(rank)[-5000:]}")
            with open(os.path.join(self.dir, f"result.{rank}"), "rb") as f:
                results.append(pickle.load(f))
        return results


def run_ranks(size, module, attr, *args, timeout=60, env=None):
    return Job(size, module, attr, *args, env=env).wait(timeout=timeout)


def run_checks_in_ranks(module, names):
    """Runs module.<name>() for each name inside one hvdlite job (call it from the ranks).

    Returns {name: None or 'rank r: traceback'}, so one job of N ranks can report many checks
    as separate pytest tests (see tests/multirank/test_optimizer.py).
    """
    import traceback

    import pytest

    import hvdlite as hvd

    hvd.init()
    outcomes = {}
    for name in names:
        try:
            getattr(module, name)()
            outcomes[name] = None
        except (Exception, pytest.fail.Exception):  # pytest.raises fails with a BaseException
            outcomes[name] = f"rank {hvd.rank()}: {traceback.format_exc()}"
    hvd.shutdown()
    return outcomes


def hard_timeout_fixture(seconds):
    """An autouse pytest fixture that fails a test still running after `seconds` (SIGALRM in
    the test process), so a bug fails the test instead of hanging CI. In a conftest:
    ``_hard_timeout = hard_timeout_fixture(240)``."""
    import signal

    import pytest

    @pytest.fixture(autouse=True)
    def _hard_timeout():
        def on_alarm(signum, frame):
            raise TimeoutError(f"test exceeded {seconds} s")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(seconds)
        yield
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return _hard_timeout
