"""Cross-rank disagreements raise the same error on every rank, and the engine keeps serving."""

import pytest
import torch

import hvdlite as hvd
from tests.harness import run_ranks

# (case, what the error must say) -> each rank submits something slightly different.
CASES = {
    "shape": "shape mismatch: rank 0 has [3]; rank 1 has [4]",
    "dtype": "dtype mismatch: rank 0 has Float; rank 1 has Double",
    "op": "reduce op mismatch: rank 0 has Sum; rank 1 has Max",
    "root": "root rank mismatch: rank 0 has 0; rank 1 has 1",
    "kind": "operation mismatch: rank 0 has allreduce; rank 1 has broadcast",
    "prescale": "prescale factor mismatch: rank 0 has 1; rank 1 has 2",
    "allgather_dims": "shape beyond the first dimension mismatch: rank 0 has [2]; rank 1 has [3]",
    "grouped": "grouped allreduce 'grp': allreduce of 'grp.1': shape mismatch",
}


def _submit_case(case, rank):
    odd = rank == 1
    if case == "shape":
        return hvd.allreduce(torch.ones(4 if odd else 3), name="x")
    if case == "dtype":
        return hvd.allreduce(torch.ones(3, dtype=torch.float64 if odd else torch.float32), name="x")
    if case == "op":
        return hvd.allreduce(torch.ones(3), name="x", op=hvd.Max if odd else hvd.Sum)
    if case == "root":
        return hvd.broadcast(torch.ones(3), 1 if odd else 0, name="x")
    if case == "kind":
        if odd:
            return hvd.broadcast(torch.ones(3), 0, name="x")
        return hvd.allreduce(torch.ones(3), name="x")
    if case == "prescale":
        return hvd.allreduce(torch.ones(3), name="x", prescale_factor=2.0 if odd else 1.0)
    if case == "allgather_dims":
        return hvd.allgather(torch.ones(2, 3 if odd else 2), name="x")
    if case == "grouped":
        return hvd.grouped_allreduce([torch.ones(2), torch.ones(5 if odd else 4)], name="grp")
    raise AssertionError(case)


def _mismatches():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    messages = {}
    for case in CASES:
        try:
            _submit_case(case, rank)
        except hvd.MismatchError as exc:
            messages[case] = str(exc)
            assert isinstance(exc, hvd.HorovodInternalError)
        else:
            raise AssertionError(f"{case}: no error on rank {rank}")
        # the engine keeps serving
        ok = hvd.allreduce(torch.tensor([float(rank)]), name=f"after.{case}", op=hvd.Sum)
        assert ok.item() == sum(range(size))
    hvd.shutdown()
    return messages


def test_each_mismatch_raises_on_every_rank_naming_ranks_and_values():
    per_rank = run_ranks(2, __name__, "_mismatches")
    for case, expected in CASES.items():
        for rank, messages in enumerate(per_rank):
            assert expected in messages[case], (case, rank, messages[case])
        assert per_rank[0][case] == per_rank[1][case], case


def _three_rank_shape():
    hvd.init()
    try:
        hvd.allreduce(torch.ones(2, 3 if hvd.rank() == 2 else 2), name="grad.fc1.weight")
    except hvd.MismatchError as exc:
        msg = str(exc)
    hvd.shutdown()
    return msg


def test_mismatch_on_three_ranks_groups_ranks_by_value():
    msgs = run_ranks(3, __name__, "_three_rank_shape")
    assert msgs[0] == ("allreduce of 'grad.fc1.weight': shape mismatch: ranks 0, 1 have [2, 2]; "
                       "rank 2 has [2, 3]")
    assert msgs[0] == msgs[1] == msgs[2]


def _local_mistakes():
    with pytest.raises(ValueError, match="not initialized"):
        hvd.allreduce(torch.ones(1))
    with pytest.raises(ValueError, match="not initialized"):
        hvd.rank()
    hvd.init()
    hvd.init()  # twice is harmless
    rank = hvd.rank()
    with pytest.raises(ValueError, match="root_rank 5 is out of range"):
        hvd.broadcast(torch.ones(1), 5)
    with pytest.raises(ValueError, match="root_rank -1 is out of range"):
        hvd.broadcast_(torch.ones(1), -1)
    with pytest.raises(TypeError, match="expected a torch.Tensor for 'tensor', got list"):
        hvd.allreduce([1, 2])
    with pytest.raises(TypeError, match="dtype complex64"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="name must be a str"):
        hvd.allreduce(torch.ones(1), name=3)
    with pytest.raises(ValueError, match="op must be one of"):
        hvd.allreduce(torch.ones(1), op=17)
    with pytest.raises(ValueError, match="Adasum is not supported here"):  # an allreduce only
        hvd.reducescatter(torch.ones(2), op=hvd.Adasum)
    with pytest.raises(ValueError, match="either op= or the deprecated average="):
        hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="finite"):
        hvd.allreduce(torch.ones(1), prescale_factor=float("nan"))
    with pytest.raises(TypeError, match="sparse"):
        hvd.allreduce(torch.ones(2).to_sparse())
    with pytest.raises(TypeError, match="non-empty list"):
        hvd.grouped_allreduce([])
    # the public API names group members uniquely; the engine still refuses duplicates
    with pytest.raises(ValueError, match="appears twice"):
        hvd.ops._submit("x", None, 0, [torch.ones(1), torch.ones(1)], [torch.ones(1), torch.ones(1)],
                        ["same", "same"], hvd.ops._tensors, group="g")
    # the same name twice in flight on one rank: rank 1 submits "busy" only after rank 0 has
    # tried the duplicate (signalled by the "go" broadcast), so it cannot have completed
    if rank == 0:
        h = hvd.allreduce_async(torch.ones(2), name="busy")
        with pytest.raises(ValueError, match="'busy': a collective with this name is already in flight"):
            hvd.allreduce_async(torch.ones(2), name="busy")
        hvd.broadcast(torch.ones(1), 0, name="go")
    else:
        hvd.broadcast(torch.ones(1), 0, name="go")
        h = hvd.allreduce_async(torch.ones(2), name="busy")
    assert (hvd.synchronize(h) == 1).all()
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.synchronize(h)
    # after all that the engine still works
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="fine").item() == hvd.size()
    hvd.shutdown()
    # init after shutdown starts a fresh engine
    hvd.init()
    assert hvd.rank() == rank
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="again").item() == hvd.size()
    hvd.shutdown()
    with pytest.raises(ValueError, match="not initialized"):
        hvd.allreduce(torch.ones(1))
    return True


def test_local_mistakes_raise_at_the_call_and_init_is_reentrant():
    assert all(run_ranks(2, __name__, "_local_mistakes"))


def _shutdown_with_pending():
    hvd.init()
    if hvd.rank() == 0:
        h = hvd.allreduce_async(torch.ones(3), name="never-matched")
        try:
            hvd.synchronize(h)
        except hvd.ShutdownError as exc:
            msg = str(exc)
        with pytest.raises(hvd.ShutdownError):
            hvd.allreduce(torch.ones(1), name="later")
        hvd.shutdown()
        return msg
    import time
    time.sleep(0.5)
    hvd.shutdown()
    return None


def test_shutdown_by_one_rank_fails_pending_ops_on_the_others():
    msg = run_ranks(2, __name__, "_shutdown_with_pending")[0]
    assert "allreduce of 'never-matched'" in msg and "shut down (requested by rank 1)" in msg, msg
