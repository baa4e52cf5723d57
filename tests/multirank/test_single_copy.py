"""The single-copy allreduce (Note [Single-copy allreduce], csrc/shm_channel.h): on by default
where the kernel lets the ranks reach each other's memory, bit-identical to the staged path,
off for every rank when one rank cannot use it or HVDLITE_SINGLE_COPY=0, and named in the
verbose log and the timeline. The dtype and op sweep through it is in test_shared_memory.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

import hvdlite as hvd
from hvdlite import _core
from hvdlite._runtime import state as _state
from tests.harness import Job, run_ranks
from tests.multirank._reference import assert_close, assert_members_close, rank_input, reduce_reference

MIN = _core.ShmChannel.SINGLE_COPY_MIN_BYTES


def _both_paths():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    engine = _state.current().sets[0].engine
    assert engine.single_copy, "single copy should be on for ranks of one host"
    cases = []
    # one tensor above the threshold, with an element count that no share divides
    cases.append(("one", [rank_input(1, r, (MIN // 4 + 5,), torch.float32) for r in range(size)]))
    # many small members (several thousand spans per block: more than one iovec batch), mixed sizes
    sizes = [37 + (i * 13) % 300 for i in range(4000)]
    cases.append(("many", [[rank_input(10 + i % 50, r, (n,), torch.float32) for i, n in enumerate(sizes)]
                           for r in range(size)]))
    for op, pre, post in [(hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 2.0, 0.25), (hvd.Min, 1.0, 1.0),
                          (hvd.Max, 1.0, 1.0), (hvd.Product, 1.0, 1.0)]:
        for label, inputs in cases:
            results = {}
            for threshold in (1, 0):  # single copy, then the staged path, in the same job
                assert engine._set_single_copy_min(threshold)
                name = f"{label}.{op}.{pre}.{threshold}"
                if label == "one":
                    results[threshold] = [hvd.allreduce(inputs[rank], op=op, name=name, prescale_factor=pre,
                                                        postscale_factor=post)]
                else:
                    results[threshold] = hvd.grouped_allreduce(inputs[rank], op=op, name=name,
                                                               prescale_factor=pre, postscale_factor=post)
            for a, b in zip(results[1], results[0]):
                assert torch.equal(a, b), f"{label} op {op}: single copy and staged differ on rank {rank}"
            if label == "one":
                assert_close(results[1][0], reduce_reference(inputs, op, pre, post), torch.float32,
                             f"{label} op {op} on rank {rank}")
            else:
                assert_members_close(results[1], inputs, op, torch.float32, f"{label} op {op} on rank {rank}",
                                     pre, post)
    # in place, and a rank whose member is a transposed view (its batch goes through a fusion
    # buffer and the flat entry) beside ranks whose members go straight from their tensors
    assert engine._set_single_copy_min(MIN)
    base = [rank_input(90, r, (MIN // 4 // 64 + 3, 64), torch.float32) for r in range(size)]
    mine = base[rank].clone() if rank == 0 else base[rank].t().contiguous().t()
    assert mine.is_contiguous() == (rank == 0)
    hvd.allreduce_(mine, op=hvd.Average, name="layouts")
    assert_close(mine, reduce_reference(base, hvd.Average), torch.float32, f"layouts on rank {rank}")
    hvd.shutdown()
    return True


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_single_copy_and_staged_paths_give_identical_results(size):
    assert all(run_ranks(size, __name__, "_both_paths", timeout=180))


def _path_in_use():
    hvd.init()
    engine = _state.current().sets[0].engine
    rank, size = hvd.rank(), hvd.size()
    got = hvd.allreduce(torch.full((MIN // 4,), float(rank + 1)), op=hvd.Sum, name="big")
    assert torch.equal(got, torch.full((MIN // 4,), float(size * (size + 1) // 2)))
    on = engine.single_copy
    allowed = engine._set_single_copy_min(MIN)
    hvd.shutdown()
    return on, allowed


def test_one_rank_that_cannot_reach_the_others_turns_it_off_for_every_rank():
    results = Job(3, __name__, "_path_in_use", rank_env_extra={1: {"HVDLITE_TEST_REFUSE_SINGLE_COPY": "1"}}).wait(
        timeout=120)
    assert results == [(False, False)] * 3, results


def test_switched_off_with_hvdlite_single_copy_0():
    results = run_ranks(2, __name__, "_path_in_use", timeout=120, env={"HVDLITE_SINGLE_COPY": "0"})
    assert results == [(False, False)] * 2, results


SCRIPT = """
import torch, hvdlite as hvd
hvd.init()
x = hvd.allreduce(torch.ones(%d), op=hvd.Sum, name="big")
assert torch.equal(x, torch.full_like(x, float(hvd.size())))
hvd.shutdown()
"""


def test_verbose_log_and_timeline_name_the_path(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT % (MIN // 4))
    timeline = tmp_path / "trace.json"
    env = dict(os.environ, HVDLITE_TIMELINE=str(timeline))
    done = subprocess.run([sys.executable, "-m", "hvdlite.runner.launch", "-np", "2", "--verbose", sys.executable,
                           str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CPU allreduces go through shared memory (single copy from 8 MB)" in done.stderr, done.stderr[-3000:]
    with open(tmp_path / "trace.rank0.json") as f:
        events = json.load(f)
    routes = [e for e in events if e.get("name") == "cpu route"]
    assert routes and routes[0]["args"]["route"] == "shared memory (single copy from 8 MB)", routes


BLOCK = 256 << 10  # bytes per claimed block (kBlockBytes in csrc/shm_single_copy.cc)


def _slow_claimer(slow):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    engine = _state.current().sets[0].engine
    assert engine.single_copy
    numel = 2 * MIN // 4 + 7  # 64 blocks and a few elements
    blocks = -(-numel * 4 // BLOCK)
    inputs = [rank_input(70, r, (numel,), torch.float32) for r in range(size)]
    counts = []
    for op, pre, post, in_place in [(hvd.Sum, 1.0, 1.0, False), (hvd.Sum, 2.0, 0.25, False),
                                    (hvd.Average, 1.0, 1.0, True), (hvd.Max, 1.0, 1.0, True)]:
        results = {}
        for threshold in (1, 0):  # claimed blocks, then the staged path, in the same job
            assert engine._set_single_copy_min(threshold)
            before = engine._single_copy_blocks
            name = f"slow.{op}.{pre}.{in_place}.{threshold}"
            if in_place:
                results[threshold] = inputs[rank].clone()
                hvd.allreduce_(results[threshold], op=op, name=name, prescale_factor=pre, postscale_factor=post)
            else:
                results[threshold] = hvd.allreduce(inputs[rank], op=op, name=name, prescale_factor=pre,
                                                   postscale_factor=post)
            if threshold == 1:
                counts.append(engine._single_copy_blocks - before)
        what = f"op {op} pre {pre} in place {in_place} on rank {rank}, rank {slow} slow"
        assert torch.equal(results[1], results[0]), f"{what}: claimed blocks and the staged path differ"
        assert_close(results[1], reduce_reference(inputs, op, pre, post), torch.float32, what)
    everyone = hvd.allgather_object(counts)
    hvd.shutdown()
    return everyone, blocks


@pytest.mark.slow
@pytest.mark.parametrize("size,slow", [(2, 0), (2, 1), (3, 2)])
def test_a_busy_rank_leaves_its_blocks_to_the_others(size, slow):
    # The slow rank pauses after each block it reduces: every block must still be reduced once,
    # by one rank, into every rank's output, and the others must have taken most of them.
    results = Job(size, __name__, "_slow_claimer", slow,
                  rank_env_extra={slow: {"HVDLITE_TEST_SHM_CLAIM_DELAY_US": "20000"}}).wait(timeout=180)
    everyone, blocks = results[0]
    assert all(r == results[0] for r in results), results
    for case in range(len(everyone[0])):
        taken = [everyone[r][case] for r in range(size)]
        assert sum(taken) == blocks, (case, taken, blocks)
        assert taken[slow] <= blocks // (4 * size), (case, taken)
