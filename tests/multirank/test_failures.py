"""Failing fast and loud: a killed rank, a stall, shutdown with work in flight."""

import os
import socket
import threading
import time

import pytest
import torch

import hvdlite as hvd
from tests.harness import Job


def _victim_or_survivor(victim):
    hvd.init()
    hvd.allreduce(torch.ones(4), name="warm-up")
    if hvd.rank() == victim:
        print("READY", flush=True)
        time.sleep(120)  # killed by the test
        return None
    outcomes = []
    try:
        hvd.allreduce(torch.ones(4), name="never-completes")
    except hvd.RankFailureError as exc:
        outcomes.append((time.time(), str(exc), exc.ranks))
    # later calls fail fast with the same diagnosis
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(4), name="later")
    except hvd.RankFailureError as exc:
        outcomes.append((time.monotonic() - started, str(exc), exc.ranks))
    return outcomes


@pytest.mark.parametrize("launcher,victim", [("hvdlite", 1), ("torchrun", 0)])
def test_killed_rank_fails_survivors_within_seconds_naming_it(launcher, victim):
    size = 3
    extra = None
    if launcher == "torchrun":
        # torchrun's variables, rank 0 hosting the store: killing rank 0 also kills the store
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        extra = {r: {"RANK": str(r), "WORLD_SIZE": str(size), "LOCAL_RANK": str(r),
                     "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port), "HVDLITE_RANK": ""} for r in range(size)}
    job = Job(size, __name__, "_torchrun_entry" if extra else "_victim_or_survivor", victim,
              rank_env_extra=extra)
    job.wait_for_output(victim, "READY")
    time.sleep(0.3)  # let the survivors block in their allreduce
    killed_at = time.time()
    job.kill(victim)
    results = job.wait(timeout=40, allow_failure=(victim,))
    for rank, outcomes in enumerate(results):
        if rank == victim:
            continue
        (failed_at, message, ranks), (later_seconds, later_message, _) = outcomes
        assert failed_at - killed_at < 10, f"rank {rank} took {failed_at - killed_at:.1f} s to notice"
        assert f"lost rank {victim} (pid {job.procs[victim].pid}" in message, message
        assert ranks == [victim]
        assert "allreduce of 'never-completes'" in message
        assert later_seconds < 1 and f"lost rank {victim}" in later_message


def _torchrun_entry(victim):
    for key in [k for k in os.environ if k.startswith("HVDLITE_")]:
        del os.environ[key]
    return _victim_or_survivor(victim)


def _stall():
    hvd.init()
    rank = hvd.rank()
    # divergent call sequences: each rank waits on a name the other never submits
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2), name=f"only-on-rank-{rank}")
    except hvd.StallError as exc:
        message, waited, ranks = str(exc), time.monotonic() - started, exc.ranks
    healthy = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after-stall").item()
    hvd.shutdown()
    return message, waited, healthy, ranks


def test_stall_warns_then_fails_naming_the_missing_rank():
    env = {"HVDLITE_STALL_CHECK_TIME_SECONDS": "1", "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    job = Job(2, __name__, "_stall", env=env)
    results = job.wait(timeout=60)
    for rank, (message, waited, healthy, ranks) in enumerate(results):
        other = 1 - rank
        assert message.startswith(f"allreduce of 'only-on-rank-{rank}': stalled for "), message
        assert f"missing rank {other}" in message and ranks == [other], message
        assert f"submitted by rank {rank}" in message
        assert 2.5 < waited < 15, waited
        assert healthy == 2
        log = job.output(rank)
        assert "WARNING: stall:" in log and "missing rank 1" in log and "missing rank 0" in log, log


def _shutdown_in_flight():
    hvd.init()
    outcome = {}
    if hvd.rank() == 0:
        def waiter():
            try:
                hvd.allreduce(torch.ones(3), name="pending-at-shutdown")
                outcome["result"] = "completed"
            except hvd.ShutdownError as exc:
                outcome["result"] = str(exc)
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.5)
        hvd.shutdown()  # this rank's own shutdown fails its own pending operation
        t.join(timeout=20)
        assert not t.is_alive(), "the waiting thread hung after shutdown()"
    else:
        time.sleep(2)
        with pytest.raises(hvd.ShutdownError, match="requested by rank 0"):
            hvd.allreduce(torch.ones(3), name="after-peer-shutdown")
        hvd.shutdown()
    return outcome.get("result")


def test_shutdown_fails_in_flight_operations_on_every_rank():
    result = Job(2, __name__, "_shutdown_in_flight").wait(timeout=60)[0]
    assert "allreduce of 'pending-at-shutdown'" in result and "shut down" in result, result


def _reset_is_a_code(reset):
    from hvdlite._runtime import state as _state
    from hvdlite._runtime.elastic_worker import HOSTS_UPDATED
    hvd.init()
    hvd.allreduce(torch.ones(2), name="warm-up")
    if hvd.rank() == 0:
        # The same words either way: only the code carried by the shutdown tells them apart.
        _state.current().engine.shutdown(HOSTS_UPDATED, reset=reset)
    else:
        time.sleep(1.0)
    try:
        hvd.allreduce(torch.ones(2), name="after-reset")
        outcome = ("completed", "")
    except (hvd.HvdliteError, hvd.elastic.HostsUpdatedInterrupt) as exc:
        outcome = (type(exc).__name__, str(exc))
    hvd.shutdown()
    return outcome


@pytest.mark.parametrize("reset", [True, False])
def test_a_reset_travels_as_a_status_code_not_as_words(reset):
    import hvdlite.elastic  # noqa: F401  (HostsUpdatedInterrupt's public home)
    for rank, (kind, message) in enumerate(Job(2, __name__, "_reset_is_a_code", reset).wait(timeout=60)):
        assert kind == ("HostsUpdatedInterrupt" if reset else "ShutdownError"), (rank, kind, message)
        assert "allreduce of 'after-reset'" in message and "updating the job's hosts" in message, message
