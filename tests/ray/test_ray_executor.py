"""hvdlite.ray.RayExecutor on a local Ray cluster: collectives, a training step, a worker that
dies, and nothing left behind."""
import os
import time

import pytest
import torch

import hvdlite as hvd
from tests.multirank._reference import linear_training


def _alive(pid):
    from hvdlite._runtime.liveness import running
    return running(pid)


def place_and_sum():
    hvd.init()
    got = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="x").item()
    return (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
            hvd.cross_size(), got, os.getpid())


def training_steps(steps):
    """A linear model trained with DistributedOptimizer on rank-specific batches."""
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + hvd.rank())
        x = torch.randn(8, 4, generator=g)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        optimizer.step()
    return model.weight.detach().flatten().tolist()


def one_dies():
    hvd.init()
    hvd.allreduce(torch.ones(1), name="before")
    if hvd.rank() == 1:
        os._exit(3)
    hvd.allreduce(torch.ones(1), name="after")  # rank 0 loses its peer here
    return "unreachable"


def test_executor_ranks_collectives_and_training(ray_cluster):
    from hvdlite.ray import RayExecutor
    t0 = time.monotonic()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2, cpus_per_worker=1)
    executor.start()
    started = time.monotonic() - t0
    try:
        results = executor.run(place_and_sum)
        # One node: local ranks follow the ranks, one cross group; 1 + 2 summed on both.
        assert [r[:7] for r in results] == [(0, 2, 0, 2, 0, 1, 3.0), (1, 2, 1, 2, 0, 1, 3.0)], results
        assert [r[7] for r in results] == [n["pid"] for n in executor.nodes]
        weights = executor.run(training_steps, args=(5,))
        expected, _ = linear_training(5, 2)
        for w in weights:
            assert torch.allclose(torch.tensor(w), torch.tensor(expected), atol=1e-6), (w, expected)
        assert executor.execute(lambda executable: executable) == [None, None]
    finally:
        executor.shutdown()
    print(f"RayExecutor with 2 workers started in {started:.2f} s")


def test_dead_worker_is_named_and_shutdown_leaves_nothing(ray_cluster):
    from hvdlite.ray import RayExecutor, RayWorkerError
    executor = RayExecutor(num_workers=2).start()
    pids = [n["pid"] for n in executor.nodes]
    try:
        with pytest.raises(RayWorkerError) as caught:
            executor.run(one_dies)
    finally:
        executor.shutdown()
    error = caught.value
    assert error.rank == 1 and error.node, error
    assert "rank 1 (node" in str(error) and "died" in str(error), error
    # Rank 0 raised RankFailureError (it lost its peer) instead of aborting.
    assert error.errors[0].startswith("RankFailureError"), error.errors
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []


def test_ranks_follow_ray_placement_node_by_node(ray_cluster):
    """Note [Ray placement], for a layout one machine cannot produce: workers 0-4 placed on
    nodes b, a, b, c, a (in the order Ray answered)."""
    from hvdlite.ray import places
    ranks, by_rank = places(["b", "a", "b", "c", "a"])
    # Node b first (it has worker 0), then a, then c; ranks node by node.
    assert by_rank == [0, 2, 1, 4, 3]
    # (rank, local_rank, local_size, cross_rank, cross_size) of each worker.
    assert ranks == {0: (0, 0, 2, 0, 3), 2: (1, 1, 2, 0, 2), 1: (2, 0, 2, 1, 3),
                     4: (3, 1, 2, 1, 2), 3: (4, 0, 1, 2, 3)}
