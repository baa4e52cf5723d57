"""Environment detection for every launcher, as a pure function of the variables."""

import pytest

from hvdlite._job.launchers import (LaunchEnvironmentError, detect, expand_slurm_nodelist,
                                  first_slurm_host)


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
    # No MASTER_PORT: 20000 + (job id * 10 + step id % 10) % 20000 (step 0 here).
    assert (rdv.addr, rdv.port, rdv.host_store) == ("gpu07", 21230, False)
    assert detect({**env, "SLURM_STEP_ID": "3"})[1].port == 21233
    rdv = detect({**env, "MASTER_PORT": "29000", "MASTER_ADDR": "head"})[1]
    assert (rdv.addr, rdv.port) == ("head", 29000)
    assert first_slurm_host("a1,b2") == "a1" and first_slurm_host("n[3,5-6]") == "n3"


@pytest.mark.parametrize("nodelist,hosts", [
    ("node01", ["node01"]),
    ("a,b", ["a", "b"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[8-10],cpu1", ["gpu8", "gpu9", "gpu10", "cpu1"]),
    ("n[1-2]-ib,x[009-010]", ["n1-ib", "n2-ib", "x009", "x010"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
])
def test_slurm_nodelist_expansion(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["node[1-2", "node1-2]", "node[a-b]"])
def test_slurm_nodelist_errors_name_the_list(nodelist):
    with pytest.raises(LaunchEnvironmentError, match="SLURM node list"):
        expand_slurm_nodelist(nodelist)


def test_hvdliterun_inside_an_allocation_takes_its_hosts_and_slots():
    from hvdlite.runner.hosts import Host, slurm_allocation
    tasks = {"SLURM_JOB_NODELIST": "node[1-2],gpu5", "SLURM_NTASKS": "5",
             "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_JOB_CPUS_PER_NODE": "8(x3)"}
    assert slurm_allocation(tasks) == [Host("node1", 2), Host("node2", 2), Host("gpu5", 1)]
    cpus = {k: v for k, v in tasks.items() if k not in ("SLURM_NTASKS",)}  # salloc -N3: CPUs
    assert slurm_allocation(cpus) == [Host("node1", 8), Host("node2", 8), Host("gpu5", 8)]
    assert slurm_allocation({}) is None


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
