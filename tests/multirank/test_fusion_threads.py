"""Many async tensors at once (fusion) and several Python threads enqueueing concurrently."""

import threading

import pytest
import torch

import hvdlite as hvd
from tests.harness import run_ranks
from tests.multirank._reference import assert_close, rank_input, reduce_reference

SIZES = [1, 7, 100, 1000, 4099, 30000]


def _many_async():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    inputs, handles = [], []
    for i in range(300):
        dtype = (torch.float32, torch.float64, torch.int64)[i % 3]
        shape = (SIZES[i % len(SIZES)],)
        ranks = [rank_input(1000 + i, r, shape, dtype) for r in range(size)]
        inputs.append(ranks)
        handles.append(hvd.allreduce_async(ranks[rank], name=f"t{i}", op=hvd.Sum))
    for i, h in enumerate(handles):
        assert_close(hvd.synchronize(h), reduce_reference(inputs[i], hvd.Sum), inputs[i][0].dtype, f"t{i}")
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size,threshold", [(2, None), (3, None), (2, "4096"), (2, "0")])
def test_300_async_allreduces_of_mixed_sizes_match_reference(size, threshold):
    env = {"HVDLITE_FUSION_THRESHOLD": threshold} if threshold else None
    assert all(run_ranks(size, __name__, "_many_async", env=env, timeout=90))


def _threads():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    errors = []

    def worker(t):
        try:
            for i in range(50):
                ranks = [rank_input(t * 100 + i, r, (33,), torch.float32) for r in range(size)]
                kind = i % 3
                if kind == 0:
                    out = hvd.allreduce(ranks[rank], name=f"th{t}.{i}")
                    assert_close(out, reduce_reference(ranks, hvd.Average), torch.float32, f"th{t}.{i}")
                elif kind == 1:
                    out = hvd.allgather(ranks[rank], name=f"th{t}.{i}")
                    assert_close(out, torch.cat(ranks), torch.float32, f"ag th{t}.{i}")
                else:
                    out = hvd.broadcast(ranks[rank], t % size, name=f"th{t}.{i}")
                    assert_close(out, ranks[t % size], torch.float32, f"bc th{t}.{i}")
        except BaseException as exc:  # reported below, on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "a worker thread hung"
    assert not errors, errors[0]
    hvd.shutdown()
    return True


@pytest.mark.parametrize("size", [2, 3])
def test_four_threads_enqueueing_at_once_get_correct_results(size):
    assert all(run_ranks(size, __name__, "_threads", timeout=90))
