"""Agreement between ranks, by construction and checked: job-wide settings from rank 0, the
build check at init, grouped calls whose members differ, the per-round agreement digest, and
a rank that cannot take part. Every case ends in a clear exception on every rank involved,
with every process still alive (each rank function returns normally after checking)."""

import resource

import pytest
import torch

import hvdlite as hvd
from tests.harness import Job, run_ranks

LOOP = 60


def _async_loop(prefix):
    """60 async allreduces of distinct small tensors, then their results (checked by caller)."""
    rank = hvd.rank()
    tensors = [torch.full((i % 7 + 1,), float(rank + i)) for i in range(LOOP)]
    handles = [hvd.allreduce_async(t, name=f"{prefix}.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
    return [hvd.synchronize(h) for h in handles]


def _expected_loop(size):
    return [torch.full((i % 7 + 1,), float(sum(r + i for r in range(size)))) for i in range(LOOP)]


# ---- 1. settings that differ between ranks -------------------------------------------------

def differing_settings_job():
    hvd.init()
    engine = hvd.basics._state.current().engine
    results = [_async_loop(f"m{step}") for step in range(3)]  # the cache is used from step 2 on
    out = (engine.fusion_threshold_bytes, results)
    hvd.shutdown()
    return out


def test_settings_differing_between_ranks_take_rank0s_values_and_warn():
    # The reproduction: rank 1 starts with other fusion/cache/inline settings.
    job = Job(2, __name__, "differing_settings_job", rank_env_extra={1: {
        "HVDLITE_FUSION_THRESHOLD": "0", "HVDLITE_CACHE_CAPACITY": "4", "HVDLITE_INLINE_BYTES": "0"}})
    results = job.wait(timeout=90)
    for rank, (threshold, steps) in enumerate(results):
        assert threshold == 64 * 1024 * 1024, f"rank {rank} runs with threshold {threshold}"
        for step in steps:
            for got, want in zip(step, _expected_loop(2)):
                assert torch.equal(got, want)
    warnings = [line for line in job.output(1).splitlines() if "WARNING" in line]
    for var, value in (("HVDLITE_FUSION_THRESHOLD", "0"), ("HVDLITE_CACHE_CAPACITY", "4"),
                       ("HVDLITE_INLINE_BYTES", "0")):
        assert any(f"{var}={value} on this rank differs from rank 0's unset (the default); rank 0's "
                   "value is in force" in line for line in warnings), warnings
    assert len(warnings) == 3
    assert "WARNING" not in job.output(0)


def own_settings_job():
    hvd.init()
    with pytest.raises(hvd.MismatchError) as info:
        _async_loop("m")
    first = info.value
    with pytest.raises(hvd.MismatchError) as later:  # the engine stays stopped, saying why
        hvd.allreduce(torch.ones(2), name="later")
    hvd.shutdown()
    return str(first), first.ranks, str(later.value)


def test_ranks_running_different_settings_anyway_stop_with_a_clear_error_before_any_collective():
    # The test hook lets each rank keep its own job-wide values: the per-round settings digest
    # must stop both ranks at their first round, before a mismatched Gloo collective.
    env = {"HVDLITE_TEST_OWN_JOB_SETTINGS": "1"}
    job = Job(2, __name__, "own_settings_job", env=env, rank_env_extra={1: {
        "HVDLITE_FUSION_THRESHOLD": "0", "HVDLITE_CACHE_CAPACITY": "4", "HVDLITE_INLINE_BYTES": "0"}})
    for message, ranks, later in job.wait(timeout=60):
        assert ("the job-wide settings in force on rank 1 differ from rank 0's" in message), message
        assert ranks == [1]
        assert "allreduce of 'later'" in later and "differ from rank 0's" in later


def invalid_settings_job():
    with pytest.raises(ValueError) as info:
        hvd.init()
    assert not hvd.is_initialized()
    return str(info.value), info.value.ranks


def test_invalid_per_rank_setting_on_one_rank_fails_init_on_every_rank():
    job = Job(2, __name__, "invalid_settings_job", rank_env_extra={1: {"HVDLITE_LOG_LEVEL": "loud"}})
    for message, ranks in job.wait(timeout=60):
        assert "invalid settings on rank 1" in message and "HVDLITE_LOG_LEVEL='loud'" in message
        assert ranks == [1]


def test_invalid_job_wide_setting_on_rank0_fails_init_on_every_rank():
    job = Job(3, __name__, "invalid_settings_job", rank_env_extra={0: {"HVDLITE_CYCLE_TIME": "fast"}})
    for message, ranks in job.wait(timeout=60):
        assert "invalid settings on rank 0" in message and "HVDLITE_CYCLE_TIME='fast'" in message
        assert ranks == [0]


def ignored_setting_job():
    hvd.init()
    out = hvd.allreduce(torch.tensor([1.0 + hvd.rank()]), op=hvd.Sum, name="x")
    hvd.shutdown()
    return out.item()


def test_invalid_job_wide_setting_on_another_rank_is_not_used():
    job = Job(2, __name__, "ignored_setting_job", rank_env_extra={1: {"HVDLITE_CYCLE_TIME": "fast"}})
    assert job.wait(timeout=60) == [3.0, 3.0]
    assert "HVDLITE_CYCLE_TIME=fast on this rank differs from rank 0's" in job.output(1)


# ---- 2. builds ---------------------------------------------------------------------------

def other_build_job():
    import os

    import hvdlite._runtime.settings as settings
    own = settings.own_record
    if os.environ["HVDLITE_RANK"] == "1":  # this rank pretends to run another build
        settings.own_record = lambda rank, env=None: {**own(rank, env), "build": "000000000000"}
    with pytest.raises(hvd.MismatchError) as info:
        hvd.init()
    return str(info.value), info.value.ranks


def test_ranks_with_different_builds_fail_init_naming_the_builds():
    build = hvd._core.BUILD_ID
    for message, ranks in run_ranks(2, __name__, "other_build_job", timeout=60):
        assert "the ranks run different hvdlite builds" in message
        assert f"rank 0 runs hvdlite {hvd.__version__} (build {build}, protocol" in message
        assert f"rank 1 runs hvdlite {hvd.__version__} (build 000000000000, protocol" in message
        assert ranks == [1]


# ---- 3. grouped calls whose members differ -------------------------------------------------

def differing_group_job():
    hvd.init()
    rank = hvd.rank()
    a, b = torch.ones(3) * (rank + 1), torch.ones(2) * (rank + 1)
    with pytest.raises(hvd.MismatchError) as info:
        hvd.grouped_allreduce([a, b] if rank == 0 else [a], name="G", op=hvd.Sum)
    # The engine goes on serving.
    after = hvd.allreduce(torch.tensor([float(rank)]), name="after", op=hvd.Sum)
    hvd.shutdown()
    return str(info.value), info.value.ranks, info.value.tensor_name, after.item()


def test_grouped_call_with_different_members_fails_on_every_rank_and_the_job_goes_on():
    env = {"HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "30"}  # must not be what ends it
    for message, ranks, name, after in run_ranks(2, __name__, "differing_group_job", timeout=60, env=env):
        assert message == ("grouped allreduce of 'G': members differ: rank 0 has 2 tensors ('G.0', 'G.1'); "
                           "rank 1 has 1 tensor ('G.0')")
        assert ranks == [1] and name == "G" and after == 1.0


def group_member_shape_job():
    hvd.init()
    rank = hvd.rank()
    tensors = [torch.ones(4), torch.ones(3 if rank == 0 else 5), torch.ones(2)]
    handle = hvd.grouped_allreduce_async(tensors, name="H")
    with pytest.raises(hvd.MismatchError) as info:
        hvd.synchronize(handle)
    hvd.shutdown()
    return str(info.value), info.value.tensor_name, info.value.ranks


def test_grouped_call_with_a_member_shape_mismatch_fails_whole_everywhere():
    for message, name, ranks in run_ranks(2, __name__, "group_member_shape_job", timeout=60):
        assert message == ("grouped allreduce 'H': allreduce of 'H.1': shape mismatch: rank 0 has [3]; "
                           "rank 1 has [5]")
        assert name == "H.1" and ranks == [1]


def group_stall_job():
    import time
    hvd.init()
    rank = hvd.rank()
    outcome = None
    if rank == 0:
        with pytest.raises(hvd.StallError) as info:
            hvd.grouped_allreduce([torch.ones(2), torch.ones(3)], name="S")
        outcome = (str(info.value), info.value.ranks)
    else:
        time.sleep(4)  # never submits S
    after = hvd.allreduce(torch.tensor([float(rank)]), name="after", op=hvd.Sum)
    hvd.shutdown()
    return outcome, after.item()


def test_grouped_call_that_one_rank_never_makes_fails_as_a_stall():
    env = {"HVDLITE_STALL_CHECK_TIME_SECONDS": "1", "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "2"}
    (outcome, after0), (none, after1) = run_ranks(2, __name__, "group_stall_job", timeout=60, env=env)
    message, ranks = outcome
    assert message.startswith("grouped allreduce 'S': allreduce of 'S.0': stalled for 2 s: missing rank 1, "
                              "submitted by rank 0"), message
    assert ranks == [1] and none is None and after0 == after1 == 1.0


# ---- 4. a controller that decides differently ---------------------------------------------

def diverging_controller_job():
    hvd.init()
    rank = hvd.rank()
    seen = None
    for step in range(40):
        try:
            for i in range(4):  # the same names every step: they travel as cache ids
                out = hvd.allreduce(torch.full((3,), float(rank + i)), name=f"w{i}", op=hvd.Sum)
                assert torch.equal(out, torch.full((3,), float(1 + 2 * i)))
        except hvd.MismatchError as exc:
            seen = (step, str(exc), exc.ranks)
            break
    with pytest.raises(hvd.MismatchError):
        hvd.allreduce(torch.ones(1), name="later")
    hvd.shutdown()
    return seen


# Cached rounds (Note [Cached rounds] in csrc/cached_round.h): the reduction's digests disagree,
# every rank runs the full round, and its digest check names the rank as without them.
CACHED_ROUNDS = {"HVDLITE_SHARED_MEMORY": "0", "HVDLITE_CPU_CHANNELS": "1"}  # over the control link


@pytest.mark.parametrize("rounds", ["full", "cached"])
def test_a_rank_whose_controller_diverges_stops_every_rank_with_a_clear_error(rounds):
    # Rank 1's controller forgets its response cache after its 10th round: from then on it would
    # read the ids on the wire differently. The next round's digest must stop both ranks.
    job = Job(2, __name__, "diverging_controller_job", env=CACHED_ROUNDS if rounds == "cached" else None,
              rank_env_extra={1: {"HVDLITE_TEST_FORGET_CACHE_AT_ROUND": "10"}})
    seen = job.wait(timeout=60)
    for rank_seen in seen:
        assert rank_seen is not None, "no rank noticed the divergence"
        step, message, ranks = rank_seen
        assert "the negotiation state of rank 1 diverged from rank 0's" in message, message
        assert ranks == [1]
    assert seen[0][0] == seen[1][0]  # the same operation on both ranks


# ---- 5. a rank that cannot take part ------------------------------------------------------

def _vm_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def out_of_memory_job():
    hvd.init()
    rank = hvd.rank()
    a, b = torch.ones(8 << 20), torch.ones(8 << 20)  # 32 MiB each: a 64 MiB fusion buffer
    hvd.allreduce(torch.ones(1), name="warm")  # every thread and buffer of a small op exists
    outcome = None
    if rank == 1:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + (16 << 20), hard))
        try:
            with pytest.raises(hvd.HvdliteError) as info:
                hvd.grouped_allreduce_([a, b], name="big")
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        exc = info.value
        outcome = (type(exc).__name__, str(exc), exc.ranks)
    else:
        with pytest.raises(hvd.RankFailureError) as info:
            hvd.grouped_allreduce_([a, b], name="big")
        outcome = (type(info.value).__name__, str(info.value), info.value.ranks)
    return outcome  # rank 1 returns and its process exits: that is what rank 0 notices


def test_a_rank_out_of_memory_says_so_and_the_peer_names_it():
    # Through Gloo, where the batch needs a 64 MiB fusion buffer: through shared memory it would
    # need none (Note [Fusing straight into shared memory]) and nothing would run out.
    (kind0, message0, ranks0), (kind1, message1, ranks1) = run_ranks(
        2, __name__, "out_of_memory_job", timeout=90, env={"HVDLITE_SHARED_MEMORY": "0"})
    assert kind1 == "HvdliteError", message1
    assert message1.startswith("allreduce of 'big.0': rank 1 could not take part:"), message1
    assert "memory" in message1 and "lost contact" not in message1 and ranks1 == [1]
    assert kind0 == "RankFailureError" and ranks0 == [1], message0
    assert "rank 1 (pid" in message0, message0
