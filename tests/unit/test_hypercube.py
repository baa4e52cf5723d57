"""The control plane's exchange across hosts (Note [Control exchange by hypercube] in
csrc/hypercube.h), run by N virtual ranks in one process over in-memory mailboxes: every rank
gets every rank's bytes; each rank sends at most log2(N) + 1 transfers a round (plus one per
message too long for its slot) to at most log2(N) + 1 peers; a dead rank fails every live rank
with the first reason (Note [Failures travel the hypercube]), never a hang.
"""

import math
import random

import pytest

import hvdlite  # noqa: F401  (imports torch, then the extension)
from hvdlite import _core

SLOT = 2048


def _messages(size, seed, longest=300):
    rng = random.Random(seed)
    return [bytes(rng.randrange(256) for _ in range(rng.randrange(longest))) + f"rank{r}".encode()
            for r in range(size)]


def _bound(size):
    return int(math.floor(math.log2(size))) + 1


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 31, 33, 64])
def test_every_rank_gets_every_message(size):
    messages = _messages(size, size)
    results = _core._hypercube(messages, SLOT, rounds=2)
    for rank, (got, error, sent, _, received, peers, cube_peers) in enumerate(results):
        assert error is None, (rank, error)
        assert got == messages, rank
        if size > 1:
            assert sent <= 2 * _bound(size), (rank, sent)  # two rounds
            assert len(peers) <= _bound(size), (rank, peers)
            assert sorted(peers) == sorted(cube_peers)
            # each other rank's message reaches this rank once a round, plus framing
            assert received >= 2 * sum(len(m) for i, m in enumerate(messages) if i != rank)


@pytest.mark.parametrize("size", [2, 5, 8])
def test_messages_longer_than_the_slot_follow_in_a_second_transfer(size):
    messages = _messages(size, 7)
    messages[size - 1] = bytes(range(256)) * 40  # 10 KB: past a 2 KiB slot
    results = _core._hypercube(messages, SLOT)
    for rank, (got, error, *_rest) in enumerate(results):
        assert error is None, (rank, error)
        assert got == messages, rank
    # The transfers that carried the long message needed a second part, the others not
    short = _core._hypercube(_messages(size, 7), SLOT)
    extra = sum(r[2] for r in results) - sum(r[2] for r in short)
    assert extra == size - 1, extra  # each other rank receives it exactly once


@pytest.mark.parametrize("size,dead", [(2, [1]), (4, [3]), (5, [4]), (5, [0]), (8, [5]), (13, [2, 11])])
def test_a_dead_rank_fails_every_live_rank_with_the_first_reason(size, dead):
    results = _core._hypercube(_messages(size, 3), SLOT, dead=dead, timeout_seconds=20.0)
    for rank, (got, error, *_rest) in enumerate(results):
        if rank in dead:
            continue
        assert got is None and error is not None, (rank, got)
        # the reason names a dead rank, whichever live rank saw it first
        assert "could not exchange control messages with rank" in error, (rank, error)
        assert any(f"with rank {d}:" in error for d in dead), (rank, error)
        assert "Timed out" not in error, (rank, error)  # carried by the partners, not waited out


def test_a_failed_hypercube_refuses_the_next_round():
    results = _core._hypercube(_messages(4, 1), SLOT, dead=[2], rounds=3)
    for rank in (0, 1, 3):
        assert results[rank][1] is not None

