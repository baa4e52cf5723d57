"""Elastic training across the network-namespace test hosts: a whole host killed (every
process of it at once, sshd included), then a new host added, all reached with ssh."""
from tests.elastic.harness import ElasticRun
from tests.multihost.test_multihost import assert_nothing_left


def test_elastic_job_loses_a_whole_host_and_gains_another(hosts):
    run = ElasticRun(["hvtb:2", "hvtc:2"], "--ssh-config-file", hosts.ssh_config,
                     "--network-interface", "eth0", epochs=3, wrap=lambda argv: hosts.command("hvta", argv))
    try:
        run.wait_steps(4, size=4)
        hosts.kill_all("hvtc")
        run.wait_steps(3, size=2, host="hvtb")
        run.set_hosts(["hvtb:2", "hvtc:2", "hvta:2"])
        run.wait_steps(2, size=4, host="hvta")
        code, out = run.finish()
    finally:
        run.stop()
        hosts.start_sshd("hvtc")
        hosts.wait_ssh("hvtc")
    assert code == 0, out
    assert "host hvtc is blacklisted for good" in out, out
    gens = {}
    for e in run.events():
        if e["event"] == "start":
            gens.setdefault(e["generation"], set()).add((e["rank"], e["host"]))
    assert gens[max(gens)] == {(0, "hvtb"), (1, "hvtb"), (2, "hvta"), (3, "hvta")}, gens
    run.check_every_sample_once_per_epoch()
    assert_nothing_left(hosts)
