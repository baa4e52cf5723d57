"""A job for the hierarchical allreduce test (Note [Hierarchical allreduce], csrc/cpu_route.h):
allreduces of every op over several dtypes and sizes, grouped, reducescatter and an optimizer
step, each checked on every rank against a reference computed here from every rank's inputs.
Prints one HIERARCHICAL line per rank."""
import socket
import sys

import torch

import hvdlite as hvd
from hvdlite._runtime import state as _state
from tests.multirank._reference import assert_close, assert_members_close, rank_input, reduce_reference

CHUNK = 4 << 20  # ShmChannel::ChunkBytes for 2 ranks on a host


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    engine = _state.current().sets[0].engine
    seed = 0
    for dtype in (torch.float32, torch.float64, torch.int32, torch.bfloat16):
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            seed += 1
            inputs = [rank_input(seed, r, (999 + seed,), dtype, op) for r in range(size)]
            got = hvd.allreduce(inputs[rank], op=op, name=f"t.{seed}")
            assert_close(got, reduce_reference(inputs, op), dtype, f"{dtype} op {op} on rank {rank}")
    inputs = [rank_input(50, r, (3 * CHUNK // 4 + 11,), torch.float32) for r in range(size)]  # three chunks
    got = hvd.allreduce(inputs[rank], op=hvd.Average, name="big")
    assert_close(got, reduce_reference(inputs, hvd.Average), torch.float32, f"big on rank {rank}")
    shapes = [(30, 7), (5,), (200_001,)]
    inputs = [[rank_input(60 + i, r, s, torch.float32) for i, s in enumerate(shapes)] for r in range(size)]
    mine = [t.clone() for t in inputs[rank]]
    hvd.grouped_allreduce_(mine, op=hvd.Sum, name="group")
    assert_members_close(mine, inputs, hvd.Sum, torch.float32, f"grouped on rank {rank}")
    # grouped and scaled, members straddling the 2 MB chunks the hierarchical path cuts at; the
    # scaling happens once, after the sum across hosts (Note [Fusing straight into shared memory])
    sizes = [300_001, 7, 700_003]
    for dtype, op, pre, post in [(torch.float64, hvd.Sum, 2.0, 0.5), (torch.int32, hvd.Average, 1.0, 1.0)]:
        group = [[rank_input(80 + i, r, (n,), dtype, op) for i, n in enumerate(sizes)] for r in range(size)]
        got = hvd.grouped_allreduce(group[rank], op=op, name=f"scaled.{dtype}", prescale_factor=pre,
                                    postscale_factor=post)
        assert_members_close(got, group, op, dtype, f"scaled grouped {dtype} on rank {rank}", pre, post)
    # ranks that disagree about layout (dense on even ranks, transposed views on odd ones) take
    # different entries into the channel and must still scale alike
    base = [rank_input(90, r, (20_001, 30), torch.float32) for r in range(size)]
    mine = base[rank].clone() if rank % 2 == 0 else base[rank].t().contiguous().t()
    got = hvd.grouped_allreduce([mine, mine * 2], op=hvd.Average, name="layouts", postscale_factor=0.5)
    for i, factor in enumerate((1, 2)):
        want = reduce_reference([b * factor for b in base], hvd.Average, 1.0, 0.5)
        assert_close(got[i], want, torch.float32, f"mixed layouts member {i} on rank {rank}")
    # Note [Casting on the wire] (csrc/executor.h): fp16 compression cast on the copies into and
    # out of the channel, members of four dtypes straddling the chunks; odd ranks pass two
    # members as strided views and go through a fusion buffer instead, and every rank must agree
    dtypes = [torch.float32, torch.int32, torch.float64, torch.float16, torch.float32]
    sizes = [700_001, 9, 300_003, 500_001, 1_100_007]
    group = [[rank_input(100 + i, r, (n,), d, hvd.Average) for i, (n, d) in enumerate(zip(sizes, dtypes))]
             for r in range(size)]
    mine = list(group[rank])
    if rank % 2:
        mine[0], mine[4] = (torch.stack([t, t], 1)[:, 0] for t in (mine[0], mine[4]))  # same values, stride 2
    got = hvd.grouped_allreduce(mine, op=hvd.Average, name="cast", compression=hvd.Compression.fp16,
                                postscale_factor=2.0)
    for i, (actual, d) in enumerate(zip(got, dtypes)):
        sent = [g[i].half() if d.is_floating_point else g[i] for g in group]
        assert actual.dtype == d, f"cast member {i}: dtype {actual.dtype} on rank {rank}"
        assert_close(actual.to(sent[0].dtype), reduce_reference(sent, hvd.Average, 1.0, 2.0), sent[0].dtype,
                     f"fp16 on the wire, member {i} ({d}) on rank {rank}")
    rows = [rank_input(70, r, (size * 3, 100), torch.float32) for r in range(size)]
    got = hvd.reducescatter(rows[rank], op=hvd.Sum, name="rs")
    assert_close(got, reduce_reference(rows, hvd.Sum).tensor_split(size)[rank], torch.float32,
                 f"reducescatter on rank {rank}")
    model = torch.nn.Linear(4, 1, bias=False)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    w0 = model.weight.detach().clone()
    batches = [torch.full((2, 4), float(r + 1)) for r in range(size)]
    model(batches[rank]).sum().backward()
    opt.step()
    grad = sum(b.sum(0) for b in batches) / size
    assert torch.allclose(model.weight.detach(), w0 - 0.1 * grad.unsqueeze(0), atol=1e-5)
    print(f"HIERARCHICAL rank {rank} of {size} on {socket.gethostname()} hierarchical={engine.hierarchical} "
          f"shared_memory={engine.shared_memory} cpu_groups={len(_state.current().sets[0].groups[1])}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
