"""Grouped operations and the agreement digest, driven through one process's controller
(Note [Grouped operations] and Note [Agreement digest] in csrc/controller.h)."""

from hvdlite import _core

FLOAT = 6
MISMATCH, STALL = _core.STATUS_CODES["mismatch"], _core.STATUS_CODES["stall"]


def req(name, group="", size=0, **kw):
    d = {"name": name, "kind": 0, "dtype": FLOAT, "shape": [4], "op": 1, "group": group,
         "group_size": size}
    d.update(kw)
    return d


def group(name, *members, **kw):
    return [req(m, group=name, size=len(members), **kw.get(m, {})) for m in members]


def msg(*requests, flags=0, clock_ms=0):
    return {"requests": list(requests), "flags": flags, "clock_ms": clock_ms}


def test_group_submitted_in_different_rounds_is_released_whole_once_everywhere():
    c = _core._ControllerHarness(2)
    r = c.round([msg(*group("G", "G.0", "G.1")), msg()])
    assert r["ready"] == [] and r["pending"] == 2
    r = c.round([msg(), msg(*group("G", "G.0", "G.1"))])
    assert [(i["name"], i["code"]) for i in r["ready"]] == [("G.0", 0), ("G.1", 0)]
    assert r["pending"] == 0


def test_group_with_different_member_counts_fails_every_member_at_once():
    # The reproduction of the issue: rank 0 groups [a, b], rank 1 groups [a] under one name.
    c = _core._ControllerHarness(2)
    r = c.round([msg(*group("G", "G.0", "G.1")), msg(*group("G", "G.0"))])
    assert sorted(i["name"] for i in r["ready"]) == ["G.0", "G.1"]
    for item in r["ready"]:
        assert item["code"] == MISMATCH
        assert item["message"] == ("grouped allreduce of 'G': members differ: rank 0 has 2 tensors "
                                   "('G.0', 'G.1'); rank 1 has 1 tensor ('G.0')")
        assert item["op"] == "grouped allreduce" and item["tensor"] == "G" and item["ranks"] == [1]
    assert r["pending"] == 0
    # Nothing is left behind: the same group name works again afterwards.
    r = c.round([msg(*group("G", "G.0")), msg(*group("G", "G.0"))])
    assert [(i["name"], i["code"]) for i in r["ready"]] == [("G.0", 0)]


def test_group_with_different_member_names_fails_even_when_the_late_rank_comes_later():
    c = _core._ControllerHarness(3)
    r = c.round([msg(*group("G", "a", "b")), msg(*group("G", "a", "b")), msg()])
    assert r["ready"] == []
    r = c.round([msg(), msg(), msg(*group("G", "a", "c"))])
    assert sorted(i["name"] for i in r["ready"]) == ["a", "b", "c"]
    assert {i["code"] for i in r["ready"]} == {MISMATCH}
    assert r["ready"][0]["ranks"] == [2]
    assert "ranks 0, 1 have 2 tensors ('a', 'b'); rank 2 has 2 tensors ('a', 'c')" in r["ready"][0]["message"]
    assert r["pending"] == 0


def test_member_mismatch_fails_the_whole_group_with_the_member_named():
    c = _core._ControllerHarness(2)
    r = c.round([msg(*group("H", "H.0", "H.1")),
                 msg(*group("H", "H.0", "H.1", **{"H.1": {"shape": [5]}}))])
    assert sorted(i["name"] for i in r["ready"]) == ["H.0", "H.1"]
    for item in r["ready"]:
        assert item["code"] == MISMATCH
        assert item["message"] == ("grouped allreduce 'H': allreduce of 'H.1': shape mismatch: "
                                   "rank 0 has [4]; rank 1 has [5]")
        assert item["tensor"] == "H.1" and item["ranks"] == [1] and item["reason"].startswith("shape mismatch")
    assert r["pending"] == 0


def test_member_mismatch_in_a_dtype_of_the_first_member_fails_the_rest_too():
    c = _core._ControllerHarness(2)
    r = c.round([msg(*group("H", "H.0", "H.1", "H.2")),
                 msg(*group("H", "H.0", "H.1", "H.2", **{"H.0": {"dtype": 7}}))])
    assert sorted(i["name"] for i in r["ready"]) == ["H.0", "H.1", "H.2"]
    assert all("dtype mismatch: rank 0 has Float; rank 1 has Double" in i["message"] for i in r["ready"])
    assert r["pending"] == 0


def test_stall_of_a_group_fails_every_member_on_every_rank():
    c = _core._ControllerHarness(2, stall_check_seconds=1, stall_shutdown_seconds=2)
    r = c.round([msg(*group("S", "S.0", "S.1"), clock_ms=0), msg()])
    assert r["ready"] == []
    r = c.round([msg(clock_ms=2500), msg()])
    assert sorted(i["name"] for i in r["ready"]) == ["S.0", "S.1"]
    for item in r["ready"]:
        assert item["code"] == STALL and item["ranks"] == [1]
        assert item["message"].startswith("grouped allreduce 'S': allreduce of 'S.0': stalled for 2 s: "
                                          "missing rank 1, submitted by rank 0")
    assert r["pending"] == 0


def test_group_completes_when_the_missing_rank_has_joined():
    c = _core._ControllerHarness(3)
    r = c.round([msg(*group("G", "G.0", "G.1")), msg(*group("G", "G.0", "G.1")),
                 msg(req("join", kind=6, shape=[]))])
    names = [i["name"] for i in r["ready"]]
    assert names[:2] == ["G.0", "G.1"] and all(i["code"] == 0 for i in r["ready"][:2])
    assert r["ready"][0]["joined"] == [2]


def test_digest_is_the_same_for_the_same_rounds_and_differs_once_state_differs():
    a, b = _core._ControllerHarness(2, cache_capacity=8), _core._ControllerHarness(2, cache_capacity=8)
    rounds = [[msg(req("x")), msg(req("x"))], [msg(*group("G", "G.0")), msg()],
              [msg(), msg(*group("G", "G.0"))], [msg(req("y")), msg()]]
    for messages in rounds:
        a.round(messages)
        b.round(messages)
        assert a.digest() == b.digest()
    b.forget_cache()  # the test hook: one controller's state diverges
    assert a.digest() != b.digest()


def test_digest_reflects_decisions_and_cache_capacity():
    small, large = _core._ControllerHarness(2, cache_capacity=1), _core._ControllerHarness(2, cache_capacity=4)
    for name in ("p", "q"):
        for c in (small, large):
            c.round([msg(req(name)), msg(req(name))])
    assert small.digest() != large.digest()  # q evicted p from the small cache only
    fail, ok = _core._ControllerHarness(2), _core._ControllerHarness(2)
    fail.round([msg(req("z")), msg(req("z", shape=[5]))])
    ok.round([msg(req("z")), msg(req("z"))])
    assert fail.digest() != ok.digest()


def test_rounds_in_step_decide_exactly_as_the_general_path():
    """Note [Rounds in step]: a controller that takes the short path for rounds where every rank
    sends the same names in the same order must decide everything (order, outcomes, messages,
    contributors, inlining, cache, digest) as one that always takes the general path. Random
    rounds mix in-step rounds with mismatched shapes and dtypes, inlined payloads, other orders,
    names some ranks have not sent yet, groups, joins, and a cache small enough to evict."""
    import random
    rng = random.Random(7)
    join = _core.COLLECTIVE_KINDS["join"]

    def same(a, b, where):
        a, b = dict(a), dict(b)
        fast_count = a.pop("in_step_rounds")
        assert b.pop("in_step_rounds") == 0, "the general-path controller took the short path"
        assert a == b, f"{where}: {a} != {b}"
        assert fast.digest() == slow.digest(), f"digests differ after {where}"
        return fast_count

    for size in (2, 3):
        fast = _core._ControllerHarness(size, cache_capacity=8)
        slow = _core._ControllerHarness(size, cache_capacity=8, in_step=False)
        names = [f"t{i}" for i in range(12)]
        in_step = 0
        for round_no in range(400):
            kind = rng.random()
            chosen = rng.sample(names, rng.randint(1, 5))
            messages = []
            for r in range(size):
                reqs = []
                for n in chosen:
                    extra = {}
                    if rng.random() < 0.1:
                        extra["shape"] = [5]  # a shape mismatch
                    if rng.random() < 0.05:
                        extra["dtype"] = 7
                    if kind < 0.2:
                        extra["payload"] = bytes([r + 1]) * 16  # inlined
                    reqs.append(req(n, **extra))
                if kind > 0.8:
                    rng.shuffle(reqs)  # another order on some ranks: the general path
                messages.append(msg(*reqs))
            if 0.75 < kind <= 0.8:  # one rank is a round late: pending names
                late = rng.randrange(size)
                held = messages[late]
                messages[late] = msg()
                in_step = same(fast.round(messages), slow.round(messages), f"round {round_no} (early ranks)")
                messages = [msg() for _ in range(size)]
                messages[late] = held
            if 0.7 < kind <= 0.72:
                messages = [msg(*group("G", "G.0", "G.1")) for _ in range(size)]
            if 0.72 < kind <= 0.74:  # one rank joins while the others go on, then all join
                joiner = rng.randrange(size)
                messages[joiner] = msg(req("hvdlite.join", kind=join))
                in_step = same(fast.round(messages), slow.round(messages), f"round {round_no} (a join)")
                messages = [msg() if r == joiner else msg(req("hvdlite.join", kind=join)) for r in range(size)]
            if 0.74 < kind <= 0.75:  # a join on one rank against a same-named allreduce elsewhere
                joiner = rng.randrange(size)
                messages = [msg(req("hvdlite.join", kind=join if r == joiner else 0)) for r in range(size)]
                in_step = same(fast.round(messages), slow.round(messages), f"round {round_no} (join vs allreduce)")
                messages = [msg() if r == joiner else msg(req("hvdlite.join", kind=join)) for r in range(size)]
            in_step = same(fast.round(messages), slow.round(messages), f"round {round_no}")
        assert in_step > 100, f"only {in_step} rounds took the short path"
