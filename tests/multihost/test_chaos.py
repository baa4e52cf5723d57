"""The short chaos run (tests/multihost/chaos.py): three hosts x two slots, elastic, five
faults (one of each kind, in an order and at times drawn from a fixed seed); bench/chaos.py
runs the long one. The job must finish, every sample
must count exactly once per completed epoch in the committed model, every SIGSTOPped worker
must have been killed by the launcher, and nothing may be left on any host."""
import collections

from tests.harness import hard_timeout_fixture
from tests.multihost.chaos import Chaos

_hard_timeout = hard_timeout_fixture(420)


def test_elastic_job_survives_random_faults_on_three_hosts(hosts):
    chaos = Chaos(hosts, seed=11, faults=5)
    try:
        code, out = chaos.drive()
    finally:
        chaos.stop()
    kinds = collections.Counter(fault for _, fault, _, _ in chaos.injected)
    print(f"chaos: {len(chaos.injected)} faults {dict(kinds)}; resets {chaos.resets()}")
    assert len(chaos.injected) == 5, (chaos.injected, out[-4000:])
    assert code == 0, out[-6000:]
    chaos.run.check_every_sample_once_per_epoch()
    assert chaos.epochs_done() >= 2, out[-3000:]
    assert out.count("; killing it") >= len(chaos.stopped), out[-4000:]
    assert not chaos.leftovers(within=30.0)
