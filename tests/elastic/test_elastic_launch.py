"""hvdliterun's elastic mode end to end, on hosts 127.0.0.x of this machine.

Every job but one trains elastic_job.py's counting model, so each test also checks that no
sample was lost or repeated through its resets (check_every_sample_once_per_epoch); the last
test trains powersgd_job.py's MLP with PowerSGD.
"""
import collections
import os
import sys

from tests.elastic.harness import ElasticRun


def _start(runs, *args, **kwargs):
    run = ElasticRun(*args, **kwargs)
    runs.append(run)
    return run


def _ranks_by_generation(run):
    starts = [e for e in run.events() if e["event"] == "start"]
    by_gen = collections.defaultdict(set)
    for e in starts:
        by_gen[e["generation"]].add((e["rank"], e["size"], e["host"], e["pid"]))
    return by_gen


def test_rank_killed_job_continues(elastic_runs):
    run = _start(elastic_runs, ["127.0.0.1:2", "127.0.0.2:2"])
    run.wait_steps(6, size=4)
    victim = run.pids_on("127.0.0.2")[0]
    run.kill([victim])
    code, out = run.finish()
    assert code == 0, out
    assert "was killed by SIGKILL; host 127.0.0.2 is blacklisted" in out, out
    assert "rolled back to the last commit" in out, out
    gens = _ranks_by_generation(run)
    last = gens[max(gens)]
    # The survivors on 127.0.0.1 carry on as ranks 0 and 1 of a job of two; the other worker
    # on the blacklisted host left with status 0.
    assert {(r, s, h) for r, s, h, _ in last} == {(0, 2, "127.0.0.1"), (1, 2, "127.0.0.1")}, gens
    assert "this worker leaves the job (host 127.0.0.2 is no longer in the job)" in out, out
    run.check_every_sample_once_per_epoch()


def test_host_killed_job_continues(elastic_runs):
    run = _start(elastic_runs, ["127.0.0.1:2", "127.0.0.2:2"])
    run.wait_steps(6, size=4)
    run.kill(run.pids_on("127.0.0.2"))
    code, out = run.finish()
    assert code == 0, out
    gens = _ranks_by_generation(run)
    assert {h for _, _, h, _ in gens[max(gens)]} == {"127.0.0.1"}
    run.check_every_sample_once_per_epoch()


def test_host_added_every_rank_interrupted_at_the_same_operation(elastic_runs):
    run = _start(elastic_runs, ["127.0.0.1:2"])
    run.wait_steps(6, size=2)
    run.set_hosts(["127.0.0.1:2", "127.0.0.2:2"])
    run.wait_steps(2, size=4)
    code, out = run.finish()
    assert code == 0, out
    interrupts = [e for e in run.events() if e["event"] == "interrupt"]
    assert {e["rank"] for e in interrupts} == {0, 1}, interrupts
    # Both old ranks stopped in the same collective of the same step.
    assert len({(e["tensor"], e["op"], e["epoch"], e["batch"]) for e in interrupts}) == 1, interrupts
    gens = _ranks_by_generation(run)
    last = sorted(gens[max(gens)])
    assert [(r, s, h) for r, s, h, _ in last] == [
        (0, 4, "127.0.0.1"), (1, 4, "127.0.0.1"), (2, 4, "127.0.0.2"), (3, 4, "127.0.0.2")], last
    # Survivors keep their ranks (and processes): rank 0 of the new generation held the state.
    first = {r: pid for r, _, _, pid in gens[min(gens)]}
    assert {r: pid for r, _, h, pid in last if h == "127.0.0.1"} == first
    assert "rolled back" not in out, out  # nothing failed: the state was kept
    # every generation's place also in horovodrun's variables, as its elastic workers get them
    for e in run.events():
        if e["event"] == "start":
            local = 0 if e["rank"] % 2 == 0 else 1
            assert e["horovod"] == ["1", str(e["rank"]), str(e["size"]), str(local),
                                    str(e["cross"][1]), e["host"]], e
            assert e["cross"] == ([0, 1] if e["size"] == 2 else [e["rank"] // 2, 2]), e
    run.check_every_sample_once_per_epoch()


def test_host_removed_gracefully(elastic_runs):
    run = _start(elastic_runs, ["127.0.0.1:2", "127.0.0.2:2"])
    run.wait_steps(6, size=4)
    run.set_hosts(["127.0.0.1:2"])
    code, out = run.finish()
    assert code == 0, out
    assert "failed" not in out and "blacklisted" not in out, out
    assert out.count("this worker leaves the job (host 127.0.0.2 is no longer in the job)") == 2, out
    run.check_every_sample_once_per_epoch()


def test_sequence_of_kills_and_additions(elastic_runs):
    """A rank killed, a host added, a whole host killed, a host added again: each sample of
    each epoch still counted exactly once."""
    run = _start(elastic_runs, ["127.0.0.1:2", "127.0.0.2:2"], epochs=3)
    run.wait_steps(4, size=4)
    run.kill(run.pids_on("127.0.0.2")[:1])
    run.wait_steps(3, size=2)
    run.set_hosts(["127.0.0.1:2", "127.0.0.2:2", "127.0.0.3:2"])
    run.wait_for("a generation on 127.0.0.3", lambda: run.steps(host="127.0.0.3"))
    run.kill(run.pids_on("127.0.0.1"))
    run.wait_steps(3, host="127.0.0.3", size=2)
    run.set_hosts(["127.0.0.1:2", "127.0.0.2:2", "127.0.0.3:2", "127.0.0.4:2"])
    run.wait_steps(2, size=4)
    code, out = run.finish()
    assert code == 0, out
    run.check_every_sample_once_per_epoch()


def test_flapping_host_is_blacklisted_with_cooldown(elastic_runs):
    run = _start(elastic_runs, ["127.0.0.1:2", "127.0.0.3:2"], "--blacklist-cooldown-range", "1", "2",
                 env={"ELASTIC_CRASH_HOST": "127.0.0.3"}, epochs=3)
    code, out = run.finish()
    assert code == 0, out
    # 127.0.0.3's workers fail, it comes back after its cooldown, and fails again.
    assert out.count("host 127.0.0.3 is blacklisted for") >= 2, out
    assert "blacklisted for good" not in out, out
    run.check_every_sample_once_per_epoch()


def test_reset_limit_stops_the_job(elastic_runs):
    run = _start(elastic_runs, ["127.0.0.1:2", "127.0.0.3:2"], "--blacklist-cooldown-range", "0.5", "1",
                 "--reset-limit", "1", env={"ELASTIC_CRASH_HOST": "127.0.0.3"}, epochs=3)
    code, out = run.finish()
    assert code != 0, out
    assert "the job reset 1 times (--reset-limit); stopped it" in out, out


def test_min_np_not_reached_within_the_timeout(elastic_runs):
    run = _start(elastic_runs, ["127.0.0.1:1"], "--min-np", "2", "--elastic-timeout", "2")
    code, out = run.finish(timeout=40)
    assert code != 0, out
    assert "only 1 of the --min-np 2 slots were available for --elastic-timeout 2 s" in out, out


def test_discovery_script_failing_on_its_first_run(elastic_runs):
    run = _start(elastic_runs, [], discovery="echo no hosts file >&2; exit 4")
    code, out = run.finish(timeout=30)
    assert code != 0, out
    assert "host discovery script 'echo no hosts file >&2; exit 4' failed on its first run: " \
           "it exited with code 4: no hosts file" in out, out


def test_one_rank_job_grows_when_a_host_is_added(elastic_runs):
    """A job of one rank runs no collective (the optimizer has nothing to reduce), so it hears
    of the new host at commit()."""
    run = _start(elastic_runs, ["127.0.0.1:1"])
    run.wait_steps(6, size=1)
    run.set_hosts(["127.0.0.1:1", "127.0.0.2:1"])
    run.wait_steps(2, size=2)
    code, out = run.finish()
    assert code == 0, out
    gens = _ranks_by_generation(run)
    assert {(r, s, h) for r, s, h, _ in gens[max(gens)]} == {(0, 2, "127.0.0.1"), (1, 2, "127.0.0.2")}
    run.check_every_sample_once_per_epoch()


def test_rank_stuck_in_user_code_is_named_removed_and_the_job_goes_on(elastic_runs):
    """127.0.0.3's worker hangs in user code (it sleeps, outside any collective). The others
    wait for its gradient; after the stall shutdown time they fail with StallError naming it
    and leave the generation; it never asks for a place, so after --elastic-timeout the
    launcher kills it, and the job goes on without it."""
    run = _start(elastic_runs, ["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"], "--elastic-timeout", "3",
                 env={"ELASTIC_HANG_HOST": "127.0.0.3", "HVDLITE_STALL_CHECK_TIME_SECONDS": "1",
                      "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "3"})
    code, out = run.finish()
    assert code == 0, out
    assert "missing rank 2" in out, out
    failures = [e for e in run.events() if e["event"] == "failure" and e["generation"] == 0]
    assert {(e["rank"], e["error"]) for e in failures} == {(0, "StallError"), (1, "StallError")}, failures
    assert "(rank 2, host 127.0.0.3) did not leave generation 0 within --elastic-timeout 3 s; killing it" \
        in out, out
    # Note [Late workers] (runner/elastic.py): asked for a dump before the kill, it says where it was
    assert "(rank 2, host 127.0.0.3) has not left generation 0 after" in out, out
    assert "elastic_job.py" in out and "in loop: time.sleep(3600)" in out, out
    gens = _ranks_by_generation(run)
    assert {(r, s, h) for r, s, h, _ in gens[max(gens)]} == {(0, 2, "127.0.0.1"), (1, 2, "127.0.0.2")}
    run.check_every_sample_once_per_epoch()


def test_no_survivor_stops_the_job_instead_of_restarting_from_scratch(elastic_runs):
    # Every worker that held the committed state leaves at once (its host is replaced): the
    # new workers cannot be given the state, and the job must not start again at epoch 0.
    run = _start(elastic_runs, ["127.0.0.1:2"])
    run.wait_steps(6, size=2)
    run.set_hosts(["127.0.0.2:2"])
    code, out = run.finish(timeout=60)
    assert code != 0, out
    assert "no worker of generation 0 is left (it ran on 127.0.0.1), and only they held the committed state" in out, out
    assert not run.steps(host="127.0.0.2"), "new workers trained from scratch:\n" + out


def test_no_survivor_resumes_from_a_durable_copy(elastic_runs, tmp_path):
    durable = tmp_path / "state.pt"
    run = _start(elastic_runs, ["127.0.0.1:2"], env={"ELASTIC_DURABLE": str(durable)})
    run.wait_steps(10, size=2)  # 5 batches per rank: the commit at batch 3 is written
    run.set_hosts(["127.0.0.2:2"])
    code, out = run.finish()
    assert code == 0, out
    assert "no worker of generation 0 is left: restoring the durable copy of commit" in out, out
    assert f"({durable})" in out, out
    new = run.steps(host="127.0.0.2")
    assert new, "the new workers never trained:\n" + out
    first = min(new, key=lambda e: e["t"])
    assert (first["epoch"], first["batch"]) >= (0, 3), first  # resumed at the commit, not restarted
    run.check_every_sample_once_per_epoch()


def test_every_host_blacklisted_for_good_stops_at_once(elastic_runs):
    run = _start(elastic_runs, ["127.0.0.3:2"], env={"ELASTIC_CRASH_HOST": "127.0.0.3"})
    code, out = run.finish(timeout=60)  # not the 600 s --elastic-timeout
    assert code != 0, out
    assert "every host the discovery script reports (127.0.0.3) is blacklisted for good" in out, out
    assert "waiting up to" not in out, out


def test_a_bad_call_fails_the_job_instead_of_resetting_it(elastic_runs):
    # An argument error is a bug in the script: every reset would meet it again
    run = _start(elastic_runs, ["127.0.0.1:2"], env={"ELASTIC_BAD_CALL": "1"})
    code, out = run.finish(timeout=60)
    assert code != 0, out
    assert "op=Adasum is not supported here" in out, out
    assert "generation 1" not in out, out


def test_workers_that_joined_in_the_last_generation_keep_its_state(elastic_runs):
    # Note [Commit after sync]: the workers added in generation 1 hold its synced state as their
    # commit, so losing every older worker before the next commit() does not send training back
    # to what the new workers were built with (epoch 0, batch 0).
    # commits only at the end of an epoch, so none falls between the new generation and the kill
    run = _start(elastic_runs, ["127.0.0.1:2"], step_seconds=0.2, env={"ELASTIC_COMMIT_EVERY": "1000"})
    run.wait_steps(8, size=2)
    run.set_hosts(["127.0.0.1:2", "127.0.0.2:2"])
    run.wait_steps(1, size=4)
    joined = min(run.steps(size=4), key=lambda e: e["t"])
    killed_at = run.kill(run.pids_on("127.0.0.1"))
    code, out = run.finish()
    assert code == 0, out
    after = [e for e in run.steps(host="127.0.0.2") if e["t"] > killed_at]
    first = min(after, key=lambda e: e["t"])
    assert (first["epoch"], first["batch"]) >= (joined["epoch"], joined["batch"]), (joined, first)
    run.check_every_sample_once_per_epoch()


def test_powersgd_state_survives_a_reset_alike_on_every_rank(elastic_runs):
    """A rank killed, then a host added, while the job trains with Compression.powersgd: the
    survivors roll back, and every rank, the new one included, takes rank 0's reduction counts
    and Qs (broadcast_optimizer_state, Note [PowerSGD]); a newcomer that kept its own (no Qs,
    counts of 0) would warm up alone and break the job. They end with the same parameters and
    Qs, every step counted once, and the model learned."""
    import torch

    from tests.elastic import powersgd_job
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "powersgd_job.py")
    run = _start(elastic_runs, ["127.0.0.1:2", "127.0.0.2:2"], command=[sys.executable, job],
                 env={"ELASTIC_STEPS": "60"})
    run.wait_steps(8, size=4)
    run.kill(run.pids_on("127.0.0.2")[:1])
    run.wait_steps(4, size=2)
    run.set_hosts(["127.0.0.1:2", "127.0.0.3:1"])
    code, out = run.finish()
    assert code == 0, out
    assert "rolled back to the last commit" in out, out
    finals = [torch.load(os.path.join(run.dir, f"final.{r}.pt")) for r in range(3)]
    assert [f["size"] for f in finals] == [3, 3, 3], out
    assert "127.0.0.3" in {e["host"] for e in run.steps(size=3)}
    for other in finals[1:]:
        for a, b in zip(finals[0]["params"], other["params"]):
            assert torch.equal(a, b)
    shared = [f["shared"] for f in finals]
    # the two weight matrices were compressed (biases are 1-D): 60 reductions each, no
    # rolled-back step counted twice
    assert sorted(shared[0]["q"]) == ["grad.0.weight", "grad.2.weight"], shared[0]["q"].keys()
    assert shared[0]["steps"]["grad.0.weight"] == shared[0]["steps"]["grad.2.weight"] == 60, shared[0]["steps"]
    for other in shared[1:]:
        assert other["steps"] == shared[0]["steps"]
        for name in shared[0]["q"]:
            assert torch.equal(shared[0]["q"][name], other["q"][name]), name
    x, y = powersgd_job.data()
    net = powersgd_job.model()
    before = torch.nn.functional.mse_loss(net(x), y).item()
    with torch.no_grad():
        for p, trained in zip(net.parameters(), finals[0]["params"]):
            p.copy_(trained)
    after = torch.nn.functional.mse_loss(net(x), y).item()
    assert after < 0.5 * before, (before, after)
