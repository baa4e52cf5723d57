"""Environment detection for every launcher, as a pure function of the variables."""

import pytest

from hvdlite._environment import LaunchEnvironmentError, detect, first_slurm_host


def test_no_launcher_is_a_single_rank():
    topo, rdv = detect({})
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.source) == (0, 1, 0, 1, "single")


def test_hvdliterun_variables_take_precedence_over_torchrun_names():
    env = {"HVDLITE_RANK": "5", "HVDLITE_SIZE": "8", "HVDLITE_LOCAL_RANK": "1", "HVDLITE_LOCAL_SIZE": "4",
           "HVDLITE_CROSS_RANK": "1", "HVDLITE_CROSS_SIZE": "2", "HVDLITE_RENDEZVOUS_ADDR": "h",
           "HVDLITE_RENDEZVOUS_PORT": "1234", "HVDLITE_RENDEZVOUS_SECRET": "ab",
           "RANK": "0", "WORLD_SIZE": "1"}
    topo, rdv = detect(env)
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size) == \
        (5, 8, 1, 4, 1, 2)
    assert (rdv.addr, rdv.port, rdv.secret, rdv.host_store) == ("h", 1234, "ab", False)


def test_torchrun_with_and_without_agent_store():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "m", "MASTER_PORT": "29501", "GROUP_RANK": "1"}
    topo, rdv = detect(env)
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size) == \
        (3, 4, 1, 2, 1, 2)
    assert (rdv.addr, rdv.port, rdv.host_store) == ("m", 29501, False)
    _, rdv0 = detect(dict(env, RANK="0", LOCAL_RANK="0", TORCHELASTIC_USE_AGENT_STORE="False"))
    assert rdv0.host_store
    _, rdv0 = detect(dict(env, RANK="0", LOCAL_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True"))
    assert not rdv0.host_store


def test_open_mpi_needs_master_addr_across_hosts():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(LaunchEnvironmentError, match="MASTER_ADDR"):
        detect(env)
    topo, rdv = detect(dict(env, MASTER_ADDR="10.0.0.1"))
    assert (topo.rank, topo.cross_rank, topo.cross_size, rdv.addr, rdv.port) == (2, 1, 2, "10.0.0.1", 29500)


def test_slurm_variables():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODELIST": "gpu[07-08]",
           "SLURM_JOB_ID": "123"}
    topo, rdv = detect(env)
    assert (topo.rank, topo.size, topo.local_rank, topo.local_size, topo.cross_rank, topo.cross_size) == \
        (5, 8, 1, 4, 1, 2)
    assert (rdv.addr, rdv.port, rdv.host_store) == ("gpu07", 20123, False)
    assert first_slurm_host("a1,b2") == "a1" and first_slurm_host("n[3,5-6]") == "n3"


@pytest.mark.parametrize("env,text", [
    ({"HVDLITE_RANK": "x", "HVDLITE_SIZE": "2"}, "HVDLITE_RANK='x' is not an integer"),
    ({"HVDLITE_RANK": "2", "HVDLITE_SIZE": "2", "HVDLITE_RENDEZVOUS_ADDR": "a",
      "HVDLITE_RENDEZVOUS_PORT": "1"}, "rank 2 is outside a job of size 2"),
    ({"HVDLITE_RANK": "0", "HVDLITE_SIZE": "2"}, "HVDLITE_RENDEZVOUS_ADDR is not"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be >= 1"),
])
def test_bad_values_name_the_variable(env, text):
    with pytest.raises(LaunchEnvironmentError, match=text):
        detect(env)
