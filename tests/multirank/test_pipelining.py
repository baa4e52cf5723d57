"""torch.distributed.pipelining on the hvdlite backend: the schedules exchange activations and
gradients between stages by batch_isend_irecv (Note [Point-to-point messages] in
csrc/point_to_point.h). Each stage's gradients and the losses must equal one process running
the whole model on the same micro-batches; PP x DP averages each stage's gradients over its
replicas, all on hvdlite, and must train to the same parameters as one process."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hvdlite  # noqa: F401  (registers the backend)
from tests.harness import run_ranks

WIDTH, LAYERS, MICRO = 16, 8, 4


def _init():
    rank, size = int(os.environ["HVDLITE_RANK"]), int(os.environ["HVDLITE_SIZE"])
    for name in ("HVDLITE_RANK", "HVDLITE_SIZE"):  # a plain torch.distributed job
        os.environ.pop(name)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", int(os.environ["HVDLITE_RENDEZVOUS_PORT"]), size, is_master=False,
                          timeout=timeout)
    dist.init_process_group("hvdlite", store=store, rank=rank, world_size=size, timeout=timeout)
    return rank, size


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _data(seed=1, rows=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def _schedule(name, stages, loss_fn):
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleLoopedBFS)
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
           "looped": ScheduleLoopedBFS, "zbv": ScheduleZBVZeroBubble}[name]
    return cls(stages[0] if len(stages) == 1 else stages, n_microbatches=MICRO, loss_fn=loss_fn)


def _step(schedule, ids, n_stages, x, y):
    """One schedule step from this rank's side; the losses if it holds the last stage."""
    losses = []
    first, last = 0 in ids, n_stages - 1 in ids
    if first and last:
        schedule.step(x, target=y, losses=losses)
    elif first:
        schedule.step(x)
    elif last:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    return losses


def _stages(layers, ids, n_stages, group=None):
    from torch.distributed.pipelining import PipelineStage
    per = LAYERS // n_stages
    return [PipelineStage(nn.Sequential(*layers[s * per:(s + 1) * per]), s, n_stages, torch.device("cpu"),
                          group=group) for s in ids]


def _pipeline(name):
    rank, size = _init()
    per_rank = 2 if name in ("interleaved", "looped", "zbv") else 1
    n_stages = size * per_rank
    ids = [rank + i * size for i in range(per_rank)]
    if name == "zbv":  # V-shaped: the middle two stages share the last rank, which sends to itself
        ids = [rank, n_stages - 1 - rank]
    layers = _model()
    loss_fn = nn.MSELoss(reduction="sum")
    x, y = _data()
    losses = _step(_schedule(name, _stages(layers, ids, n_stages), loss_fn), ids, n_stages, x, y)
    # the reference: the whole model in this process, the same micro-batches; the schedules
    # scale gradients by 1 / n_microbatches
    whole = _model()
    total = sum(loss_fn(whole(xc), yc) for xc, yc in zip(x.chunk(MICRO), y.chunk(MICRO)))
    (total / MICRO).backward()
    per = LAYERS // n_stages
    for s in ids:
        for j in range(s * per, (s + 1) * per):
            for mine, ref in zip(layers[j].parameters(), whole[j].parameters()):
                assert torch.allclose(mine.grad, ref.grad, atol=1e-5), (name, s, j, (mine.grad - ref.grad).abs().max())
    if losses:
        assert abs(sum(loss.item() for loss in losses) - total.item()) < 1e-4, (losses, total)
    dist.destroy_process_group()
    return len(ids)


@pytest.mark.parametrize("name,size", [("gpipe", 2), ("1f1b", 2), ("1f1b", 4), ("interleaved", 4), ("looped", 4),
                                       ("zbv", 2)])
def test_a_pipeline_schedule_matches_one_process(name, size):
    assert all(run_ranks(size, __name__, "_pipeline", name, timeout=120))


def _pp_dp(steps):
    """4 ranks: 2 pipeline stages, each replicated twice; each stage's gradients averaged over
    its replicas on the data-parallel group. (DDP under a pipeline schedule, which runs backward
    once per micro-batch, lands 2e-3 away from one process on a gloo group as on hvdlite.)"""
    rank, size = _init()
    stage, replica = rank % 2, rank // 2
    # every rank creates every group, in the same order
    pp = [dist.new_group([0, 1]), dist.new_group([2, 3])][replica]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][stage]
    layers = _model()
    per = LAYERS // 2
    part = nn.Sequential(*layers[stage * per:(stage + 1) * per])
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    loss_fn = nn.MSELoss(reduction="sum")
    schedule = ScheduleGPipe(PipelineStage(part, stage, 2, torch.device("cpu"), group=pp), n_microbatches=MICRO,
                             loss_fn=loss_fn)
    optimizer = torch.optim.SGD(part.parameters(), lr=0.01)
    whole = _model()
    reference = torch.optim.SGD(whole.parameters(), lr=0.01)
    for step in range(steps):
        x, y = _data(seed=100 + step, rows=16)
        mine_x, mine_y = x.chunk(2)[replica], y.chunk(2)[replica]  # each replica its half
        optimizer.zero_grad()
        _step(schedule, [stage], 2, mine_x, mine_y)
        for p in part.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=dp)
        optimizer.step()
        # the reference: the whole batch, the same scaling (1 / micro-batches, the mean over 2)
        reference.zero_grad()
        total = sum(loss_fn(whole(xc), yc) for half in range(2)
                    for xc, yc in zip(x.chunk(2)[half].chunk(MICRO), y.chunk(2)[half].chunk(MICRO)))
        (total / (MICRO * 2)).backward()
        reference.step()
    for j in range(stage * per, (stage + 1) * per):
        for mine, ref in zip(layers[j].parameters(), whole[j].parameters()):
            assert torch.allclose(mine, ref, atol=1e-5), (j, (mine - ref).abs().max())
    dist.destroy_process_group()
    return True


def test_pipeline_times_data_parallel_trains_as_one_process():
    assert all(run_ranks(4, __name__, "_pp_dp", 3, timeout=150))
