"""The elastic launcher's pure decisions, the ElasticSampler's bookkeeping on one process, and
the elastic flags of hvdliterun."""
import pytest
import torch

from hvdlite.elastic import ElasticSampler
from hvdlite.runner.elastic_plan import (Blacklist, DiscoveryOutputError, Place,
                                         parse_discovery_output, plan_generation)
from hvdlite.runner.hosts import Host
from hvdlite.runner.launch import UsageError, parse_config


def test_discovery_output_with_and_without_slots():
    text = "# the cluster\nnode1:4\n\nnode2\n[fe80::1]:2\n10.0.0.7  # spare\n"
    assert parse_discovery_output(text, slots_per_host=3) == [
        Host("node1", 4), Host("node2", 3), Host("fe80::1", 2), Host("10.0.0.7", 3)]
    assert parse_discovery_output("", 1) == []


@pytest.mark.parametrize("text, message", [("node1:x", "line 1"), ("a:1\nb:0", "line 2"),
                                           ("a\na:2", "listed twice")])
def test_discovery_output_errors_name_the_line(text, message):
    with pytest.raises(DiscoveryOutputError, match=message):
        parse_discovery_output(text, 1)


def test_blacklist_for_good_without_a_cooldown_range():
    bl = Blacklist()
    assert bl.add("a", now=0.0) == float("inf")
    assert bl.blocked("a", 1e9) and not bl.blocked("b", 0.0)


def test_blacklist_cooldown_doubles_for_a_flapping_host_up_to_hi():
    bl = Blacklist((2.0, 10.0))
    draw = lambda lo, hi: lo  # noqa: E731 - the lowest draw, so the doubling shows
    assert bl.add("a", now=100.0, draw=draw) == 2.0
    assert bl.blocked("a", 101.0) and not bl.blocked("a", 102.5)
    assert bl.add("a", now=200.0, draw=draw) == 4.0
    assert bl.add("a", now=300.0, draw=draw) == 8.0
    assert bl.add("a", now=400.0, draw=draw) == 10.0


def test_plan_keeps_survivors_first_in_their_old_order():
    places, left_out = plan_generation([(5, "b"), (2, "a"), (7, "b")], [(9, "c"), (10, "a")], None)
    assert left_out == []
    assert places[5] == Place(rank=0, size=5, local_rank=0, local_size=2, cross_rank=0, cross_size=3)
    assert places[2] == Place(1, 5, 0, 2, 1, 3)
    assert places[7] == Place(2, 5, 1, 2, 0, 2)
    assert places[9] == Place(3, 5, 0, 1, 2, 3)
    assert places[10] == Place(4, 5, 1, 2, 1, 2)


def test_plan_leaves_out_workers_beyond_max_np():
    places, left_out = plan_generation([(0, "a"), (1, "a")], [(2, "b"), (3, "b")], max_np=3)
    assert sorted(places) == [0, 1, 2] and left_out == [3]
    assert all(p.size == 3 for p in places.values())


def test_sampler_deals_without_repeats_and_counts_every_rank_in_lock_step():
    dataset = list(range(40))
    sampler = ElasticSampler(dataset, shuffle=True, seed=3)
    assert sorted(sampler) == dataset  # one rank: the whole epoch
    # Pretend the job has 4 ranks, as _deal does after init(): rank 1's share.
    sampler.num_replicas, sampler.rank = 4, 1
    sampler._deal(set())
    shares = list(sampler._shares)
    assert sorted(i for s in shares for i in s) == dataset and sampler.indices == shares[1]
    sampler.record_batch(0, 3)
    sampler.record_batch(1, 3)
    # Every rank recorded two batches of 3: this rank knows all of them without asking.
    assert sampler.processed_indices == {i for s in shares for i in s[:6]}
    state = sampler.state_dict()
    restored = ElasticSampler(dataset, shuffle=True, seed=3)
    restored.load_state_dict(state)
    assert sorted(restored) == sorted(set(dataset) - set(state["processed_indices"]))


def test_sampler_iterates_an_epoch_again_as_horovod_and_set_epoch_keeps_progress():
    dataset = list(range(10))
    sampler = ElasticSampler(dataset, shuffle=True, seed=0)
    first = list(sampler)
    assert (sampler.processed_num, sampler.state_dict()["processed_num"]) == (0, 0)
    sampler.record_batch(0, 4)
    assert sampler.processed_num == 4 and sampler.processed_indices == set(first[:4])
    sampler.set_epoch(0)  # the same epoch: the 4 recorded samples stay processed
    assert list(sampler) == first[4:]
    sampler.record_batch(0, 6)
    # the share was walked: iterating again without set_epoch gives the same epoch, same order
    # (horovod.torch's and DistributedSampler's semantics)
    assert list(sampler) == first and sampler.epoch == 0 and sampler.processed_num == 0
    sampler.set_epoch(1)  # a new shuffle
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(1)).tolist()
    assert list(sampler) == expected and expected != first


def test_sampler_state_in_horovods_form():
    dataset = list(range(12))
    sampler = ElasticSampler(dataset, shuffle=True, seed=4)
    sampler.num_replicas, sampler.rank = 3, 2
    sampler.set_epoch(2)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(6)).tolist()
    sampler.record_batch(0, 2)  # every rank took 2: the first 6 of the epoch's order
    state = sampler.state_dict()
    assert (state["epoch"], state["processed_num"]) == (2, 6)
    assert set(state["processed_indices"]) == set(order[:6])
    # horovod.torch's state_dict form carries only the epoch and the count, and resumes the same
    horovods = ElasticSampler(dataset, shuffle=True, seed=4)
    horovods.num_replicas, horovods.rank = 3, 2
    horovods.load_state_dict({"epoch": 2, "processed_num": 6})
    ours = ElasticSampler(dataset, shuffle=True, seed=4)
    ours.num_replicas, ours.rank = 3, 2
    ours.load_state_dict(state)
    assert list(horovods) == list(ours) == order[6:][2::3]
    assert horovods.processed_num == 6 and horovods.epoch == 2


def test_elastic_flags_build_the_elastic_config():
    config, _ = parse_config(["-np", "2", "--host-discovery-script", "./hosts.sh", "--max-np", "8",
                              "--slots-per-host", "4", "--elastic-timeout", "30", "--reset-limit", "3",
                              "--blacklist-cooldown-range", "10", "100", "python", "train.py"])
    e = config.elastic
    assert (e.discovery_script, e.min_np, e.max_np, e.slots_per_host, e.timeout, e.reset_limit,
            e.cooldown_range) == ("./hosts.sh", 2, 8, 4, 30.0, 3, (10.0, 100.0))
    config, _ = parse_config(["--host-discovery-script", "./h", "--min-np", "3", "x"])
    assert config.elastic.min_np == 3 and config.elastic.max_np is None


@pytest.mark.parametrize("argv, message", [
    (["-np", "2", "--min-np", "2", "x"], "--min-np needs --host-discovery-script"),
    (["--host-discovery-script", "h", "-H", "a:2", "x"], "replaces -H/--hostfile"),
    (["--host-discovery-script", "h", "--min-np", "4", "--max-np", "2", "x"], "less than --min-np"),
    (["--host-discovery-script", "h", "--blacklist-cooldown-range", "5", "1", "x"], "LO is above HI"),
])
def test_elastic_flag_errors(argv, message):
    with pytest.raises(UsageError, match=message):
        parse_config(argv)
