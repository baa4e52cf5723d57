"""hvdlite inside Ray Train's TorchTrainer: Ray sets up torch.distributed, hvd.init() builds
hvdlite's groups beside it, and a DistributedOptimizer loop trains to the same weights as a
single-process reference."""
import json

import torch

from tests.multirank._reference import linear_training


def train_loop(config):
    import json
    import os

    import ray.train
    import torch.distributed as dist

    import hvdlite as hvd
    from tests.ray.test_ray_executor import training_steps

    assert dist.is_initialized()  # Ray Train's own process group
    weights = training_steps(config["steps"])
    ray_rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"rank{ray_rank}.json"), "w") as f:
        json.dump({"weights": weights, "rank": hvd.rank(), "size": hvd.size(), "ray_rank": ray_rank}, f)


def test_distributed_optimizer_under_torch_trainer(ray_cluster, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(train_loop, train_loop_config={"steps": 4, "out": str(tmp_path)},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=str(tmp_path), name="hvdlite"))
    result = trainer.fit()
    assert result.error is None, result.error
    expected, _ = linear_training(4, 2)
    for ray_rank in range(2):
        got = json.loads((tmp_path / f"rank{ray_rank}.json").read_text())
        # hvdlite's ranks are Ray Train's, and every rank ends with the reference's weights.
        assert (got["rank"], got["size"]) == (ray_rank, 2), got
        assert torch.allclose(torch.tensor(got["weights"]), torch.tensor(expected), atol=1e-6), got
