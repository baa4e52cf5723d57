"""The control link (Note [Control link] in csrc/control_link.h): real TCP connections on
127.0.0.1, made by the real connect, carrying the real hypercube (csrc/hypercube.h) of N
virtual ranks in one process, one thread each. Every rank gets every rank's bytes (short,
past the slot, and past the socket's buffers both ways at once); a rank connects only its
log2(N) + 1 partners; a rank whose connections close is named on every other rank; strangers at
a listener neither get in nor keep a partner out, and nothing listens once the partners are
connected.
"""

import math
import random
import socket
import struct
import threading
import time

import pytest

import hvdlite  # noqa: F401  (imports torch, then the extension)
from hvdlite import _core

SLOT = 2048
MAGIC = 0x6876644C


def _messages(size, seed, longest=300):
    rng = random.Random(seed)
    return [rng.randbytes(rng.randrange(longest)) + f"rank{r}".encode() for r in range(size)]


def _bound(size):
    return int(math.floor(math.log2(size))) + 1


@pytest.mark.parametrize("size", [2, 3, 5, 8, 12])
def test_every_rank_gets_every_message_from_log_n_partners(size):
    messages = _messages(size, size)
    results = _core._link_hypercube(messages, SLOT, rounds=3)
    for rank, (got, error, sent, received, connections) in enumerate(results):
        assert error is None, (rank, error)
        assert got == messages, rank
        assert 1 <= connections <= _bound(size), (rank, connections)
        assert sent <= 3 * _bound(size), (rank, sent)  # three rounds, every message within its slot
        assert received <= 3 * _bound(size), (rank, received)


@pytest.mark.parametrize("size", [2, 6])
def test_transfers_past_the_slot_and_past_the_socket_buffers_both_ways(size):
    messages = _messages(size, 5)
    messages[0] = random.Random(1).randbytes(6 << 20)  # 6 MB: far past a socket's buffers
    messages[size - 1] = random.Random(2).randbytes(3 << 20)
    results = _core._link_hypercube(messages, SLOT, rounds=2, timeout_seconds=60.0)
    for rank, (got, error, *_rest) in enumerate(results):
        assert error is None, (rank, error)
        assert got == messages, rank


@pytest.mark.parametrize("size", [2, 4, 8])
def test_the_cached_round_reduction_over_the_link(size):
    offers = [_core._cached_offer(r, True, False, 7, 9, 100 if r == 0 else 5, 2000, 16, [1, 3, 5 + r % 2],
                                  {3: struct.pack("<f", float(r))}) for r in range(size)]
    results = _core._link_hypercube(offers, SLOT, reduce=True)
    combined = {got[0] for got, error, *_rest in results if error is None}
    assert len(combined) == 1 and all(error is None for _, error, *_rest in results), results
    verdict = _core._cached_verdict(combined.pop(), size)
    assert verdict["all_clean"] and verdict["agree"] and verdict["clock_ms"] == 100
    assert verdict["ready"] == ([1, 3] if size > 1 else [1, 3, 5])
    assert [struct.unpack("<f", p[3])[0] for p in verdict["payloads"]] == [float(r) for r in range(size)]


@pytest.mark.parametrize("size,dead", [(2, [1]), (4, [3]), (5, [4]), (8, [5]), (8, [0, 6])])
def test_a_rank_whose_connections_close_is_named_on_every_other_at_once(size, dead):
    start = time.monotonic()
    results = _core._link_hypercube(_messages(size, 3), SLOT, dead=dead, timeout_seconds=30.0)
    assert time.monotonic() - start < 15  # a closed connection, not the 30 s timeout
    for rank, (got, error, *_rest) in enumerate(results):
        if rank in dead:
            continue
        assert got is None and error is not None, (rank, got)
        assert any(f"with rank {d}: rank {d} closed its control connection" in error for d in dead), (rank, error)


def _listen_port(link):
    return int(link.address.split(":")[0])


def test_strangers_at_a_listener_neither_get_in_nor_keep_the_partner_out():
    below = _core.ControlLink(0, 2, "127.0.0.1", ["127.0.0.1"], 20.0)
    above = _core.ControlLink(1, 2, "127.0.0.1", ["127.0.0.1"], 20.0)
    port = _listen_port(below)  # rank 0 accepts rank 1
    nonce = int(below.address.split(":")[1], 16)
    error = []
    accepting = threading.Thread(target=lambda: error.append(_connect(below, {1: above.address})))
    accepting.start()
    strangers = []
    for i in range(150):  # past the 64 unverified connections a listener holds
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % 3 == 0:
            s.sendall(b"x" * 16)  # junk
        elif i % 3 == 1:
            s.sendall(struct.pack("<IIQ", MAGIC, 1, nonce ^ 1))  # rank 1's hello with a wrong nonce
        strangers.append(s)  # the rest say nothing
    assert _connect(above, {0: below.address}) is None
    accepting.join(30)
    assert error == [None]
    assert below.connections == 1 and above.connections == 1
    # each stranger was closed (end of file or a reset), and nothing listens any more
    for s in strangers:
        s.settimeout(10)
        try:
            assert s.recv(8) == b""
        except ConnectionResetError:
            pass
        s.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)


def _connect(link, addresses):
    try:
        link.connect(addresses)
    except RuntimeError as e:
        return str(e)
    return None


def test_a_partner_pushed_out_by_a_flood_dials_again_and_gets_in():
    """The partner's connection waits in the listener's backlog ahead of 150 strangers; the
    first pass accepts them all, and past 64 unverified the oldest (the partner's, its hello
    not read yet) is closed: the partner dials again and gets in."""
    below = _core.ControlLink(0, 2, "127.0.0.1", ["127.0.0.1"], 20.0)
    above = _core.ControlLink(1, 2, "127.0.0.1", ["127.0.0.1"], 20.0)
    port = _listen_port(below)
    error = []
    dialling = threading.Thread(target=lambda: error.append(_connect(above, {0: below.address})))
    dialling.start()
    time.sleep(0.2)  # its connection is in the backlog, its hello sent
    strangers = []
    for _ in range(150):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))  # a full backlog drops the rest: they retry
        strangers.append(s)
    assert _connect(below, {1: above.address}) is None
    dialling.join(30)
    assert error == [None]
    assert below.connections == 1 and above.connections == 1
    for s in strangers:
        s.close()


def test_a_partner_that_cannot_be_reached_or_never_comes_is_named():
    above = _core.ControlLink(1, 2, "127.0.0.1", ["127.0.0.1"], 30.0)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    start = time.monotonic()
    error = _connect(above, {0: f"{port}:1234:127.0.0.1"})
    assert error and "rank 1 could not connect its control link to rank 0" in error, error
    assert "Connection refused" in error, error
    # its listener was open before its address went out: refused is final, not waited out
    assert "within" not in error and time.monotonic() - start < 5, error
    below = _core.ControlLink(0, 2, "127.0.0.1", ["127.0.0.1"], 1.0)
    error = _connect(below, {})
    assert error and "to rank 1 (it never connected) within 1 s" in error, error
