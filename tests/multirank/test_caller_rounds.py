"""A waiting caller running its own round (Note [A waiting caller runs the round] in
csrc/round_driver.h): hvd.allreduce and hvd.allreduce_ in their common case take one native call and
the caller, not the background thread, runs the round. The values must not care which thread
ran it, with caller rounds on or off, beside async work from other threads, in any grad mode."""

import threading
import time

import pytest
import torch

import hvdlite as hvd
from hvdlite._runtime import state
from tests.harness import run_ranks
from tests.multirank._reference import DTYPES, OPS, assert_close, rank_input, reduce_reference

ON = {"HVDLITE_CALLER_ROUNDS": "1"}  # the default, said explicitly (Note [A waiting caller runs the round])


def _inputs(seed, shape, dtype, op, size):
    return [rank_input(seed, r, shape, dtype, op) for r in range(size)]


def _synchronous_mix():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for i in range(240):
        dtype, op = DTYPES[i % len(DTYPES)], OPS[(i // len(DTYPES)) % len(OPS)]
        shape = ((1,), (5, 3), (1000,), (0,))[i % 4]
        ranks = _inputs(i, shape, dtype, op, size)
        want = reduce_reference(ranks, op)
        mine = ranks[rank].clone()
        how = i % 5
        if how == 0:  # new tensor, unnamed (matched by call order)
            out = hvd.allreduce(mine, op=op)
            assert out.data_ptr() != mine.data_ptr() or mine.numel() == 0, "allreduce returned its input"
            assert torch.equal(mine, ranks[rank]), f"allreduce {i} changed its input"
        elif how == 1:  # in place, named
            out = hvd.allreduce_(mine, op=op, name=f"inplace.{i}")
            assert out is mine, "allreduce_ must return its tensor"
        elif how == 2:  # a tensor that wants a gradient, with grad off
            if dtype.is_floating_point:
                mine.requires_grad_()
            with torch.no_grad():
                out = hvd.allreduce(mine, op=op, name=f"nograd.{i}")
            assert not out.requires_grad
        elif how == 3:  # from inference mode
            with torch.inference_mode():
                out = hvd.allreduce(mine, op=op, name=f"inference.{i}")
        else:  # a non-contiguous view: the result is contiguous, the view unchanged
            wide = torch.stack([mine, mine], dim=-1)
            view = wide[..., 0]
            out = hvd.allreduce(view, op=op, name=f"view.{i}")
            assert out.is_contiguous()
        assert_close(out.detach(), want, dtype, f"call {i} (form {how})")
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size,caller_rounds", [(2, "1"), (3, "1"), (2, "0")])
def test_synchronous_allreduces_match_reference_whoever_runs_the_round(size, caller_rounds):
    env = {"HVDLITE_CALLER_ROUNDS": caller_rounds}
    assert all(run_ranks(size, __name__, "_synchronous_mix", env=env, timeout=120))


def _repeated_mid_size():
    """Allreduces of 0.2-1.7 MB under the same names every pass: from the second pass the caller
    runs these rounds too (Note [A waiting caller runs the round]: a repeated CPU allreduce over
    shared memory up to 4 MB); in the last pass one name comes back with another shape (a cache
    miss: the background thread's round again)."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    configs = [(dtype, op) for dtype in (torch.float16, torch.float32, torch.float64, torch.int8, torch.int64)
               for op in (hvd.Average, hvd.Sum, hvd.Max)
               if dtype.is_floating_point or op != hvd.Average]
    engine = state.current().engine
    counts = []
    for rep in range(3):
        counts.append(engine._caller_rounds)
        for k, (dtype, op) in enumerate(configs):
            shape = (300, 701) if rep == 2 and k == 0 else (300, 700)
            ranks = _inputs(100 * rep + k, shape, dtype, op, size)
            name = f"mid.{k}"
            if k % 3 == 0:  # in place
                out = hvd.allreduce_(ranks[rank].clone(), op=op, name=name)
                want = reduce_reference(ranks, op)
            elif k % 3 == 1:  # a new tensor
                out = hvd.allreduce(ranks[rank], op=op, name=name)
                want = reduce_reference(ranks, op)
            else:  # scaled on the way (floating point) or plain
                scale = dtype.is_floating_point and op == hvd.Sum
                pre, post = (0.5, 4.0) if scale else (1.0, 1.0)
                out = hvd.allreduce(ranks[rank], op=op, name=name, prescale_factor=pre, postscale_factor=post)
                want = reduce_reference(ranks, op, pre, post)
            assert_close(out, want, dtype, f"pass {rep}, {name} ({dtype}, {op})")
    # the second pass repeats every request of the first: its rounds are the callers' (the
    # background thread may take one now and then at a heartbeat)
    assert counts[1] - counts[0] <= 2, counts  # new names: the background thread's
    assert engine._caller_rounds - counts[1] >= len(configs), (counts, engine._caller_rounds)
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_repeated_mid_size_allreduces_whoever_runs_the_round(size):
    assert all(run_ranks(size, __name__, "_repeated_mid_size", timeout=120, env=ON))


def _beside_async_threads():
    """A thread keeps batches of async in-place allreduces in flight (the background thread's
    rounds) while the main thread makes synchronous calls (its own rounds)."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    errors = []

    def async_worker():
        try:
            for step in range(40):
                ranks = [_inputs(5000 + step * 8 + j, (257,), torch.float32, hvd.Sum, size) for j in range(8)]
                mine = [r[rank].clone() for r in ranks]
                handles = [hvd.allreduce_async_(t, name=f"async.{step}.{j}", op=hvd.Sum)
                           for j, t in enumerate(mine)]
                for j, h in enumerate(handles):
                    assert_close(hvd.synchronize(h), reduce_reference(ranks[j], hvd.Sum), torch.float32,
                                 f"async {step}.{j}")
        except BaseException as exc:  # reported on the main thread
            errors.append(exc)

    worker = threading.Thread(target=async_worker)
    worker.start()
    for i in range(150):
        ranks = _inputs(9000 + i, (3,), torch.int64, hvd.Max, size)
        out = hvd.allreduce(ranks[rank], op=hvd.Max, name=f"sync.{i}")
        assert_close(out, reduce_reference(ranks, hvd.Max), torch.int64, f"sync {i}")
    worker.join(timeout=60)
    assert not worker.is_alive(), "the async thread hung"
    assert not errors, errors[0]
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_caller_rounds_beside_background_rounds(size):
    assert all(run_ranks(size, __name__, "_beside_async_threads", timeout=120, env=ON))


def _late_peer_and_mismatch():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # The last rank arrives late: the others' callers run rounds (or hand them back) meanwhile.
    if rank == size - 1:
        time.sleep(1.0)
    ranks = _inputs(77, (64,), torch.float64, hvd.Sum, size)
    assert_close(hvd.allreduce(ranks[rank], op=hvd.Sum, name="late"), reduce_reference(ranks, hvd.Sum),
                 torch.float64, "late peer")
    # Ranks that disagree get the error on every rank, from the caller's own round.
    shape = (4,) if rank == 0 else (5,)
    try:
        hvd.allreduce(torch.ones(shape), name="disagree")
    except hvd.HvdliteError as exc:
        message = str(exc)
    else:
        raise AssertionError("a shape mismatch went unreported")
    assert "disagree" in message and "shape" in message, message
    # ...and the job goes on.
    ranks = _inputs(78, (2,), torch.int32, hvd.Min, size)
    assert_close(hvd.allreduce(ranks[rank], op=hvd.Min, name="after"), reduce_reference(ranks, hvd.Min),
                 torch.int32, "after the mismatch")
    hvd.shutdown()
    return message


def test_a_late_peer_and_a_mismatch_on_the_callers_round():
    messages = run_ranks(3, __name__, "_late_peer_and_mismatch", timeout=90, env=ON)
    assert len(messages) == 3 and all("disagree" in m for m in messages), messages


def _inference_tensors():
    """Note [Inference tensors] in csrc/engine.h: every form works on tensors made under
    torch.inference_mode, in place or not, waited for inside inference mode or outside it."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    ranks = _inputs(31, (6, 2), torch.float32, hvd.Sum, size)
    want = reduce_reference(ranks, hvd.Sum)
    with torch.inference_mode():
        mine = ranks[rank].clone()
        assert mine.is_inference()
        assert_close(hvd.allreduce(mine, op=hvd.Sum, name="inf.new"), want, torch.float32, "allreduce")
        assert hvd.allreduce_(mine, op=hvd.Sum, name="inf.inplace") is mine
        assert_close(mine, want, torch.float32, "allreduce_ of an inference tensor")
        fresh = ranks[rank].clone()
        handle = hvd.allreduce_async_(fresh, op=hvd.Sum, name="inf.async")
        gathered = hvd.allgather(ranks[rank].clone(), name="inf.gather")
        sent = hvd.broadcast(ranks[rank].clone(), size - 1, name="inf.bcast")
    hvd.synchronize(handle)  # taken outside inference mode
    assert_close(fresh, want, torch.float32, "async allreduce_ waited outside inference mode")
    assert_close(gathered, torch.cat(ranks), torch.float32, "allgather")
    assert_close(sent, ranks[size - 1], torch.float32, "broadcast")
    hvd.shutdown()
    return True


def test_inference_tensors_are_reduced_in_every_form():
    assert all(run_ranks(2, __name__, "_inference_tensors", timeout=60, env=ON))
