"""horovod.torch behaviour that ported scripts rely on (names, return shapes, ProcessSet and
DistributedOptimizer semantics, HOROVOD_* variables), each checked on real ranks."""
import warnings

import pytest
import torch

import hvdlite as hvd
from tests.harness import Job, run_ranks


def test_build_queries_and_the_mpi_ops_module_path():
    assert (hvd.ccl_built(), hvd.ddl_built()) == (False, False)
    assert hvd.cuda_built() == (torch.version.cuda is not None)
    assert hvd.rocm_built() == (getattr(torch.version, "hip", None) is not None)
    from hvdlite.mpi_ops import Average, Sum, allreduce_async_, synchronize
    assert (Sum, Average, allreduce_async_, synchronize) == (hvd.Sum, hvd.Average, hvd.allreduce_async_,
                                                             hvd.synchronize)


def _semantics():
    hvd.init(process_sets="dynamic")
    rank, size = hvd.rank(), hvd.size()
    out = {"global_ranks": hvd.global_process_set.ranks}
    unregistered = hvd.ProcessSet([0, 1])
    out["unregistered"] = (unregistered.size(), unregistered.rank(), unregistered.included())
    registered = hvd.add_process_set(unregistered)
    out["registered"] = (registered.size(), registered.rank(), registered.included())
    with pytest.raises(ValueError, match=r"ranks \[0, 1\] is already registered"):
        hvd.add_process_set([1, 0])
    out["remove_global"] = hvd.remove_process_set(hvd.global_process_set)
    # alltoall_async: (output, received_splits) with or without splits; splits keep their dtype
    t = torch.arange(size * 2, dtype=torch.float32) + 100 * rank
    even, even_splits = hvd.synchronize(hvd.alltoall_async(t, name="even"))
    out["even"] = (even.tolist(), even_splits.tolist(), str(even_splits.dtype))
    splits = torch.tensor([1] * (size - 1) + [size * 2 - (size - 1)], dtype=torch.int64)
    got, got_splits = hvd.synchronize(hvd.alltoall_async(t, splits=splits, name="uneven"))
    out["uneven_dtype"] = str(got_splits.dtype)
    out["homogeneous"] = hvd.is_homogeneous()
    out["object"] = hvd.broadcast_object(lambda x: x + 41, root_rank=0)(1)
    hvd.shutdown()
    hvd.init(comm=list(range(size)))
    hvd.shutdown()
    with pytest.raises(ValueError, match="use hvdlite.add_process_set"):
        hvd.init(comm=[0])
    assert not hvd.is_initialized()
    return out


def test_process_sets_alltoall_and_objects_behave_as_in_horovod():
    for rank, out in enumerate(run_ranks(3, __name__, "_semantics")):
        assert out["global_ranks"] == [0, 1, 2]
        assert out["unregistered"] == (None, None, None)
        assert out["registered"] == ((2, rank, True) if rank < 2 else (2, -1, False))
        assert out["remove_global"] is False
        # rank r receives rows 2r, 2r+1 of every rank's tensor (which holds 100 * sender + i)
        want = [100 * s + 2 * rank + k for s in range(3) for k in range(2)]
        assert out["even"] == (want, [2, 2, 2], "torch.int32")
        assert out["uneven_dtype"] == "torch.int64"
        assert out["homogeneous"] is True
        assert out["object"] == 42  # a lambda, carried by cloudpickle


def _optimizer():
    hvd.init()
    rank = hvd.rank()
    model = torch.nn.Sequential(torch.nn.Linear(3, 1, bias=False))
    unused = torch.nn.Linear(2, 2)  # its parameters never get a gradient
    params = list(model.parameters()) + list(unused.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9),
                                   named_parameters=list(model.named_parameters()) +
                                   [("unused." + n, p) for n, p in unused.named_parameters()], groups=2)
    facts = {"isinstance": (isinstance(opt, torch.optim.SGD), isinstance(opt, torch.optim.Adam),
                            isinstance(opt, hvd.DistributedOptimizer)),
             "attrs": (opt.backward_passes_per_step, opt.op, opt.sparse_as_dense,
                       opt.process_set is hvd.global_process_set)}
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    # two backward passes per step: the reduced gradient is the average over ranks of both passes
    opt.set_backward_passes_per_step(2)
    w0 = model[0].weight.detach().clone()
    opt.zero_grad()
    for k in range(2):
        model(torch.full((1, 3), float(rank + k + 1))).sum().backward()
    opt.step()
    facts["accumulated_grad"] = model[0].weight.grad.tolist()
    facts["moved"] = not torch.equal(w0, model[0].weight.detach())
    # step() after synchronize() without skip_synchronize() warns
    opt.zero_grad()
    for k in range(2):
        model(torch.ones(1, 3)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    facts["warned"] = any("skip_synchronize" in str(w.message) for w in caught)
    # broadcast_optimizer_state with model= and parameters that have no state
    if rank == 1:
        for group in opt.param_groups:
            group["lr"] = 0.5
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    facts["lr"] = opt.param_groups[0]["lr"]
    facts["momentum"] = opt.state[model[0].weight]["momentum_buffer"].tolist()
    # state entries that are None (optimizers keep them for buffers not made yet)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        plain.state[model[0].weight] = {"momentum_buffer": None, "step": 3}
    hvd.broadcast_optimizer_state(plain, root_rank=0, model=model)
    facts["none_entry"] = plain.state[model[0].weight]
    hvd.shutdown()
    return facts


def test_distributed_optimizer_behaves_as_in_horovod():
    results = run_ranks(2, __name__, "_optimizer")
    for facts in results:
        assert facts["isinstance"] == (True, False, True)
        assert facts["attrs"] == (1, hvd.Average, False, True)
        # d/dW of sum(W x) is x for every row; passes with x = r+1 and r+2, averaged over ranks 0, 1
        per_rank = [sum(float(r + k + 1) for k in range(2)) for r in range(2)]
        want = sum(per_rank) / 2
        assert facts["accumulated_grad"] == [[want] * 3] and facts["moved"]
        assert facts["warned"]
        assert facts["lr"] == 0.1 and facts["none_entry"] == {"momentum_buffer": None, "step": 3}
    assert results[0]["momentum"] == results[1]["momentum"]


def _aliases():
    hvd.init()
    engine = hvd.basics._state.current().engine
    out = (engine.fusion_threshold_bytes, engine.cycle_time_ms)
    hvd.shutdown()
    return out


def test_horovod_variables_are_read_as_hvdlite_ones():
    env = {"HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_CYCLE_TIME": "2"}
    job = Job(2, __name__, "_aliases", env=env, rank_env_extra={1: {"HVDLITE_CYCLE_TIME": "3"}})
    assert job.wait(timeout=60) == [(1048576, 2.0), (1048576, 2.0)]  # rank 0's values, job-wide
    log = job.output(1)
    assert "both HVDLITE_CYCLE_TIME=3 and HOROVOD_CYCLE_TIME=2 are set; HVDLITE_CYCLE_TIME is used" in log
    assert "HVDLITE_CYCLE_TIME=3 on this rank differs from rank 0's 2" in log


def _horovod_scale(t, factor):
    """horovod.torch's scaling: integers in float64 then truncated, CPU float16 in float32."""
    if not t.dtype.is_floating_point:
        return (t.double() * factor).to(t.dtype)
    if t.dtype == torch.float16:
        return (t.float() * factor).half()
    return t * factor


def _scaled(dtypes):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        for op, pre, post in ((hvd.Sum, 0.7, 1.3), (hvd.Average, 1.9, 0.6), (hvd.Average, 1.0, 1.0)):
            inputs = [torch.arange(1, 40, dtype=torch.float64).mul(r + 3).remainder(97).to(dtype)
                      for r in range(size)]
            got = hvd.allreduce(inputs[rank], op=op, prescale_factor=pre, postscale_factor=post,
                                name=f"{name}.{op}.{pre}")
            total = sum(_horovod_scale(x, pre) for x in inputs)
            want = _horovod_scale(total, post / size if op == hvd.Average else post)
            out[(name, op, pre)] = torch.equal(got, want) or (got - want).abs().max().item()
    hvd.shutdown()
    return out


def test_scale_factors_on_integer_and_half_tensors_match_horovod_to_the_bit():
    dtypes = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
    for rank, out in enumerate(run_ranks(2, __name__, "_scaled", dtypes)):
        bad = {k: v for k, v in out.items() if v is not True}
        assert not bad, f"rank {rank}: {bad}"


MOVED_DTYPES = ["bool", "int16", "uint16", "complex64", "complex128", "bfloat16", "float8_e4m3fn", "uint8"]


def _pattern(dtype, rank, n):
    values = torch.arange(n, dtype=torch.float64) * (rank + 1) + rank
    if dtype == torch.bool:
        return values.remainder(2) == 1
    if dtype.is_complex:
        return torch.complex(values, -values).to(dtype)
    return values.remainder(7).to(dtype)


def _every_dtype(names):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    bad = []
    for name in names:
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        mine = [_pattern(dtype, r, 3 * (r + 1)).reshape(r + 1, 3) for r in range(size)]
        gathered = hvd.allgather(mine[rank], name=f"ag.{name}")
        if not torch.equal(gathered.view(torch.uint8), torch.cat(mine).view(torch.uint8)):
            bad.append(("allgather", name))
        (g0, g1) = hvd.grouped_allgather([mine[rank], mine[rank][:1]], name=f"gag.{name}")
        if not torch.equal(g1.view(torch.uint8), torch.cat([m[:1] for m in mine]).view(torch.uint8)):
            bad.append(("grouped_allgather", name))
        t = _pattern(dtype, rank, 5)
        hvd.broadcast_(t, root_rank=size - 1, name=f"bc.{name}")
        if not torch.equal(t.view(torch.uint8), _pattern(dtype, size - 1, 5).view(torch.uint8)):
            bad.append(("broadcast_", name))
        rows = _pattern(dtype, rank, size * 4).reshape(size * 2, 2)
        got, splits = hvd.alltoall(rows, splits=[2] * size, name=f"a2a.{name}")
        want = torch.cat([_pattern(dtype, s, size * 4).reshape(size * 2, 2)[2 * rank:2 * rank + 2]
                          for s in range(size)])
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)) or splits.tolist() != [2] * size:
            bad.append(("alltoall", name))
    # int16 reductions, through int32 and back: sums wrap around as in int16 arithmetic
    x = torch.tensor([30000, -30000, 7, -7, 1000], dtype=torch.int16)  # the same on every rank
    want_sum = (x.to(torch.int32) * size).to(torch.int16)
    for op, want in ((hvd.Sum, want_sum), (hvd.Min, x), (hvd.Max, x)):
        got = hvd.allreduce(x, op=op, name=f"i16.{op}")
        if got.dtype != torch.int16 or not torch.equal(got, want):
            bad.append(("allreduce int16", op, got.tolist()))
    y = x.clone()
    hvd.synchronize(hvd.allreduce_async_(y, op=hvd.Sum, name="i16.inplace"))
    if not torch.equal(y, want_sum):
        bad.append(("allreduce_async_ int16", y.tolist()))
    a, b = hvd.grouped_allreduce([x, x[:2]], op=hvd.Sum, name="i16.grouped")
    if not (torch.equal(a, want_sum) and torch.equal(b, want_sum[:2]) and b.dtype == torch.int16):
        bad.append(("grouped_allreduce int16",))
    rs = hvd.reducescatter(torch.arange(size * 2, dtype=torch.int16), op=hvd.Sum, name="i16.rs")
    if rs.dtype != torch.int16 or rs.tolist() != [size * v for v in range(2 * rank, 2 * rank + 2)]:
        bad.append(("reducescatter int16", rs.tolist()))
    hvd.shutdown()
    return bad


def test_collectives_that_move_bytes_take_every_dtype_and_int16_reduces():
    for rank, bad in enumerate(run_ranks(2, __name__, "_every_dtype", MOVED_DTYPES, timeout=90)):
        assert bad == [], f"rank {rank}: {bad}"


def _sparse():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # sparse_allreduce_async: the coalesced sum (or average) of every rank's sparse tensor
    t = torch.sparse_coo_tensor(torch.tensor([[rank, 3]]), torch.tensor([1.0 + rank, 10.0]), (5,))
    summed = hvd.synchronize(hvd.sparse_allreduce_async(t, name="sp", op=hvd.Sum)).coalesce()
    averaged = hvd.synchronize(hvd.sparse_allreduce_async(t, name="sp.avg", op=hvd.Average)).to_dense()
    dense_want = torch.zeros(5)
    for r in range(size):
        dense_want[r] += 1.0 + r
        dense_want[3] += 10.0
    out = {"sum": summed.is_sparse and torch.equal(summed.to_dense(), dense_want),
           "avg": torch.allclose(averaged, dense_want / size)}
    # sparse gradients reach the optimizer sparse (SparseAdam refuses dense ones)
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 2, sparse=True)
    hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters())
    before = emb.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        emb(torch.tensor([rank, 4])).sum().backward()
        opt.step()
    out["grad_sparse"] = emb.weight.grad.is_sparse
    out["moved_rows"] = sorted(set((emb.weight.detach() != before).any(1).nonzero().flatten().tolist()))
    out["weights"] = emb.weight.detach().tolist()
    hvd.shutdown()
    return out


def test_sparse_allreduce_and_sparse_gradients_reach_the_optimizer_sparse():
    results = run_ranks(2, __name__, "_sparse")
    for out in results:
        assert out["sum"] and out["avg"]
        assert out["grad_sparse"] and out["moved_rows"] == [0, 1, 4]  # every rank's rows, reduced
    assert results[0]["weights"] == results[1]["weights"]
