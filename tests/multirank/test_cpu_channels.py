"""Large CPU allreduces spread over several Gloo groups (Note [CPU channels], csrc/cpu_route.h).

Spreading starts at 16 MiB; these tensors are cut into chunks over 2 to 4 channels, with element
counts that do not divide evenly, and every rank's result is checked against an independent
reference.
All ranks of these jobs share one host, where CPU allreduces would go through shared memory
(tests/multirank/test_shared_memory.py); HVDLITE_SHARED_MEMORY=0 keeps them on the channels.
With shared memory on, an engine makes only one of these groups (the last test; the
hierarchical route's count is checked in tests/multihost/test_multihost.py).
"""

import os

import pytest
import torch

import hvdlite as hvd
from hvdlite import ops
from hvdlite._runtime import state as _state
from tests.harness import Job, run_ranks
from tests.multirank._reference import assert_close, assert_members_close, rank_input, reduce_reference

MIB = 1 << 20
GLOO_ONLY = {"HVDLITE_SHARED_MEMORY": "0"}


def _striped_allreduces():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert not _state.current().sets[0].engine.shared_memory  # the channels carry these
    cases = [
        # (seed, elements, dtype, op): 17 to 33 MiB of float32, int32, float64, int64
        (1, 17 * MIB // 4 + 3, torch.float32, hvd.Sum),
        (2, 33 * MIB // 4 + 1, torch.float32, hvd.Average),
        (3, 20 * MIB // 4 + 5, torch.int32, hvd.Max),
        (4, 18 * MIB // 8 + 7, torch.float64, hvd.Min),
        (5, 17 * MIB // 8 + 9, torch.int64, hvd.Average),  # averaged stripe by stripe, truncated
    ]
    for seed, n, dtype, op in cases:
        inputs = [rank_input(seed, r, (n,), dtype, op) for r in range(size)]
        expected = reduce_reference(inputs, op)
        what = f"allreduce of {n} {dtype} (op {op}) on rank {rank}"
        assert_close(hvd.allreduce(inputs[rank], op=op, name=f"big.{seed}"), expected, dtype, what)
    # one tensor out of place, filled chunk by chunk while earlier chunks travel, scaled on the way
    by_rank = [[rank_input(6, r, (17 * MIB // 4 + 3,), torch.float32)] for r in range(size)]
    got = [hvd.allreduce(by_rank[rank][0], op=hvd.Average, name="big.scaled", prescale_factor=0.5,
                         postscale_factor=3.0)]
    assert_members_close(got, by_rank, hvd.Average, torch.float32, f"scaled allreduce on rank {rank}", 0.5, 3.0)
    assert torch.equal(by_rank[rank][0], rank_input(6, rank, (17 * MIB // 4 + 3,), torch.float32))  # input kept
    # fused: many tensors whose buffer is striped, in place, async
    shapes = [(1000, 1000), (3, 1_500_000), (7,), (2_000_001,)]
    inputs = [[rank_input(10 + i, r, s, torch.float32) for i, s in enumerate(shapes)] for r in range(size)]
    mine = [t.clone() for t in inputs[rank]]
    handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"fused.{i}") for i, t in enumerate(mine)]
    for h in handles:
        hvd.synchronize(h)
    for i, t in enumerate(mine):
        expected = reduce_reference([inputs[r][i] for r in range(size)], hvd.Sum)
        assert_close(t, expected, torch.float32, f"fused tensor {i} on rank {rank}")
    # Note [Pipelined fusion over channels]: grouped batches taken in and out chunk by chunk;
    # members straddle the chunk boundaries, some are empty, and one batch has a transposed
    # member (a copy that is not a memcpy) and goes the whole-buffer way
    sizes = [1, 0, 3 * MIB // 4 + 1, 5, 2 * MIB // 4 - 3] * 4 + [7 * MIB // 4 + 11]
    for seed, dtype, op, pre, post in [(20, torch.float32, hvd.Average, 0.5, 3.0),
                                       (21, torch.int32, hvd.Sum, 1.0, 1.0),
                                       (22, torch.float16, hvd.Average, 1.0, 0.25),
                                       (23, torch.float64, hvd.Max, 1.0, 1.0)]:
        by_rank = [[rank_input(seed * 100 + i, r, (n,), dtype, op) for i, n in enumerate(sizes)] for r in range(size)]
        got = hvd.grouped_allreduce(by_rank[rank], op=op, name=f"staged.{seed}", prescale_factor=pre,
                                    postscale_factor=post)
        assert_members_close(got, by_rank, op, dtype, f"grouped {dtype} (op {op}) on rank {rank}", pre, post)
    by_rank = [[rank_input(30, r, (2048, 2050), torch.float32).t(), rank_input(31, r, (3 * MIB,), torch.float32)]
               for r in range(size)]
    got = hvd.grouped_allreduce(by_rank[rank], op=hvd.Sum, name="staged.transposed")
    assert_members_close(got, by_rank, hvd.Sum, torch.float32, f"grouped, a transposed member, rank {rank}")
    hvd.shutdown()
    return True


def _ranks_that_fill_their_buffers_differently():
    """The channels cut a reduction by its element count alone (Note [Pipelined fusion over
    channels]), so ranks whose tensors take different local ways into it still send the same
    chunks: in place on rank 0 and out of place elsewhere, a member that is no memcpy on rank 0
    only, and a joined rank's neutral input."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    n = 17 * MIB // 4 + 3
    inputs = [rank_input(40, r, (n,), torch.float32) for r in range(size)]
    mine = inputs[rank].clone()
    got = (hvd.allreduce_ if rank == 0 else hvd.allreduce)(mine, op=hvd.Sum, name="mixed.lone")
    assert_close(got, reduce_reference(inputs, hvd.Sum), torch.float32, f"lone tensor, rank {rank}")
    by_rank = [[rank_input(41, r, (2048, 2050), torch.float32), rank_input(42, r, (3 * MIB,), torch.float32)]
               for r in range(size)]
    mine = [t.t().contiguous().t() if rank == 0 and i == 0 else t for i, t in enumerate(by_rank[rank])]
    assert not mine[0].is_contiguous() if rank == 0 else mine[0].is_contiguous()
    got = hvd.grouped_allreduce(mine, op=hvd.Sum, name="mixed.batch")
    assert_members_close(got, by_rank, hvd.Sum, torch.float32, f"batch, rank {rank}")
    if rank == size - 1:
        hvd.join()
    else:
        got = hvd.allreduce(inputs[rank], op=hvd.Sum, name="mixed.joined")
        assert_close(got, reduce_reference(inputs[:-1], hvd.Sum), torch.float32, f"beside a joined rank, rank {rank}")
        hvd.join()
    hvd.shutdown()
    return True


def _batches_streamed_through_the_buffer():
    """Note [Streaming a batch through its buffer] (csrc/cpu_route.h): with a 32 MiB threshold,
    a 95 MB grouped call is one batch staged slot by slot in a 32 MiB buffer; ranks that
    stage it whole (a member that is no memcpy, members sharing memory) or take part joined
    send the same chunks."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    engine = _state.current().sets[0].engine
    assert engine.fusion_threshold_bytes == 32 * MIB
    sizes = [MIB + 3, 0, 5, 5 * MIB - 1, 3 * MIB // 4 + 1] * 3 + [7 * MIB // 2 + 11]  # 95 MB of float32
    for seed, dtype, op, pre, post, in_place in [(50, torch.float32, hvd.Average, 0.5, 3.0, True),
                                                 (51, torch.float32, hvd.Sum, 1.0, 1.0, False),
                                                 (52, torch.int32, hvd.Max, 1.0, 1.0, True)]:
        by_rank = [[rank_input(seed * 100 + i, r, (n,), dtype, op) for i, n in enumerate(sizes)] for r in range(size)]
        before = engine.metrics()["fused_batches"]
        if in_place:
            got = [t.clone() for t in by_rank[rank]]
            hvd.grouped_allreduce_(got, op=op, name=f"streamed.{seed}", prescale_factor=pre, postscale_factor=post)
        else:
            got = hvd.grouped_allreduce(by_rank[rank], op=op, name=f"streamed.{seed}", prescale_factor=pre,
                                        postscale_factor=post)
        assert engine.metrics()["fused_batches"] == before + 1  # one batch, not four
        assert_members_close(got, by_rank, op, dtype, f"streamed {dtype} (op {op}) on rank {rank}", pre, post)
    # rank 0 stages a batch whole: a transposed member, then members that share memory
    by_rank = [[rank_input(60, r, (2048, 2050), torch.float32), rank_input(61, r, (24 * MIB,), torch.float32)]
               for r in range(size)]
    mine = [t.t().contiguous().t() if rank == 0 and i == 0 else t for i, t in enumerate(by_rank[rank])]
    got = hvd.grouped_allreduce(mine, op=hvd.Sum, name="streamed.transposed")
    assert_members_close(got, by_rank, hvd.Sum, torch.float32, f"a transposed member on rank 0, rank {rank}")
    base = [rank_input(62, r, (20 * MIB,), torch.float32) for r in range(size)]
    by_rank = [[b[:12 * MIB], b[8 * MIB:]] for b in base]  # overlapping views of one tensor
    mine = by_rank[rank] if rank == 0 else [t.clone() for t in by_rank[rank]]
    got = hvd.grouped_allreduce(mine, op=hvd.Sum, name="streamed.overlapping")
    assert_members_close(got, by_rank, hvd.Sum, torch.float32, f"members sharing memory on rank 0, rank {rank}")
    # in place, a member inside another: were their slots reused, the inner member would be
    # copied in long after the outer one's results were written over it, and count them
    base = [rank_input(63, r, (16 * MIB,), torch.float32) for r in range(size)]
    mine = base[rank].clone()
    hvd.grouped_allreduce_([mine, mine[2 * MIB:14 * MIB]], op=hvd.Sum, name="streamed.overlapping_")
    assert_close(mine, reduce_reference(base, hvd.Sum), torch.float32, f"in-place overlapping members, rank {rank}")
    # cast on the wire by the engine (Note [Casting on the wire]): float16 chunks of float32
    # members; float64 members
    by_rank = [[rank_input(80 + i, r, (n,), torch.float32) for i, n in enumerate(sizes)] for r in range(size)]
    got = [t.clone() for t in by_rank[rank]]
    hvd.synchronize(ops.allreduce_on_wire_async_(got, torch.float16, "streamed.wire", hvd.Sum, 1.0, 1.0,
                                                 hvd.global_process_set, grouped=True))
    for i, t in enumerate(got):  # float32 results within float16's precision
        want = reduce_reference([members[i] for members in by_rank], hvd.Sum)
        assert t.dtype == torch.float32 and torch.allclose(t, want.to(torch.float32), rtol=1e-2, atol=1e-2 * size), \
            f"float32 as float16 on the wire, rank {rank}, member {i}"

    by_rank = [[rank_input(90 + i, r, (n // 2,), torch.float64) for i, n in enumerate(sizes)] for r in range(size)]
    got = hvd.grouped_allreduce(by_rank[rank], op=hvd.Average, name="streamed.float64")
    assert_members_close(got, by_rank, hvd.Average, torch.float64, f"float64, rank {rank}")
    by_rank = [[rank_input(70 + i, r, (n,), torch.float32) for i, n in enumerate(sizes)] for r in range(size)]
    if rank == size - 1:
        hvd.join()
    else:
        got = hvd.grouped_allreduce(by_rank[rank], op=hvd.Sum, name="streamed.joined")
        assert_members_close(got, by_rank[:-1], hvd.Sum, torch.float32, f"beside a joined rank, rank {rank}")
        hvd.join()
    hvd.shutdown()
    return True


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_batches_larger_than_the_threshold_stream_through_its_buffer(size):
    env = {**GLOO_ONLY, "HVDLITE_FUSION_THRESHOLD": str(32 * MIB)}
    assert all(run_ranks(size, __name__, "_batches_streamed_through_the_buffer", timeout=180, env=env))


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_taking_different_ways_into_the_channels_agree(size):
    assert all(run_ranks(size, __name__, "_ranks_that_fill_their_buffers_differently", timeout=120, env=GLOO_ONLY))


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_striped_allreduce_matches_reference(size):
    assert all(run_ranks(size, __name__, "_striped_allreduces", timeout=120, env=GLOO_ONLY))


@pytest.mark.slow
def test_channel_count_is_rank_0s_when_ranks_disagree():
    # rank 1 asks for one channel, rank 0 for three: everyone must use rank 0's three groups,
    # or the group rendezvous would hang; results must still be exact
    job = Job(2, __name__, "_striped_allreduces", env={"HVDLITE_CPU_CHANNELS": "3", **GLOO_ONLY},
              rank_env_extra={1: {"HVDLITE_CPU_CHANNELS": "1"}})
    assert all(job.wait(timeout=120))


def _groups_made(channels):
    """How many CPU groups each engine made, and the collectives shared memory does not run
    (alltoall, reducescatter) still exact over the one group left where the channel is on."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    pset = hvd.add_process_set(list(range(size)))
    for runtime in _state.current().sets.values():  # one host: shared memory is on unless the job turned it off
        assert runtime.engine.shared_memory == (os.environ.get("HVDLITE_SHARED_MEMORY") != "0")
        expected = 1 if runtime.engine.shared_memory else channels
        assert len(runtime.groups[1]) == expected, \
            f"rank {rank}: {len(runtime.groups[1])} CPU groups, expected {expected}"
    for seed, where in [(70, hvd.global_process_set), (71, pset)]:
        inputs = [rank_input(seed, r, (3 * size, 5), torch.float32) for r in range(size)]
        got = hvd.alltoall(inputs[rank], process_set=where, name=f"groups.alltoall.{seed}")
        want = torch.cat([inputs[r][3 * rank:3 * rank + 3] for r in range(size)])
        assert_close(got, want, torch.float32, f"alltoall, rank {rank}")
        got = hvd.reducescatter(inputs[rank], op=hvd.Sum, process_set=where, name=f"groups.reducescatter.{seed}")
        want = reduce_reference(inputs, hvd.Sum)[3 * rank:3 * rank + 3]
        assert_close(got, want, torch.float32, f"reducescatter, rank {rank}")
    hvd.shutdown()
    return True


@pytest.mark.parametrize("env,channels", [({}, 4), (GLOO_ONLY, 4), ({"HVDLITE_CPU_CHANNELS": "2", **GLOO_ONLY}, 2)])
def test_shared_memory_jobs_make_one_cpu_group(env, channels):
    # Where shared memory carries every CPU allreduce, the striping groups would only cost
    # threads, wakeups and connections; without it, HVDLITE_CPU_CHANNELS of them
    assert all(run_ranks(2, __name__, "_groups_made", channels, timeout=120, env=env))
