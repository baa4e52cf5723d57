"""Point-to-point on the hvdlite backend, through the group's shared-memory mailboxes (Note
[Point-to-point through shared memory] in csrc/shm_point_to_point.h, the default on one host)
and through Gloo (Note [Point-to-point messages] in csrc/point_to_point.h,
HVDLITE_SHM_POINT_TO_POINT=0): send, recv, isend, irecv, recv from any source and batch_isend_irecv,
each checked on every rank against values computed from the sender's rank and step, and run
against a Gloo group in the same job, which must deliver the same; then the errors: a dtype or
size mismatch on both ranks, a receive nothing matches, a peer lost while another waits, abort.
"""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import hvdlite  # noqa: F401  (registers the backend)
from tests.harness import Job, run_ranks

DTYPES = (torch.float32, torch.float64, torch.int64, torch.int8, torch.bool, torch.bfloat16, torch.float16,
          torch.uint8, torch.int16, torch.complex64)


def _payload(src, dst, step, shape=(3, 5), dtype=torch.float32):
    base = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64).reshape(shape)
    value = base + 1000 * src + 100 * dst + step
    if dtype == torch.bool:
        return (value.long() % 2).bool()
    if dtype == torch.complex64:
        return torch.complex(value, -value).to(dtype)
    if dtype in (torch.int8, torch.uint8):
        return (value.long() % 100).to(dtype)
    return value.to(dtype)


# Which path carries a job's messages, and the setting that picks it.
PATHS = {"shared_memory": None, "gloo": {"HVDLITE_SHM_POINT_TO_POINT": "0"}}


def _path():
    from hvdlite._runtime.native import _core
    return _core.point_to_point_path(dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")))


def _init(seconds=60):
    rank, size = int(os.environ["HVDLITE_RANK"]), int(os.environ["HVDLITE_SIZE"])
    for name in ("HVDLITE_RANK", "HVDLITE_SIZE"):  # a plain torch.distributed job
        os.environ.pop(name)
    timeout = datetime.timedelta(seconds=seconds)
    store = dist.TCPStore("127.0.0.1", int(os.environ["HVDLITE_RENDEZVOUS_PORT"]), size, is_master=False,
                          timeout=timeout)
    dist.init_process_group("hvdlite", store=store, rank=rank, world_size=size, timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    return rank, size, gloo


def _exchange(rank, size, group):
    """Every call once, on `group`; returns what this rank received, in a fixed order. (Gloo
    refuses non-contiguous tensors; hvdlite copies them, so only hvdlite gets them.)"""
    strides = group is None
    got = []
    right, left = (rank + 1) % size, (rank - 1) % size
    # blocking send/recv of every dtype, even ranks first (no rank sends and receives at once)
    for step, dtype in enumerate(DTYPES):
        out, into = _payload(rank, right, step, dtype=dtype), torch.empty(3, 5, dtype=dtype)
        if rank % 2 == 0:
            dist.send(out, right, group=group)
            dist.recv(into, left, group=group)
        else:
            dist.recv(into, left, group=group)
            dist.send(out, right, group=group)
        got.append(into)
    # isend/irecv with tags received out of order; a 0-d, an empty and a non-contiguous tensor
    sends = [dist.isend(_payload(rank, right, 50 + t, shape=(4,)), right, group=group, tag=t) for t in (3, 1, 2)]
    sends.append(dist.isend(torch.tensor(7.0 + rank), right, group=group, tag=9))
    sends.append(dist.isend(torch.empty(0, 3), right, group=group, tag=10))
    strided_out = _payload(rank, right, 60, shape=(4, 6)).t()
    sends.append(dist.isend(strided_out if strides else strided_out.contiguous(), right, group=group, tag=11))
    intos = {t: torch.empty(4) for t in (1, 2, 3)}
    recvs = [dist.irecv(intos[t], left, group=group, tag=t) for t in (1, 2, 3)]
    scalar, empty = torch.empty(()), torch.empty(0, 3)
    strided = torch.empty(4, 6).t() if strides else torch.empty(6, 4)
    recvs += [dist.irecv(scalar, left, group=group, tag=9), dist.irecv(empty, left, group=group, tag=10),
              dist.irecv(strided, left, group=group, tag=11)]
    for work in recvs + sends:
        work.wait()
    got += [intos[1], intos[2], intos[3], scalar, empty, strided]
    # several messages of one tag keep their order
    works = [dist.isend(_payload(rank, right, 70 + i, shape=(2,)), right, group=group, tag=4) for i in range(5)]
    ordered = [torch.empty(2) for _ in range(5)]
    works += [dist.irecv(t, left, group=group, tag=4) for t in ordered]
    for work in works:
        work.wait()
    got += ordered
    # a ring of batch_isend_irecv, both directions at once
    a, b = torch.empty(6), torch.empty(6)
    ops = [dist.P2POp(dist.isend, _payload(rank, right, 80, shape=(6,)), right, group),
           dist.P2POp(dist.isend, _payload(rank, left, 81, shape=(6,)), left, group),
           dist.P2POp(dist.irecv, a, left, group), dist.P2POp(dist.irecv, b, right, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    got += [a, b]
    # recv from any source: every other rank sends rank 0 one message
    if rank == 0:
        seen = {}
        for _ in range(size - 1):
            into = torch.empty(2)
            src = dist.recv(into, group=group, tag=20)
            seen[src] = into
        got += [seen[r] for r in range(1, size)]
    else:
        dist.send(_payload(rank, 0, 90, shape=(2,)), 0, group=group, tag=20)
    # a large message
    big_out, big_in = _payload(rank, right, 95, shape=(1 << 20,)), torch.empty(1 << 20)
    works = [dist.isend(big_out, right, group=group, tag=30), dist.irecv(big_in, left, group=group, tag=30)]
    for work in works:
        work.wait()
    got.append(big_in)
    return got


def _expected(rank, size):
    left, right = (rank - 1) % size, (rank + 1) % size
    want = [_payload(left, rank, step, dtype=dtype) for step, dtype in enumerate(DTYPES)]
    want += [_payload(left, rank, 50 + t, shape=(4,)) for t in (1, 2, 3)]
    want += [torch.tensor(7.0 + left), torch.empty(0, 3), _payload(left, rank, 60, shape=(4, 6)).t()]
    want += [_payload(left, rank, 70 + i, shape=(2,)) for i in range(5)]
    want += [_payload(left, rank, 80, shape=(6,)), _payload(right, rank, 81, shape=(6,))]
    if rank == 0:
        want += [_payload(r, 0, 90, shape=(2,)) for r in range(1, size)]
    want.append(_payload(left, rank, 95, shape=(1 << 20,)))
    return want


def _every_call(path):
    rank, size, gloo = _init()
    assert _path() == path
    mine = _exchange(rank, size, None)
    theirs = _exchange(rank, size, gloo)
    want = _expected(rank, size)
    assert len(mine) == len(want) == len(theirs)
    for i, (m, t, w) in enumerate(zip(mine, theirs, want)):
        assert m.dtype == w.dtype and m.shape == w.shape and torch.equal(m, w), (i, m, w)
        assert torch.equal(t, w), ("gloo", i, t, w)
    # one tag's messages keep their order while they arrive during the receiver's own posting
    # (on shared memory a pass over the receives once handed a message to a later receive)
    right, left = (rank + 1) % size, (rank - 1) % size
    for rep in range(100):
        works = [dist.isend(_payload(rank, right, rep, shape=(i + 1,)), right, tag=4) for i in range(5)]
        intos = [torch.empty(i + 1) for i in range(5)]
        works += [dist.irecv(into, left, tag=4) for into in intos]
        for work in works:
            work.wait()
        for i, into in enumerate(intos):
            assert torch.equal(into, _payload(left, rank, rep, shape=(i + 1,))), (rep, i, into)
    dist.destroy_process_group()
    return len(mine)


@pytest.mark.parametrize("size,path", [(2, "shared_memory"), (4, "shared_memory"), (4, "gloo")])
def test_every_point_to_point_call_matches_gloo_and_the_reference(size, path):
    assert all(run_ranks(size, __name__, "_every_call", path, timeout=120, env=PATHS[path]))


def _beside_collectives(path):
    """Rank 1 waits in a recv while ranks 0 and 1 run allreduces on the same group and another
    group's: nothing waits for the recv, and it completes when rank 0 finally sends."""
    rank, size, gloo = _init()
    assert _path() == path
    other = dist.new_group(backend="hvdlite")
    if rank == 1:
        into = torch.empty(3)
        pending = dist.irecv(into, 0, tag=5)
    for i in range(20):
        t = torch.full((4,), float(rank + i))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((4,), float(sum(r + i for r in range(size)))))
        u = torch.full((2,), float(rank))
        dist.all_reduce(u, group=other)
    if rank == 1:
        assert not pending.is_completed()
        from hvdlite._runtime.native import _core
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        lines = _core.pending_point_to_point(backend)
        assert len(lines) == 1 and lines[0].startswith("recv from rank 0 with tag 5: waiting for rank 0 to send"), lines
    dist.barrier()
    if rank == 0:
        dist.send(torch.tensor([1.0, 2.0, 3.0]), 1, tag=5)
    else:
        pending.wait()
        assert torch.equal(into, torch.tensor([1.0, 2.0, 3.0]))
    dist.destroy_process_group()
    return True


@pytest.mark.parametrize("path", list(PATHS))
def test_a_pending_recv_stalls_no_collective(path):
    assert all(run_ranks(2, __name__, "_beside_collectives", path, timeout=90, env=PATHS[path]))


def _mismatch(kind, path):
    rank, size, _ = _init()
    assert _path() == path
    peer = 1 - rank
    if kind == "size":
        out, into = torch.ones(4), torch.full((5,), -1.0)
    else:
        out, into = torch.ones(4), torch.full((4,), -1, dtype=torch.int32)
    with pytest.raises(dist.DistBackendError) as raised:
        if rank == 0:
            dist.send(out, peer, tag=3)
        else:
            dist.recv(into, peer, tag=3)
    # the group stays usable: the mismatched bytes were read, not left on the connection
    t = torch.full((2,), float(rank))
    if rank == 0:
        dist.send(t + 10, peer, tag=3)
    else:
        dist.recv(t, peer, tag=3)
        assert torch.equal(t, torch.full((2,), 10.0))
    if rank == 1:  # no byte of the mismatched message landed in the caller's tensor
        assert torch.equal(into, torch.full_like(into, -1)), into
    dist.destroy_process_group()
    return str(raised.value)


@pytest.mark.parametrize("kind,path", [("size", "shared_memory"), ("dtype", "shared_memory"), ("size", "gloo")])
def test_a_mismatched_recv_raises_on_both_ranks_naming_both(kind, path):
    sender, receiver = run_ranks(2, __name__, "_mismatch", kind, path, timeout=90, env=PATHS[path])
    for message in (sender, receiver):
        assert "rank 0" in message and "rank 1" in message and "tag 3" in message, message
        assert "Float [4]" in message, message
        assert ("Float [5]" if kind == "size" else "Int [4]") in message, message
    assert sender.startswith("hvdlite backend: send to rank 1 with tag 3"), sender
    assert receiver.startswith("hvdlite backend: recv from rank 0 with tag 3"), receiver


def _unmatched(path):
    rank, size, _ = _init(seconds=3)
    assert _path() == path
    started = time.monotonic()
    if rank == 1:
        with pytest.raises(dist.DistBackendError, match="recv from rank 0 with tag 8: waiting for rank 0 to send: "
                                                        "still waiting after 3 s"):
            dist.recv(torch.empty(2), 0, tag=8)
    took = time.monotonic() - started
    dist.barrier()
    dist.destroy_process_group()
    return took


@pytest.mark.parametrize("path", list(PATHS))
def test_a_recv_nothing_matches_fails_at_the_group_timeout_naming_the_pair_and_tag(path):
    took = run_ranks(2, __name__, "_unmatched", path, timeout=60, env=PATHS[path])[1]
    assert took < 30, took


def _lost_peer(path):
    rank, size, _ = _init(seconds=300)
    assert _path() == path
    if rank == 0:
        dist.send(torch.ones(1), 1)  # the pair is connected
        time.sleep(1.0)
        os._exit(17)
    dist.recv(torch.empty(1), 0)
    started = time.monotonic()
    with pytest.raises(dist.DistBackendError, match="recv from rank 0 with tag 0"):
        dist.recv(torch.empty(1), 0)
    return time.monotonic() - started


@pytest.mark.parametrize("path", list(PATHS))
def test_a_peer_lost_during_a_recv_fails_it_at_once_naming_the_peer(path):
    took = Job(2, __name__, "_lost_peer", path, env=PATHS[path]).wait(timeout=60, allow_failure=(0,))[1]
    assert took < 10, took


def _aborted(path):
    rank, size, _ = _init(seconds=300)
    assert _path() == path
    if rank == 1:
        pg = dist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cpu"))
        work = dist.irecv(torch.empty(1), 0, tag=2)
        time.sleep(0.5)
        started = time.monotonic()
        backend.abort()
        with pytest.raises(dist.DistBackendError, match="aborted"):
            work.wait()
        took = time.monotonic() - started
        with pytest.raises(Exception, match="shut down"):
            dist.send(torch.ones(1), 0)
        return took
    time.sleep(3.0)
    return 0.0


@pytest.mark.parametrize("path", list(PATHS))
def test_abort_fails_a_pending_recv_at_once(path):
    took = run_ranks(2, __name__, "_aborted", path, timeout=60, env=PATHS[path])[1]
    assert took < 2.0, took


def _more_than_the_slots():
    """Note [Point-to-point through shared memory]: rank 0 sends 40 messages at once, more than
    a pair's 16 slots, two tags, inline and single-copy sizes mixed, and waits for none before
    rank 1 posts its receives, one tag's all before the other's: each tag's messages arrive in
    the order sent, and every send completes."""
    rank, size, gloo = _init()
    assert _path() == "shared_memory"
    # a rank sends to itself through its own mailbox (a pipeline with two stages on one rank
    # does; Gloo refuses), small and large
    for n in (5, 600_000):
        out, into = _payload(rank, rank, n, shape=(n,)), torch.empty(n)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, rank), dist.P2POp(dist.irecv, into, rank)]):
            work.wait()
        assert torch.equal(into, out)
    sizes = [3 if i % 3 else 300_000 for i in range(40)]  # 1.2 MB: past the inline bytes
    if rank == 0:
        works = [dist.isend(_payload(0, 1, i, shape=(sizes[i],)), 1, tag=i % 2) for i in range(40)]
        dist.barrier()
        for work in works:
            work.wait()
        return True
    dist.barrier()
    time.sleep(0.2)
    order = [i for i in range(40) if i % 2 == 1] + [i for i in range(40) if i % 2 == 0]
    intos = {i: torch.empty(sizes[i]) for i in order}
    works = [dist.irecv(intos[i], 0, tag=i % 2) for i in order]
    for work in works:
        work.wait()
    return all(torch.equal(intos[i], _payload(0, 1, i, shape=(sizes[i],))) for i in range(40))


def test_more_messages_than_a_pairs_slots_keep_their_order_and_a_rank_sends_to_itself():
    assert all(run_ranks(2, __name__, "_more_than_the_slots", timeout=90))


def _irecv_before_a_collective():
    """Rank 1 posts an irecv and blocks in an allreduce; rank 0's blocking send of that message
    must complete before rank 0 reaches the allreduce: rank 1's progress thread takes it while
    no caller on rank 1 waits on any point-to-point work."""
    rank, size, _ = _init()
    assert _path() == "shared_memory"
    t = torch.full((3,), float(rank))
    if rank == 1:
        into = torch.empty(5)
        work = dist.irecv(into, 0, tag=7)
        dist.all_reduce(t)
        work.wait()
        assert torch.equal(into, _payload(0, 1, 7, shape=(5,))), into
    else:
        time.sleep(0.2)
        dist.send(_payload(0, 1, 7, shape=(5,)), 1, tag=7)
        dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), 1.0))
    dist.destroy_process_group()
    return True


def test_an_irecv_nobody_waits_on_is_taken_while_its_rank_blocks_in_a_collective():
    assert all(run_ranks(2, __name__, "_irecv_before_a_collective", timeout=60))


def _callback_that_receives():
    """A callback on an irecv's future that itself blocks in a recv: the progress thread that
    took the first message does not run it (a completion thread does), so the second message
    is still taken and both values arrive."""
    rank, size, _ = _init()
    assert _path() == "shared_memory"
    if rank == 0:
        first, second = torch.empty(3), torch.empty(4)

        def then(_):
            dist.recv(second, 1, tag=2)
            return second.clone()

        chained = dist.irecv(first, 1, tag=1).get_future().then(then)
        got = chained.wait()
        assert torch.equal(first, _payload(1, 0, 1, shape=(3,))) and torch.equal(got, _payload(1, 0, 2, shape=(4,)))
    else:
        time.sleep(0.3)  # rank 0 blocks in the future's wait, so its progress thread takes the first
        dist.send(_payload(1, 0, 1, shape=(3,)), 0, tag=1)
        time.sleep(0.3)
        dist.send(_payload(1, 0, 2, shape=(4,)), 0, tag=2)
    dist.destroy_process_group()
    return True


def test_a_callback_that_receives_does_not_stop_the_messages_it_waits_for():
    assert all(run_ranks(2, __name__, "_callback_that_receives", timeout=60))


def _any_source_after_one_rank_left():
    """A receive from any rank is not failed by a rank that finished and shut its group down
    (only by one that crashed, or by every other rank leaving): rank 2 leaves first, rank 1
    sends later, rank 0 receives it."""
    rank, size, _ = _init()
    assert _path() == "shared_memory"
    if rank == 2:
        dist.destroy_process_group()
        return True
    if rank == 1:
        time.sleep(0.5)  # rank 0 waits meanwhile; rank 2 has gone
        dist.send(_payload(1, 0, 5, shape=(3,)), 0, tag=5)
    else:
        into = torch.empty(3)
        assert dist.recv(into, tag=5) == 1
        assert torch.equal(into, _payload(1, 0, 5, shape=(3,)))
    dist.destroy_process_group()
    return True


def test_a_receive_from_any_rank_outlives_a_rank_that_left_cleanly():
    assert all(run_ranks(3, __name__, "_any_source_after_one_rank_left", timeout=60))
