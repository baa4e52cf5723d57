"""The cached round's reduction (Note [Cached rounds] in csrc/cached_round.h), run by N virtual
ranks in one process over in-memory mailboxes: every rank ends with the same bytes, whose
verdict equals one computed here from the offers (the ids every rank offered, rank 0's clock,
every rank's inline payloads, whether all were clean and agreed); combining is the same in
either order; a digest or id space that differs on one rank shows as disagreement; a dead rank
fails every live rank; each rank sends at most log2(N) + 1 transfers of one combined offer.
"""

import math
import random

import pytest

import hvdlite  # noqa: F401  (imports torch, then the extension)
from hvdlite import _core

SPACE = 161  # ResNet-50's gradients


def _offers(size, seed, space=SPACE, settings=7, state=11, clean=None, payload_every=5):
    rng = random.Random(seed)
    offers, sets, payloads = [], [], []
    for r in range(size):
        ids = sorted(rng.sample(range(space), rng.randrange(space * 3 // 4, space + 1)))
        mine = {i: bytes([r % 256, i % 256]) * (1 + i % 3) for i in ids if payload_every and i % payload_every == 0}
        is_clean = True if clean is None else clean[r]
        offers.append(_core._cached_offer(r, is_clean, r % 2 == 0, settings, state, 1000 + r, 5000 + r, space,
                                          ids, mine))
        sets.append(set(ids))
        payloads.append(mine)
    return offers, sets, payloads


def _bound(size):
    return int(math.floor(math.log2(size))) + 1


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 16, 33])
def test_every_rank_reads_the_verdict_computed_from_the_offers(size):
    offers, sets, payloads = _offers(size, size)
    results = _core._hypercube(offers, 0, rounds=2, reduce=True)
    combined = {bytes(r[0][0]) for r in results}
    assert len(combined) == 1, "ranks ended with different bytes"
    verdict = _core._cached_verdict(combined.pop(), size)
    assert verdict["ready"] == sorted(set.intersection(*sets))
    assert verdict["all_clean"] and verdict["agree"]
    assert verdict["all_outstanding"] == (size == 1)  # odd ranks offered "nothing outstanding"
    assert not verdict["all_idle"]
    idle = _core._cached_verdict(bytes(_core._hypercube(
        [_core._cached_offer(r, True, False, 7, 11, 0, 0, SPACE, [], {}) for r in range(size)], 0,
        reduce=True)[0][0][0]), size)
    assert idle["all_idle"] and idle["ready"] == []
    assert (verdict["clock_ms"], verdict["base_us"]) == (1000, 5000)  # rank 0's
    assert [dict(p) for p in verdict["payloads"]] == payloads
    for rank, (_, error, _, _, _, peers, _) in enumerate(results):
        assert error is None, (rank, error)
        assert len(peers) <= _bound(size), (rank, peers)


def test_combining_is_the_same_in_either_order_and_refuses_a_rank_twice():
    offers, _, _ = _offers(4, 1)
    a = _core._cached_combine(offers[0], offers[1])
    assert a == _core._cached_combine(offers[1], offers[0])
    b = _core._cached_combine(offers[2], offers[3])
    assert _core._cached_combine(a, b) == _core._cached_combine(b, a)
    # another id space (bitmaps of different lengths): the same bytes in either order too
    other = _core._cached_offer(1, True, True, 7, 11, 0, 0, SPACE + 20, [1, SPACE + 3], {})
    assert _core._cached_combine(offers[0], other) == _core._cached_combine(other, offers[0])
    with pytest.raises(RuntimeError, match="rank 0's payloads"):
        _core._cached_combine(offers[0], offers[0])
    with pytest.raises(RuntimeError, match="malformed"):
        _core._cached_combine(offers[0], offers[1][:-3])


@pytest.mark.parametrize("what", ["settings", "state", "space", "unclean"])
def test_one_rank_that_differs_is_seen_by_every_rank(what):
    size = 5
    offers, _, _ = _offers(size, 2)
    odd = {"settings": dict(settings=8), "state": dict(state=12), "space": dict(space=SPACE + 1),
           "unclean": dict(clean=[r != 3 for r in range(size)])}[what]
    other, _, _ = _offers(size, 2, **odd)
    offers[3] = other[3]
    results = _core._hypercube(offers, 0, reduce=True)
    verdicts = {bytes(r[0][0]) for r in results}
    assert len(verdicts) == 1
    verdict = _core._cached_verdict(verdicts.pop(), size)
    if what == "unclean":
        assert not verdict["all_clean"] and verdict["agree"]
    else:
        assert verdict["all_clean"] and not verdict["agree"]


@pytest.mark.parametrize("size,dead", [(2, [1]), (5, [4]), (8, [5]), (13, [2, 11])])
def test_a_dead_rank_fails_every_live_rank(size, dead):
    offers, _, _ = _offers(size, 3)
    results = _core._hypercube(offers, 0, dead=dead, timeout_seconds=20.0, reduce=True)
    for rank, (got, error, *_rest) in enumerate(results):
        if rank in dead:
            continue
        assert got is None and error is not None, (rank, got)
        assert "could not exchange control messages" in error, error


@pytest.mark.parametrize("size", [2, 3, 64, 100])
def test_a_steady_step_costs_log_n_transfers_of_one_offer_at_any_size(size):
    # No payloads: each transfer is one combined offer (Swap's header, the bitmap's length, the
    # words, the bitmap, an empty list of sections), the same length at 100 ranks as at 2.
    offers, _, _ = _offers(size, 4, payload_every=0)
    results = _core._hypercube(offers, 0, reduce=True)
    for rank, (_, error, sent, sent_bytes, *_rest) in enumerate(results):
        assert error is None
        assert sent <= _bound(size), (rank, sent)
        assert sent_bytes == sent * (8 + 4 + 64 + (SPACE + 7) // 8 + 4), (size, rank, sent_bytes, sent)


# ---- repeating a remembered decision (Controller::ProcessRepeated) -------------------------

ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL = 0, 1, 2, 3


def _requests(rank, size):
    return [
        {"name": "w", "shape": [3, 4], "op": 1},
        {"name": "avg", "shape": [5], "op": 0, "prescale": 0.5},
        {"name": "g", "kind": ALLGATHER, "shape": [rank + 1, 2]},
        {"name": "b", "kind": BROADCAST, "shape": [7], "root": size - 1},
    ]


@pytest.mark.parametrize("size", [2, 5])
def test_a_repeated_decision_equals_the_full_rounds_decision(size):
    # Two controllers decide the same step once; then one decides every rank's cached requests
    # in full, the other repeats its remembered decisions: the same items, the same digest.
    full = _core._ControllerHarness(size, cache_capacity=16)
    repeated = _core._ControllerHarness(size, cache_capacity=16)
    step = [{"requests": _requests(r, size)} for r in range(size)]
    full.round(step)
    repeated.round(step)
    assert full.digest() == repeated.digest()
    # cache ids follow the first decisions (w, avg, g, b): a cached round decides in id order,
    # so the full round gets every rank's requests in that order
    for _ in range(3):
        a = full.round(step)
        b = repeated.repeat(["w", "avg", "g", "b"])
        assert b is not None
        assert a["ready"] == b["ready"]
        assert full.digest() == repeated.digest()
    # an alltoall keeps no decision to repeat (its splits are N x N): the engine expands it
    splits = [{"name": "a2a", "kind": ALLTOALL, "shape": [size, 2], "splits": [1] * size}]
    full.round([{"requests": splits}] * size)
    assert full.repeat(["a2a"]) is None
    assert full.repeat(["w"]) is not None


def test_an_entry_that_changed_forgets_its_decision_even_when_the_new_one_fails():
    # "x" decided as an allreduce is kept; then every rank sends "x" as an alltoall whose
    # splits do not cover its rows: the entry now holds the alltoall and fails, and must not
    # repeat the allreduce's decision for it.
    size = 3
    harness = _core._ControllerHarness(size, cache_capacity=16)
    harness.round([{"requests": [{"name": "x", "shape": [4]}]}] * size)
    assert harness.repeat(["x"]) is not None
    bad = harness.round([{"requests": [{"name": "x", "kind": ALLTOALL, "shape": [size, 2], "splits": [1] * (size + 1)}]}] * size)
    assert bad["ready"][0]["code"] != 0, bad  # failed
    assert harness.repeat(["x"]) is None
