"""The CUDA path: tensors on a GPU go through the NCCL process group, fused in device buffers,
ordered with the caller's streams. Skipped cleanly where CUDA is absent (as in CI).

With one GPU the jobs have one rank (NCCL still runs the full path); with several GPUs, one rank
per GPU.
"""

import pytest
import torch

import hvdlite as hvd
from tests.harness import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _ranks():
    return max(1, min(2, torch.cuda.device_count()))


def _core_ops():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64):
        x = (torch.arange(1000, device=dev) % 7).to(dtype) + rank
        out = hvd.allreduce(x, op=hvd.Sum, name=f"ar.{dtype}")
        expected = (torch.arange(1000, device=dev) % 7).to(dtype) * size + sum(range(size))
        assert out.device == dev and torch.equal(out.cpu(), expected.cpu()), dtype
    # fusion of many async tensors in one device buffer
    hs = [hvd.allreduce_async(torch.full((100 + i,), float(rank + i), device=dev), name=f"f{i}", op=hvd.Sum)
          for i in range(100)]
    for i, h in enumerate(hs):
        assert torch.equal(hvd.synchronize(h).cpu(), torch.full((100 + i,), float(size * i + sum(range(size)))))
    g = hvd.allgather(torch.full((rank + 1, 2), float(rank), device=dev), name="ag")
    assert g.shape == (sum(range(1, size + 1)), 2) and g.device == dev
    b = hvd.broadcast(torch.full((5,), float(rank), device=dev), 0, name="bc")
    assert torch.equal(b.cpu(), torch.zeros(5))
    # stream ordering: the input is produced on a side stream; enqueue records an event there
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = torch.ones(1 << 20, device=dev)
        for _ in range(20):
            y = y * 1.0 + 0.0
        out = hvd.allreduce(y, op=hvd.Sum, name="stream")
        assert torch.equal(out, torch.full_like(out, float(size)))
    # mixed CPU and CUDA tensors in one job; a device mismatch across ranks is an error
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum, name="cpu").sum().item() == 3 * size
    if size > 1:
        t = torch.ones(3, device=dev) if rank == 0 else torch.ones(3)
        with pytest.raises(hvd.MismatchError, match="device mismatch"):
            hvd.allreduce(t, name="mixed")
    hvd.shutdown()
    return True


def test_cuda_collectives_fusion_and_streams():
    assert all(run_ranks(_ranks(), __name__, "_core_ops", timeout=180))


def _point_to_point():
    """Note [CUDA point-to-point] (csrc/torch_backend.h): a group of the backend "hvdlite" sends
    CUDA tensors through its engine's NCCL group; every value checked against the sender's."""
    import os

    import torch.distributed as dist
    rank, size = int(os.environ["HVDLITE_RANK"]), int(os.environ["HVDLITE_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("hvdlite", init_method="hvdlite://")
    dev = torch.device("cuda", rank)
    peer = 1 - rank
    mine = torch.arange(1 << 20, device=dev, dtype=torch.float32) + 1000 * rank
    theirs = torch.arange(1 << 20, device=dev, dtype=torch.float32) + 1000 * peer
    into = torch.empty_like(mine)
    if rank == 0:
        dist.send(mine, peer)
        dist.recv(into, peer)
    else:
        dist.recv(into, peer)
        dist.send(mine, peer)
    assert torch.equal(into, theirs)
    into = torch.empty_like(mine)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, into, peer)]):
        work.wait()
    torch.cuda.synchronize()
    assert torch.equal(into, theirs)
    with pytest.raises(Exception, match="any source"):
        dist.recv(torch.empty(3, device=dev))
    dist.destroy_process_group()
    return True


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="point-to-point over NCCL needs two GPUs")
def test_cuda_point_to_point_through_nccl():
    assert all(run_ranks(2, __name__, "_point_to_point", timeout=180))
