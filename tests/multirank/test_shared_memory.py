"""CPU allreduces and negotiation through shared memory when every rank runs on this host (Note
[Shared-memory allreduce] and Note [Control exchange through shared memory], csrc/shm_channel.h):
every dtype and op against an independent reference (on the staged path and on the single-copy
path, Note [Single-copy allreduce]), buffers that span several chunks, a round
too large for a control slot, a process set, the switch that turns it off, and a rank killed
while the others wait inside the channel."""

import glob
import time

import pytest
import torch

import hvdlite as hvd
from hvdlite._runtime import groups as _groups
from hvdlite._runtime import state as _state
from tests.harness import Job, run_ranks
from tests.multirank._reference import assert_close, assert_members_close, rank_input, reduce_reference

CHUNK = 4 << 20  # ShmChannel::ChunkBytes for 2 and 3 ranks


def _leftover_segments(pids):
    """The segments of the ranks `pids` still named in /dev/shm (groups.segment_name_prefix).
    Only theirs: other workers' jobs of a parallel run hold segments of their own meanwhile."""
    return [path for pid in pids for path in glob.glob(f"/dev/shm/{_groups.segment_name_prefix(pid)}*")]


def _job_segments(job):
    return _leftover_segments(proc.pid for proc in job.procs)


def _allreduces(expect_shared, single_copy_min=None):
    """`single_copy_min`: every engine's single-copy threshold for this run (Note [Single-copy
    allreduce]; 1 sends every allreduce that reaches the channel that way, 0 none)."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert _state.current().sets[0].engine.shared_memory == expect_shared
    if single_copy_min is not None:
        assert _state.current().sets[0].engine._set_single_copy_min(single_copy_min)
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
              torch.int16, torch.int32, torch.int64]
    ops = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]
    seed = 0
    for dtype in dtypes:
        for op in ops:
            if op == hvd.Product and dtype == torch.uint8:
                continue
            seed += 1
            n = 1000 + 7 * seed  # above the inline size: these go through the data path
            inputs = [rank_input(seed, r, (n,), dtype, op) for r in range(size)]
            got = hvd.allreduce(inputs[rank], op=op, name=f"t.{seed}")
            assert_close(got, reduce_reference(inputs, op), dtype, f"{dtype} op {op} on rank {rank}")
    # rank 0 unlinked the name once every rank had mapped the segment, before its first round
    assert not _leftover_segments(peer["pid"] for peer in _state.current().peers), \
        "the segment's name must be unlinked once every rank mapped it"
    # several chunks (alternating banks), an element count no share divides, pre- and postscale
    for i, (n, dtype) in enumerate([(5 * CHUNK // 4 + 3, torch.float32), (2 * CHUNK // 8 + 5, torch.float64),
                                    (CHUNK // 4 * 3 + 1, torch.int32)]):
        inputs = [rank_input(100 + i, r, (n,), dtype) for r in range(size)]
        got = hvd.allreduce(inputs[rank], op=hvd.Sum, name=f"big.{i}", prescale_factor=2.0,
                            postscale_factor=0.5)
        assert_close(got, reduce_reference(inputs, hvd.Sum, 2.0, 0.5), dtype, f"big {i} on rank {rank}")
    # fused through one buffer, in place, grouped and async
    shapes = [(300, 70), (5,), (1_100_001,), (2, 3, 4)]
    inputs = [[rank_input(200 + i, r, s, torch.float32) for i, s in enumerate(shapes)] for r in range(size)]
    mine = [t.clone() for t in inputs[rank]]
    hvd.grouped_allreduce_(mine, op=hvd.Sum, name="group")
    assert_members_close(mine, inputs, hvd.Sum, torch.float32, f"grouped on rank {rank}")
    # fused straight into the segment (Note [Fusing straight into shared memory]): members that
    # straddle chunk boundaries, scaling applied once per element, out of place (the inputs
    # stay as they were), integer averages, and a non-contiguous member (the fusion-buffer path)
    for dtype, op, pre, post in [(torch.float64, hvd.Sum, 2.0, 0.5), (torch.int32, hvd.Average, 1.0, 1.0),
                                 (torch.float32, hvd.Max, 1.0, 3.0)]:
        seed = 500 + dtype.itemsize
        per = CHUNK // dtype.itemsize
        sizes = [per // 3 + 1, per - 5, 7, per // 2 + 11, 1]
        group = [[rank_input(seed + i, r, (n,), dtype, op) for i, n in enumerate(sizes)] for r in range(size)]
        before = [t.clone() for t in group[rank]]
        got = hvd.grouped_allreduce(group[rank], op=op, name=f"pieces.{dtype}", prescale_factor=pre,
                                    postscale_factor=post)
        assert_members_close(got, group, op, dtype, f"{dtype} pieces on rank {rank}", pre, post)
        for i in range(len(sizes)):
            assert torch.equal(group[rank][i], before[i]), "an out-of-place allreduce changed its input"
    wide = [rank_input(600, r, (40, 30), torch.float32) for r in range(size)]
    dense = [rank_input(601, r, (1000,), torch.float32) for r in range(size)]
    mixed = [wide[rank].clone().t(), dense[rank].clone()]
    hvd.grouped_allreduce_(mixed, op=hvd.Sum, name="mixed")
    assert_close(mixed[0], reduce_reference(wide, hvd.Sum).t(), torch.float32, f"transposed on rank {rank}")
    assert_close(mixed[1], reduce_reference(dense, hvd.Sum), torch.float32, f"dense beside it on rank {rank}")
    # ranks that disagree about layout: rank 0's members are dense (straight into the segment),
    # the others' are transposed views (through a fusion buffer); both must scale alike
    for op, pre, post in [(hvd.Average, 1.0, 1.0), (hvd.Sum, 2.0, 0.25)]:
        base = [[rank_input(700 + i, r, (CHUNK // 4 // 60 + 3, 60), torch.float32) for i in range(2)]
                for r in range(size)]
        mine = [t.clone() if rank == 0 else t.t().contiguous().t() for t in base[rank]]
        assert all(t.is_contiguous() == (rank == 0) for t in mine)
        got = hvd.grouped_allreduce(mine, op=op, name=f"layouts.{op}", prescale_factor=pre,
                                    postscale_factor=post)
        assert_members_close(got, base, op, torch.float32, f"mixed layouts, op {op} on rank {rank}", pre, post)
        single = base[rank][0].clone() if rank == 0 else base[rank][0].t().contiguous().t()
        got = hvd.allreduce(single, op=op, name=f"layouts.one.{op}", prescale_factor=pre, postscale_factor=post)
        want = reduce_reference([base[r][0] for r in range(size)], op, pre, post)
        assert_close(got, want, torch.float32, f"mixed layouts, one tensor, op {op} on rank {rank}")
    # the same tensor twice in one group, the pair longer than a chunk: members that share memory
    # go through a fusion buffer (ShmChannel::PiecesOverlap)
    base = [rank_input(800, r, (3 * CHUNK // 16,), torch.float32) for r in range(size)]
    twice = base[rank].clone()
    hvd.grouped_allreduce_([twice, twice], op=hvd.Sum, name="twice")
    assert_close(twice, reduce_reference(base, hvd.Sum), torch.float32, f"one tensor twice on rank {rank}")
    mine = [t.clone() for t in inputs[rank]]
    for h in [hvd.allreduce_async_(t, op=hvd.Average, name=f"async.{i}") for i, t in enumerate(mine)]:
        hvd.synchronize(h)
    assert_members_close(mine, inputs, hvd.Average, torch.float32, f"async on rank {rank}")
    # a first round too large for a control slot (1500 new requests with long names, well over
    # 64 KB) is exchanged by Gloo instead (Note [Control exchange through shared memory])
    many = [torch.full((3,), float(rank + 1) * (i % 5 + 1)) for i in range(1500)]
    hvd.grouped_allreduce_(many, op=hvd.Sum, name="a-group-whose-members-have-rather-long-names-" + "x" * 40)
    total = sum(range(1, size + 1))
    for i, t in enumerate(many):
        assert torch.equal(t, torch.full((3,), float(total * (i % 5 + 1)))), f"member {i} on rank {rank}"
    # reducescatter reduces through the same path
    rows = [rank_input(300, r, (size * 5 + 1, 1000), torch.float32) for r in range(size)]
    got = hvd.reducescatter(rows[rank], op=hvd.Sum, name="rs")
    full = reduce_reference(rows, hvd.Sum)
    assert_close(got, full.tensor_split(size)[rank], torch.float32, f"reducescatter on rank {rank}")
    # a process set of the first and last rank gets its own segment
    subset = hvd.add_process_set([0, size - 1])
    if rank in (0, size - 1):
        assert _state.current().sets[subset.process_set_id].engine.shared_memory == expect_shared
        if single_copy_min is not None:
            assert _state.current().sets[subset.process_set_id].engine._set_single_copy_min(single_copy_min)
        inputs = [rank_input(400, r, (CHUNK // 4 + 9,), torch.float32) for r in (0, size - 1)]
        got = hvd.allreduce(inputs[0 if rank == 0 else 1], op=hvd.Sum, name="subset", process_set=subset)
        assert_close(got, reduce_reference(inputs, hvd.Sum), torch.float32, f"process set on rank {rank}")
    hvd.remove_process_set(subset)
    hvd.shutdown()
    return True


# the single-copy path on 3 ranks (uneven shares, three-way order); both paths on 2 and 3
# ranks are compared bit for bit in test_single_copy.py
@pytest.mark.slow
@pytest.mark.parametrize("size,path", [(2, "staged"), (3, "staged"), (3, "single copy")])
def test_shared_memory_allreduce_matches_reference(size, path):
    threshold = 0 if path == "staged" else 1
    job = Job(size, __name__, "_allreduces", True, threshold)
    assert all(job.wait(timeout=180))
    assert not _job_segments(job)


def test_switched_off_with_hvdlite_shared_memory_0():
    assert all(run_ranks(2, __name__, "_allreduces", False, timeout=180,
                         env={"HVDLITE_SHARED_MEMORY": "0"}))


def _own_share_layouts():
    """Note [Own share straight from the input]: each rank reduces its share of a chunk straight
    out of its own tensors where they hold it in a few segments, and copies it into its slot
    where it is prescaled, cast on the wire or scattered over many small members. The ranks
    choose alone (rank 0's share of "big then crumbs" lies in one tensor, the last rank's over
    200 crumbs above the inline size), so every case checks the values against the reference, that every rank got
    the same bits, and which choice this rank made (the channel counts straight chunks)."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    engine = _state.current().sets[0].engine
    assert engine.shared_memory
    engine._set_single_copy_min(0)  # the staged path whatever the size
    per = CHUNK // 4  # float32 elements per chunk
    last = rank == size - 1
    cases = [  # name, shapes, dtype, op, in place, prescale, postscale, fp16 on the wire, straight chunks
        ("one tensor", [(per // 4 + 3,)], torch.float32, hvd.Sum, True, 1.0, 1.0, False, 1),
        ("one tensor, new output", [(per // 4 + 3,)], torch.float32, hvd.Average, False, 1.0, 1.0, False, 1),
        ("wide members", [(20_001,), (35_000,), (18_003,), (40_000,), (27_777,)], torch.float64, hvd.Average,
         False, 1.0, 1.0, False, 1),
        ("big then crumbs", [(150_000,)] + [(300,)] * 200, torch.float32, hvd.Sum, True, 1.0, 1.0, False,
         0 if last else 1),
        ("across chunks", [(700_001,), (500_000,), (333_333,)], torch.float32, hvd.Sum, False, 1.0, 0.5, False, 2),
        ("across chunks, max", [(700_001,), (500_000,), (333_333,)], torch.float32, hvd.Max, True, 1.0, 1.0,
         False, 2),
        ("prescaled", [(20_001,), (35_000,), (40_000,)], torch.float64, hvd.Sum, False, 2.0, 1.0, False, 0),
        ("cast on the wire", [(60_000,), (70_001,)], torch.float32, hvd.Sum, False, 1.0, 1.0, True, 0),
    ]
    for i, (name, shapes, dtype, op, in_place, pre, post, wire, straight) in enumerate(cases):
        group = [[rank_input(900 + 10 * i + j, r, s, dtype, op) for j, s in enumerate(shapes)] for r in range(size)]
        mine = [t.clone() for t in group[rank]]
        kwargs = dict(op=op, name=f"own.{i}", prescale_factor=pre, postscale_factor=post)
        if wire:
            kwargs["compression"] = hvd.Compression.fp16
        before = engine._straight_shares
        if in_place:
            hvd.grouped_allreduce_(mine, **kwargs)
            got = mine
        else:
            got = hvd.grouped_allreduce(mine, **kwargs)
            for j, t in enumerate(mine):
                assert torch.equal(t, group[rank][j]), f"{name}: the out-of-place allreduce changed input {j}"
        chosen = engine._straight_shares - before
        assert chosen == straight, f"{name}: rank {rank} reduced {chosen} chunks straight, expected {straight}"
        if wire:
            for j, t in enumerate(got):
                want = reduce_reference([g[j].half() for g in group], op).float()
                assert_close(t.half(), want.half(), torch.float16, f"{name} on rank {rank}, member {j}")
        else:
            assert_members_close(got, group, op, dtype, f"{name} on rank {rank}", pre, post)
        flat = torch.cat([t.flatten() for t in got])
        agreed = hvd.broadcast(flat, root_rank=0, name=f"own.check.{i}")
        assert torch.equal(flat, agreed), f"{name}: rank {rank}'s result differs from rank 0's"
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_own_share_straight_from_the_input_or_through_the_slot(size):
    job = Job(size, __name__, "_own_share_layouts")
    assert all(job.wait(timeout=120))
    assert not _job_segments(job)


def _rounds_nobody_waits_for():
    """Rounds that run while no caller waits on a handle: their barrier waits go to sleep at
    once instead of yielding (Note [Yield only while a caller waits]). Ranks arrive skewed, so
    the first rank's waits really do sleep; no wait yields (the channel counts both); and the
    results must still be exact."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert _state.current().sets[0].engine.shared_memory
    engine = _state.current().sets[0].engine
    inputs = [[rank_input(500 + i, r, (CHUNK // 4 * 2 + 11 * i,), torch.float32) for i in range(3)]
              for r in range(size)]
    mine = [t.clone() for t in inputs[rank]]
    yielded, slept = engine.shm_waits
    handles = []
    for i, t in enumerate(mine):
        time.sleep(0.03 * rank)  # later ranks arrive later: the earlier ones sleep in the channel
        handles.append(hvd.allreduce_async_(t, op=hvd.Sum, name=f"unwaited.{i}"))
    deadline = time.time() + 30
    while not all(hvd.poll(h) for h in handles):  # completed without anyone waiting on them
        assert time.time() < deadline, f"rank {rank}: rounds nobody waits for did not complete"
        time.sleep(0.01)
    now_yielded, now_slept = engine.shm_waits
    assert now_yielded == yielded, f"rank {rank}: {now_yielded - yielded} waits yielded with no caller waiting"
    if rank == 0:  # first at every barrier, by 30 ms or more
        assert now_slept > slept, "rank 0 never slept in the channel while the later ranks were away"
    names = set()
    for path in glob.glob("/proc/self/task/*/comm"):
        with open(path) as f:
            names.add(f.read().strip())
    assert "hvdlite-engine" in names, f"the engine thread is not named (threads: {sorted(names)})"
    # no rank may shut down (which stops every rank's engine thread) before all have looked
    hvd.allreduce(torch.zeros(1), name="every rank has looked")
    for h in handles:
        hvd.synchronize(h)
    assert_members_close(mine, inputs, hvd.Sum, torch.float32, f"unwaited rounds on rank {rank}")
    hvd.shutdown()
    return True


def test_rounds_that_nobody_waits_for_sleep_in_the_channel_and_stay_exact():
    job = Job(3, __name__, "_rounds_nobody_waits_for")
    assert all(job.wait(timeout=120))
    assert not _job_segments(job)


def _moves():
    # Note [Shared-memory allgather and broadcast]: several chunks, uneven first dimensions
    # (padded slots), every dtype's bytes, a root other than 0, interleaved with allreduces on
    # the same banks; checked against each rank's input, computed here from the seeds
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert _state.current().sets[0].engine.shared_memory
    for i, (rows, dtype) in enumerate([(CHUNK // 4 // 3 + 5, torch.float32), (CHUNK // 8 + 1, torch.float64),
                                       (CHUNK + 3, torch.int8), (300, torch.bfloat16)]):
        inputs = [rank_input(300 + i, r, (rows + 1000 * r, 3), dtype) for r in range(size)]
        got = hvd.allgather(inputs[rank], name=f"gather.{i}")
        assert torch.equal(got, torch.cat(inputs)), f"allgather {i} on rank {rank}"
        root = (i + 1) % size
        t = inputs[rank].clone() if rank == root else torch.zeros_like(inputs[root])
        hvd.broadcast_(t, root_rank=root, name=f"broadcast.{i}")
        assert torch.equal(t, inputs[root]), f"broadcast {i} from {root} on rank {rank}"
        summed = hvd.allreduce(torch.ones(CHUNK // 2 + i), op=hvd.Sum, name=f"between.{i}")
        assert torch.equal(summed, torch.full((CHUNK // 2 + i,), float(size)))
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_shared_memory_allgather_and_broadcast_match_every_ranks_input(size):
    assert all(run_ranks(size, __name__, "_moves", timeout=180))


def _victim_or_survivor(victim, kind="allreduce"):
    hvd.init()
    assert _state.current().sets[0].engine.shared_memory
    if kind == "staged allreduce":
        assert _state.current().sets[0].engine._set_single_copy_min(0)
    big = torch.ones(CHUNK)  # four chunks; 16 MB, single copy unless switched off
    hvd.allreduce(big, name="warm-up")
    print("READY", flush=True)
    started = time.time()
    try:
        if kind == "allgather":  # the victim pauses inside the channel
            hvd.allgather(big, name="never-completes")
        else:
            hvd.allreduce(big, name="never-completes")
    except hvd.RankFailureError as exc:
        return time.time() - started, time.time(), str(exc), exc.ranks
    return None


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["allreduce", "staged allreduce", "allgather"])
def test_rank_killed_inside_the_channel_fails_the_others_naming_it(kind):
    size, victim = 3, 2
    job = Job(size, __name__, "_victim_or_survivor", victim, kind,
              rank_env_extra={victim: {"HVDLITE_TEST_SHM_DELAY_MS": "1000"}})
    for rank in range(size):
        job.wait_for_output(rank, "READY", timeout=60)
    # the victim's first allreduce paused 1 s inside the channel; its second does too
    time.sleep(0.5)
    killed_at = time.time()
    job.kill(victim)
    results = job.wait(timeout=60, allow_failure=(victim,))
    for rank, outcome in enumerate(results):
        if rank == victim:
            continue
        assert outcome is not None, f"rank {rank}: the allreduce completed without rank {victim}"
        _, failed_at, message, ranks = outcome
        assert failed_at - killed_at < 5, f"rank {rank} took {failed_at - killed_at:.1f} s to notice"
        assert f"rank {victim}" in message and "shared memory" in message, message
        assert victim in (ranks or []), (ranks, message)
    assert not _job_segments(job)


def _stopped_peer(victim):
    import os
    import signal
    hvd.init()
    hvd.allreduce(torch.ones(10), name="warm-up")
    if hvd.rank() == victim:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, not dead: killed by the test
    started = time.time()
    try:
        hvd.allreduce(torch.ones(10), name="after")
        outcome = ("no error", time.time() - started, [])
    except hvd.RankFailureError as exc:
        outcome = (str(exc), time.time() - started, exc.ranks)
    print("DONE", flush=True)
    return outcome


@pytest.mark.slow
def test_a_stopped_rank_is_named_within_the_stall_time():
    # a SIGSTOPped peer is alive but frozen: the shared-memory barriers give it the stall
    # shutdown time, not the process-group timeout (groups._channel_timeout)
    size, victim = 3, 2
    job = Job(size, __name__, "_stopped_peer", victim,
              env={"HVDLITE_STALL_CHECK_TIME_SECONDS": "2", "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "4"})
    for rank in range(size):
        if rank != victim:
            job.wait_for_output(rank, "DONE", timeout=60)
    job.kill(victim)
    for rank, outcome in enumerate(job.wait(timeout=30, allow_failure=(victim,))):
        if rank == victim:
            continue
        message, seconds, ranks = outcome
        assert f"rank {victim}" in message, (rank, message)
        assert seconds < 12, (rank, seconds)  # 4 s, a check interval and the census
    assert not _job_segments(job)
