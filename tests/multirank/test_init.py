"""hvd.init() under each launcher's environment, with a user's own process group, and alone."""

import os
import socket
import subprocess
import sys

import torch

import hvdlite as hvd
from tests.harness import REPO, Job, run_ranks


def _report():
    hvd.init()
    info = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
            hvd.cross_size(), hvd.is_initialized())
    total = hvd.allreduce(torch.tensor([hvd.rank()]), op=hvd.Sum, name="sum").item()
    hvd.shutdown()
    return info + (total, hvd.is_initialized())


def test_hvdlite_environment_gives_topology():
    results = run_ranks(3, __name__, "_report")
    assert results == [(r, 3, r, 3, 0, 1, True, 3, False) for r in range(3)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_with_env(size, env_for_rank, fn="_report"):
    """Runs ranks with the given variables instead of hvdliterun's."""
    job = Job(size, __name__, fn, rank_env_extra={r: env_for_rank(r) for r in range(size)})
    return job


def test_torchrun_variables_are_read():
    port = _free_port()
    env = lambda r: {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    results = _job_with_env(2, env, "_report_without_hvdlite_vars").wait(timeout=60)
    assert results == [(r, 2, r, 2, 0, 1, True, 1, False) for r in range(2)]


def test_torchrun_on_uneven_nodes_gives_horovods_cross_ranks():
    # torchrun with 2 nodes (GROUP_RANK) of 2 and 1 processes: the cross communicator of local
    # rank 0 spans both nodes, that of local rank 1 only the first (Note [Cross ranks])
    port = _free_port()
    layout = {0: (0, 2, 0), 1: (1, 2, 0), 2: (0, 1, 1)}  # rank: local rank, local size, node
    env = lambda r: {"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(layout[r][0]),
                     "LOCAL_WORLD_SIZE": str(layout[r][1]), "GROUP_RANK": str(layout[r][2]),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    results = _job_with_env(3, env, "_report_without_hvdlite_vars").wait(timeout=60)
    assert [r[:6] for r in results] == [(0, 3, 0, 2, 0, 2), (1, 3, 1, 2, 0, 1), (2, 3, 0, 1, 1, 2)]


def test_open_mpi_variables_are_read():
    port = _free_port()
    env = lambda r: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
                     "OMPI_COMM_WORLD_LOCAL_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                     "MASTER_PORT": str(port)}
    results = _job_with_env(2, env, "_report_without_hvdlite_vars").wait(timeout=60)
    assert results == [(r, 2, r, 2, 0, 1, True, 1, False) for r in range(2)]


def test_slurm_variables_are_read():
    port = _free_port()
    env = lambda r: {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
                     "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "2",
                     "SLURM_NODELIST": "localhost", "MASTER_PORT": str(port)}
    results = _job_with_env(2, env, "_report_without_hvdlite_vars").wait(timeout=60)
    assert results == [(r, 2, r, 2, 0, 1, True, 1, False) for r in range(2)]


def _report_without_hvdlite_vars():
    for key in [k for k in os.environ if k.startswith("HVDLITE_")]:
        del os.environ[key]
    return _report()


def _user_process_group():
    import torch.distributed as dist
    port = os.environ["TEST_PORT"]
    rank = int(os.environ["TEST_RANK"])
    for key in [k for k in os.environ if k.startswith("HVDLITE_")]:
        del os.environ[key]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result = _report()
    # the user's own group still works beside hvdlite's
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return result + (t.item(),)


def test_existing_torch_distributed_group_is_reused():
    port = _free_port()
    job = Job(2, __name__, "_user_process_group",
              rank_env_extra={r: {"TEST_PORT": str(port), "TEST_RANK": str(r)} for r in range(2)})
    assert job.wait(timeout=60) == [(r, 2, r, 2, 0, 1, True, 1, False, 2.0) for r in range(2)]


def test_no_launcher_runs_as_a_single_rank():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HVDLITE_", "OMPI_", "PMI_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = REPO
    code = ("import torch, hvdlite as hvd; hvd.init(); "
            "print(hvd.rank(), hvd.size(), hvd.allreduce(torch.tensor([3.0])).item(), "
            "hvd.allgather(torch.ones(2, 1)).shape[0], hvd.broadcast(torch.tensor([4]), 0).item())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "3.0", "2", "4"]


def test_interpreter_exit_without_shutdown_is_clean():
    # ranks enqueue work and exit without shutdown(): the atexit hook must stop the engine. A
    # rank that the scheduler holds back may find its peer already gone: its engine then says
    # so when it enqueues (ShutdownError naming the peer), and it must still exit cleanly.
    code = ("import torch, hvdlite as hvd\n"
            "hvd.init()\n"
            "try:\n"
            "    [hvd.allreduce_async(torch.ones(1000), name=f'x{i}') for i in range(50)]\n"
            "except hvd.ShutdownError as e:\n"
            "    assert 'requested by rank' in str(e), e\n"
            "print('bye')")
    for _ in range(3):  # the failure this guards against was intermittent
        assert Job(2, __name__, "_exec_code", code).wait(timeout=60) == [None, None]


def _exec_code(code):
    exec(code, {})
