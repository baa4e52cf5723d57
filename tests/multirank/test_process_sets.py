"""Process sets: independent negotiation per set, membership errors, add/remove."""

import threading

import pytest
import torch

import hvdlite as hvd
from tests.harness import run_ranks


def _two_sets():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()  # 3 ranks
    evens = hvd.add_process_set([0, 2])
    odds_and_zero = hvd.add_process_set(hvd.ProcessSet([0, 1]))
    assert evens.included() == (rank in (0, 2)) and evens.size() == 2
    assert odds_and_zero.rank() == (0 if rank == 0 else 1 if rank == 1 else -1)
    results = {}
    # rank 0 is in both sets and drives them from two threads at once: a slow set must not
    # hold up the other (each set has its own engine)
    def in_set(ps, tag, n):
        out = []
        for i in range(n):
            out.append(hvd.allreduce(torch.tensor([float(rank + i)]), op=hvd.Sum, name=f"{tag}.{i}",
                                     process_set=ps).item())
        results[tag] = out
    threads = []
    if rank in (0, 2):
        threads.append(threading.Thread(target=in_set, args=(evens, "evens", 20)))
    if rank in (0, 1):
        threads.append(threading.Thread(target=in_set, args=(odds_and_zero, "low", 20)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # every collective kind within a set, with set-relative semantics
    if rank in (0, 2):
        g = hvd.allgather(torch.tensor([rank]), process_set=evens)
        assert g.tolist() == [0, 2]
        b = hvd.broadcast(torch.tensor([rank]), 2, process_set=evens)
        assert b.item() == 2
        rs = hvd.reducescatter(torch.arange(4.0) * (rank + 1), op=hvd.Sum, process_set=evens)
        assert rs.tolist() == ([0.0, 4.0] if rank == 0 else [8.0, 12.0])
        hvd.barrier(process_set=evens)
        with pytest.raises(ValueError, match="root_rank 1 is not in the process set"):
            hvd.broadcast(torch.ones(1), 1, process_set=evens)
    else:
        with pytest.raises(ValueError, match="rank 1 is not in ProcessSet"):
            hvd.allreduce(torch.ones(1), process_set=evens)
    # a mismatch inside a set names set ranks and leaves the global set alone
    if rank in (0, 1):
        with pytest.raises(hvd.MismatchError, match="shape mismatch: rank 0 has \\[1\\]; rank 1 has \\[2\\]"):
            hvd.allreduce(torch.ones(rank + 1), name="m", process_set=odds_and_zero)
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="global").item()
    assert hvd.remove_process_set(evens) is True
    assert hvd.remove_process_set(evens) is False
    with pytest.raises(ValueError, match="has not been added"):
        hvd.allreduce(torch.ones(1), process_set=evens)
    hvd.shutdown()
    return results, total


def test_two_process_sets_run_concurrently_and_check_membership():
    out = run_ranks(3, __name__, "_two_sets", timeout=90)
    for rank, (results, total) in enumerate(out):
        assert total == 3
        if rank in (0, 2):
            assert results["evens"] == [float(0 + 2 + 2 * i) for i in range(20)]
        if rank in (0, 1):
            assert results["low"] == [float(0 + 1 + 2 * i) for i in range(20)]


def _bad_sets():
    hvd.init()
    with pytest.raises(ValueError, match="ranks \\[5\\] are outside a job of 2 ranks"):
        hvd.add_process_set([0, 5])
    with pytest.raises(ValueError, match="duplicates"):
        hvd.ProcessSet([1, 1])
    with pytest.raises(TypeError, match="must be a hvdlite.ProcessSet"):
        hvd.allreduce(torch.ones(1), process_set="all")
    hvd.shutdown()
    return True


def test_bad_process_sets_raise_clear_errors():
    assert all(run_ranks(2, __name__, "_bad_sets"))


def _set_across_restart():
    hvd.init()
    old = hvd.add_process_set([0, 1])
    if hvd.rank() in (0, 1):
        assert hvd.allreduce(torch.ones(1), name="a", op=hvd.Sum, process_set=old).item() == 2
    hvd.shutdown()
    hvd.init()  # a new generation: set ids start again, so old's id would name `new`
    new = hvd.add_process_set([1, 2])
    errors = []
    assert old.size() is None and old.rank() is None and old.included() is None  # not registered
    with pytest.raises(ValueError) as info:
        hvd.allreduce(torch.ones(1), name="b", process_set=old)
    errors.append(str(info.value))
    removed = hvd.remove_process_set(old)
    again = hvd.add_process_set(old)  # adding it again is the way back
    total = hvd.allreduce(torch.ones(1), name="c", op=hvd.Sum, process_set=again).item() \
        if hvd.rank() in (0, 1) else None
    sizes = (new.size(), again.size())
    hvd.shutdown()
    return errors, removed, total, sizes


def test_process_set_kept_across_shutdown_and_init_does_not_map_onto_another_set():
    for rank, (errors, removed, total, sizes) in enumerate(run_ranks(3, __name__, "_set_across_restart")):
        for message in errors:
            assert "ProcessSet(ranks=[0, 1]) was added before hvdlite.shutdown()" in message, message
        assert removed is False and sizes == (2, 2)
        assert total == (2 if rank in (0, 1) else None)
