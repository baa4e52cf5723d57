"""hvdlite as a torch.distributed backend (Note [Engine behind a process group] in
csrc/torch_backend.h): every collective torch's frontends call, through init_process_group
("hvdlite"), checked on every rank against values computed here from the ranks' seeds."""

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist

import hvdlite  # noqa: F401  (registers the backend)
from tests.harness import Job


def _data(rank, shape=(3, 4), dtype=torch.float32):
    return (torch.arange(int(torch.tensor(shape).prod())).reshape(shape) + 10 * rank + 1).to(dtype)


def _init(how, seconds=60):
    rank, size = int(os.environ["HVDLITE_RANK"]), int(os.environ["HVDLITE_SIZE"])
    for name in ("HVDLITE_RANK", "HVDLITE_SIZE"):  # a plain torch.distributed job: no hvdliterun
        os.environ.pop(name)
    timeout = datetime.timedelta(seconds=seconds)
    if how == "store":
        store = dist.TCPStore("127.0.0.1", int(os.environ["HVDLITE_RENDEZVOUS_PORT"]), size, is_master=False,
                              timeout=timeout)
        dist.init_process_group("hvdlite", store=store, rank=rank, world_size=size, timeout=timeout)
    elif how == "file":
        dist.init_process_group("hvdlite", init_method=f"file://{os.environ['TEST_FILE']}",
                                rank=rank, world_size=size, timeout=timeout)
    else:
        dist.init_process_group("hvdlite", init_method=f"tcp://127.0.0.1:{os.environ['TEST_PORT']}",
                                rank=rank, world_size=size, timeout=timeout)
    return rank, size


def _every_collective(how):
    import hvdlite as hvd
    beside = os.environ.get("TEST_BESIDE") == "1"  # also hvd.init()'s own engine in the same process
    if beside:
        hvd.init()
    rank, size = _init(how)
    assert dist.get_backend() == "hvdlite"
    ranks = range(size)
    # allreduce, every op torch has that the engine can express
    for op, ref in [(dist.ReduceOp.SUM, sum(_data(r) for r in ranks)),
                    (dist.ReduceOp.AVG, sum(_data(r) for r in ranks) / size),
                    (dist.ReduceOp.MIN, _data(0)), (dist.ReduceOp.MAX, _data(size - 1)),
                    (dist.ReduceOp.PRODUCT, torch.stack([_data(r) for r in ranks]).prod(0)),
                    (dist._make_nccl_premul_sum(0.5), sum(_data(r) for r in ranks) * 0.5)]:
        t = _data(rank)
        dist.all_reduce(t, op=op)
        assert torch.allclose(t, ref), (op, t, ref)
    # async, integer dtype, the future completes by itself
    t = _data(rank, dtype=torch.int64)
    fut = dist.all_reduce(t, async_op=True).get_future()
    assert torch.equal(fut.wait()[0], sum(_data(r, dtype=torch.int64) for r in ranks))
    # coalesced allreduce
    ts = [_data(rank), _data(rank, (5,))]
    dist.all_reduce_coalesced(ts)
    assert torch.equal(ts[1], sum(_data(r, (5,)) for r in ranks))
    # broadcast
    t = _data(rank)
    dist.broadcast(t, src=size - 1)
    assert torch.equal(t, _data(size - 1))
    # reduce: the root gets the sum
    t = _data(rank)
    dist.reduce(t, dst=0)
    if rank == 0:
        assert torch.equal(t, sum(_data(r) for r in ranks))
    # allgather, allgather_into_tensor
    outs = [torch.empty(3, 4) for _ in ranks]
    dist.all_gather(outs, _data(rank))
    assert all(torch.equal(outs[r], _data(r)) for r in ranks)
    flat = torch.empty(size * 3, 4)
    dist.all_gather_into_tensor(flat, _data(rank))
    assert torch.equal(flat, torch.cat([_data(r) for r in ranks]))
    # reduce_scatter, reduce_scatter_tensor
    out = torch.empty(2, 4)
    dist.reduce_scatter_tensor(out, _data(rank, (2 * size, 4)))
    assert torch.equal(out, sum(_data(r, (2 * size, 4)) for r in ranks)[2 * rank:2 * rank + 2])
    out = torch.empty(4)
    dist.reduce_scatter(out, [_data(rank, (4,)) + i for i in ranks], op=dist.ReduceOp.AVG)
    assert torch.allclose(out, sum(_data(r, (4,)) + rank for r in ranks) / size)
    # gather, scatter
    got = [torch.empty(3, 4) for _ in ranks] if rank == 0 else None
    dist.gather(_data(rank), got, dst=0)
    if rank == 0:
        assert all(torch.equal(got[r], _data(r)) for r in ranks)
    out = torch.empty(2, 2)
    dist.scatter(out, [torch.full((2, 2), float(r)) for r in ranks] if rank == 1 else None, src=1)
    assert torch.equal(out, torch.full((2, 2), float(rank)))
    # all_to_all_single with and without splits, all_to_all
    out = torch.empty(size * 2)
    dist.all_to_all_single(out, torch.arange(size * 2, dtype=torch.float32) + 100 * rank)
    assert torch.equal(out, torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r
                                       for r in ranks]))
    in_splits = [r + 1 for r in ranks]             # rank r sends r + 1 rows to rank r
    out_splits = [rank + 1] * size
    src = torch.full((sum(in_splits), 2), float(rank))
    out = torch.empty(sum(out_splits), 2)
    dist.all_to_all_single(out, src, out_splits, in_splits)
    assert torch.equal(out, torch.cat([torch.full((rank + 1, 2), float(r)) for r in ranks]))
    outs = [torch.empty(r + 1) for r in ranks]
    dist.all_to_all(outs, [torch.full((rank + 1,), float(rank * 10 + r)) for r in ranks])
    assert all(torch.equal(outs[r], torch.full((r + 1,), float(r * 10 + rank))) for r in ranks)
    # barrier, monitored_barrier
    dist.barrier()
    # torch's monitored_barrier() admits only "gloo" by name; the group's own method is there
    dist.distributed_c10d._get_default_group().monitored_barrier(datetime.timedelta(seconds=30))
    # point-to-point (tests/multirank/test_point_to_point.py has the rest): a ring
    ring = [dist.isend(_data(rank), (rank + 1) % size), dist.irecv(t := torch.empty(3, 4), (rank - 1) % size)]
    for work in ring:
        work.wait()
    assert torch.equal(t, _data((rank - 1) % size))
    # a subgroup gets an engine of its own
    evens = dist.new_group([r for r in ranks if r % 2 == 0], backend="hvdlite")
    if rank % 2 == 0:
        t = _data(rank)
        dist.all_reduce(t, group=evens)
        assert torch.equal(t, sum(_data(r) for r in ranks if r % 2 == 0))
    # new_subgroups: each rank's subgroup is a group of the default backend, with its own engine
    mine, _ = (dist.new_subgroups(group_size=1) if size == 2 else
               dist.new_subgroups_by_enumeration([[0, 2], [1]]))
    members = [rank] if size == 2 else ([0, 2] if rank != 1 else [1])
    assert dist.get_backend(mine) == "hvdlite"
    t = _data(rank)
    dist.all_reduce(t, group=mine)
    assert torch.equal(t, sum(_data(r) for r in members)), (rank, members, t)
    if beside:
        assert torch.equal(hvd.allreduce(_data(rank), op=hvd.Sum), sum(_data(r) for r in ranks))
        t = _data(rank)
        dist.all_reduce(t)
        assert torch.equal(t, sum(_data(r) for r in ranks))
        hvd.shutdown()
    dist.destroy_process_group()
    return {"done": True}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("size,how", [(2, "store"), (3, "tcp"), (2, "file")])
def test_every_collective_through_init_process_group(size, how, tmp_path):
    env = {"TEST_PORT": str(_free_port()), "TEST_FILE": str(tmp_path / "rendezvous"),
           "TEST_BESIDE": "1" if how == "file" else "0"}
    results = Job(size, __name__, "_every_collective", how, env=env).wait(timeout=120)
    assert all(r["done"] for r in results)


def _shape_mismatch():
    rank, size = _init("store")
    t = torch.ones(2 + rank)
    try:
        dist.all_reduce(t)
    except dist.DistBackendError as exc:
        return str(exc)
    return "no error"


def test_a_shape_mismatch_raises_on_every_rank_naming_both_shapes():
    for message in Job(2, __name__, "_shape_mismatch").wait(timeout=60):
        assert "shape mismatch" in message and "[2]" in message and "[3]" in message, message


def _under_torch_debug_detail():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the group in torch's checking wrapper, which reads
    the backend's sequence numbers: collectives and point-to-point run through it, and its
    own check names a shape mismatch on every rank."""
    rank, size = _init("store")
    pg = dist.distributed_c10d._get_default_group()
    assert type(pg._get_backend(torch.device("cpu"))).__name__ == "_ProcessGroupWrapper"
    t = _data(rank)
    dist.all_reduce(t)
    assert torch.equal(t, sum(_data(r) for r in range(size)))
    into = torch.empty(3, 4)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, _data(rank), 1 - rank),
                                        dist.P2POp(dist.irecv, into, 1 - rank)]):
        work.wait()
    assert torch.equal(into, _data(1 - rank))
    with pytest.raises(RuntimeError, match="Detected mismatch between collectives") as raised:
        dist.all_reduce(torch.ones(2 + rank))
    dist.destroy_process_group()
    return str(raised.value)


def test_torch_debug_detail_wraps_the_group_and_its_checks_run():
    for rank, message in enumerate(Job(2, __name__, "_under_torch_debug_detail",
                                       env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}).wait(timeout=90)):
        assert f"TensorShape=[{2 + rank}]" in message, message


def _through_hvdlite_url(launcher, backend):
    if launcher != "hvdliterun":  # another launcher's variables only (given by the test)
        for key in [k for k in os.environ if k.startswith("HVDLITE_")]:
            del os.environ[key]
    dist.init_process_group(backend, init_method="hvdlite://")
    rank, size = dist.get_rank(), dist.get_world_size()
    t = _data(rank)
    dist.all_reduce(t)
    ok = torch.equal(t, sum(_data(r) for r in range(size)))
    dist.destroy_process_group()
    return rank, size, ok


def _launcher_env(launcher, size, port):
    if launcher == "mpirun":
        return lambda r: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(size),
                          "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": str(size),
                          "MASTER_PORT": str(port)}
    if launcher == "slurm":
        return lambda r: {"SLURM_PROCID": str(r), "SLURM_NTASKS": str(size), "SLURM_LOCALID": str(r),
                          "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": str(size),
                          "SLURM_NODELIST": "localhost", "MASTER_PORT": str(port)}
    if launcher == "torchrun":
        return lambda r: {"RANK": str(r), "WORLD_SIZE": str(size), "LOCAL_RANK": str(r),
                          "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return lambda r: {}


@pytest.mark.parametrize("launcher,backend", [("hvdliterun", "hvdlite"), ("mpirun", "hvdlite"),
                                              ("slurm", "hvdlite"), ("torchrun", "hvdlite"),
                                              ("mpirun", "gloo")])
def test_the_hvdlite_rendezvous_reads_every_launchers_environment(launcher, backend):
    # init_method="hvdlite://" finds rank, size and store as hvd.init() does, where env:// knows
    # torchrun's variables only (these are the variables each launcher sets; the launchers
    # themselves are run with hvd.init() in tests/launcher, tests/slurm and tests/multirank)
    env = _launcher_env(launcher, 3, _free_port())
    job = Job(3, __name__, "_through_hvdlite_url", launcher, backend,
              rank_env_extra={r: env(r) for r in range(3)})
    assert job.wait(timeout=90) == [(r, 3, True) for r in range(3)]


def _group_timeout():
    import time
    rank, size = _init("store", seconds=3)
    t = torch.ones(4)
    dist.all_reduce(t)
    out = {}
    # the group's timeout: rank 1 is late by more than it. rank 0's all_reduce fails naming
    # rank 1, and rank 1's, when it comes, fails naming rank 0, which has given up on it
    if rank == 1:
        time.sleep(5)
    started = time.monotonic()
    try:
        dist.all_reduce(t)
        out["late"] = ("no error", 0.0)
    except dist.DistBackendError as exc:
        out["late"] = (str(exc), time.monotonic() - started)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"timed out {rank}", "1")
    store.wait([f"timed out {r}" for r in range(size)], datetime.timedelta(seconds=30))
    # the group goes on; then a wait's own timeout, shorter than the group's
    dist.barrier()
    t = torch.full((4,), float(rank + 1))
    if rank == 1:
        time.sleep(1.5)
    work = dist.all_reduce(t, async_op=True)
    if rank == 0:
        try:
            work.wait(timeout=datetime.timedelta(milliseconds=300))
            out["short wait"] = "no error"
        except dist.DistBackendError as exc:
            out["short wait"] = str(exc)
    work.wait()  # and the operation itself still completes
    out["value"] = t.tolist()
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_the_process_group_timeout_fails_a_late_rank_and_a_wait_honours_its_own():
    results = Job(2, __name__, "_group_timeout").wait(timeout=60)
    for rank, other in ((0, 1), (1, 0)):
        message, seconds = results[rank]["late"]
        assert f"missing rank {other}" in message and "allreduce" in message, (rank, message)
        assert 2.5 < seconds < 5, (rank, seconds)  # the 3 s timeout, give or take a stall-check round
    assert "did not complete within 300 ms" in results[0]["short wait"], results[0]
    assert all(r["value"] == [3.0] * 4 for r in results), results


# ---- DDP, its comm hooks and ZeRO over the backend ---------------------------------------------

def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batches(rank, steps):
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_against_gloo():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, size = _init("store")
    gloo = dist.new_group(backend="gloo")
    batches = _batches(rank, 20)
    results = {}
    for hook in ("none", "fp16", "powersgd"):
        params = {}
        for backend, group in (("hvdlite", None), ("gloo", gloo)):
            model = DDP(_model(0), process_group=group, bucket_cap_mb=0.002)  # several buckets
            if hook == "fp16":
                model.register_comm_hook(group, default_hooks.fp16_compress_hook)
            elif hook == "powersgd":
                state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                                    start_powerSGD_iter=2, random_seed=7)
                model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            params[backend] = _train(model, opt, batches)
        if hook == "none":
            results[hook] = all(torch.equal(a, b) for a, b in zip(params["hvdlite"], params["gloo"]))
        else:
            results[hook] = max((a - b).abs().max().item() for a, b in zip(params["hvdlite"], params["gloo"]))
    # ZeRO over hvdlite against plain Adam over hvdlite
    zero, plain = DDP(_model(1)), DDP(_model(1))
    z = _train(zero, ZeroRedundancyOptimizer(zero.parameters(), optimizer_class=torch.optim.Adam, lr=0.01),
               batches)
    p = _train(plain, torch.optim.Adam(plain.parameters(), lr=0.01), batches)
    results["zero"] = max((a - b).abs().max().item() for a, b in zip(z, p))
    dist.destroy_process_group()
    return results


def test_ddp_over_hvdlite_matches_ddp_over_gloo():
    for rank, r in enumerate(Job(2, __name__, "_ddp_against_gloo").wait(timeout=180)):
        assert r["none"] is True, f"rank {rank}: DDP parameters differ from Gloo's after 20 steps"
        assert r["fp16"] < 1e-3, r       # fp16_compress_hook: both round to half the same way
        assert r["powersgd"] < 1e-3, r   # powerSGD_hook: the same low-rank approximation
        assert r["zero"] < 1e-5, r


def _killed_in_backward(victim):
    import time
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, size = _init("store")
    model = DDP(_model(0))
    x, y = _batches(rank, 1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()  # one step to warm up
    if rank == victim:
        print("READY", flush=True)
        time.sleep(120)  # killed by the test
    time.sleep(0.5)
    started = time.monotonic()
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
        return ("no error", time.monotonic() - started)
    except Exception as exc:  # noqa: BLE001 - what DDP's reducer raises is what the user sees
        return (f"{type(exc).__name__}: {exc}", time.monotonic() - started)


def test_a_rank_killed_during_ddp_backward_fails_the_others_naming_it():
    job = Job(3, __name__, "_killed_in_backward", 1)
    job.wait_for_output(1, "READY", timeout=60)
    job.kill(1)
    for rank, result in enumerate(job.wait(timeout=60, allow_failure=(1,))):
        if rank == 1:
            continue
        message, seconds = result
        assert seconds < 10, (rank, seconds, message)
        assert "rank 1" in message, (rank, message)


# ---- FSDP2 and distributed checkpoints over the backend ----------------------------------------

def _fsdp_and_dcp(ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, size = _init("store")
    batches = [_batches(r, 5) for r in range(size)]
    # the reference: one process, the mean of every rank's loss
    ref = _model(3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(5):
        ref_opt.zero_grad()
        (sum(torch.nn.functional.mse_loss(ref(x), y) for x, y in (b[step] for b in batches)) / size).backward()
        ref_opt.step()
    model = _model(3)
    mesh = init_device_mesh("cpu", (size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _train(model, opt, batches[rank])
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    fsdp_err = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    # a DCP save and load round trip, model and optimizer, into fresh objects
    model_sd, opt_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=ckpt_dir)
    fresh = _model(4)
    for layer in (fresh[0], fresh[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    f_model_sd, f_opt_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": f_model_sd, "optim": f_opt_sd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    restored = all(torch.equal(a.full_tensor(), b.full_tensor())
                   for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    momenta = [(fresh_opt.state[a]["momentum_buffer"], opt.state[b]["momentum_buffer"])
               for a, b in zip(fresh.parameters(), model.parameters())]
    restored = restored and len(momenta) == 4 and all(torch.equal(a.full_tensor(), b.full_tensor())
                                                      for a, b in momenta)
    dist.destroy_process_group()
    return fsdp_err, restored


def test_fsdp2_trains_as_one_process_and_dcp_round_trips(tmp_path):
    for rank, (err, restored) in enumerate(Job(2, __name__, "_fsdp_and_dcp", str(tmp_path)).wait(timeout=180)):
        assert err < 1e-5, (rank, err)
        assert restored, f"rank {rank}: the DCP round trip did not restore the parameters"
