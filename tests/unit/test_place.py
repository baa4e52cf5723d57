"""The one rule for a rank's place (hvdlite/_job/place.py, Note [Cross ranks]), and that the
launcher side of the contract imports without torch."""
import subprocess
import sys

from hvdlite._job.place import Place, environment, places
from hvdlite.runner.hosts import Host, assign_slots

from tests.harness import REPO


def test_uneven_hosts_group_the_ranks_that_share_a_local_rank():
    # -H a:2,b:1 (horovod.torch's cross communicators): local rank 0 on a and b, local rank 1 on a
    assert places(["a", "a", "b"]) == [Place(0, 3, 0, 2, 0, 2), Place(1, 3, 1, 2, 0, 1),
                                       Place(2, 3, 0, 1, 1, 2)]
    # a:1,b:3,c:2: local rank 1 exists on b and c, local rank 2 only on b
    got = places(["a", "b", "b", "b", "c", "c"])
    assert [(p.local_rank, p.local_size, p.cross_rank, p.cross_size) for p in got] == [
        (0, 1, 0, 3), (0, 3, 1, 3), (1, 3, 0, 2), (2, 3, 0, 1), (0, 2, 2, 3), (1, 2, 1, 2)]


def test_launcher_local_ranks_and_interleaved_hosts():
    # local ranks from a launcher; within one local rank, cross ranks follow the ranks' order
    got = places(["b", "a", "b", "a"], local_ranks=[1, 0, 0, 1])
    assert [(p.cross_rank, p.cross_size) for p in got] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_the_launchers_assignment_uses_the_same_rule():
    slots = assign_slots([Host("a", 2), Host("b", 1)], None)
    assert [(s.cross_rank, s.cross_size) for s in slots] == [(0, 2), (0, 1), (1, 2)]


def test_environment_names_the_place_for_hvdlite_horovod_and_torchrun():
    env = environment(Place(2, 3, 0, 1, 1, 2), "b")
    assert env["HVDLITE_RANK"] == env["HOROVOD_RANK"] == env["RANK"] == "2"
    assert env["HVDLITE_LOCAL_SIZE"] == env["HOROVOD_LOCAL_SIZE"] == env["LOCAL_WORLD_SIZE"] == "1"
    assert env["HOROVOD_CROSS_RANK"] == "1" and env["HOROVOD_CROSS_SIZE"] == "2"
    assert env["HOROVOD_HOSTNAME"] == env["HVDLITE_HOSTNAME"] == "b"


def test_the_contract_imports_without_torch():
    modules = ["hvdlite._job." + m for m in ("place", "launchers", "keys", "rendezvous", "wire", "server", "netif")]
    modules += ["hvdlite.runner.hosts", "hvdlite.runner.environment", "hvdlite.runner.session", "hvdlite.runner.elastic"]
    code = f"import sys, {', '.join(modules)}; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
