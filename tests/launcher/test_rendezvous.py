"""The secret-protected rendezvous store: refusal without the secret, Store semantics, and a
real Gloo allreduce over SecretStore between two processes."""
import datetime
import socket
import subprocess
import sys
import threading
import time

import pytest

from hvdlite._job.wire import _HANDSHAKE_TRIES
from hvdlite.runner.rendezvous import (MAGIC, RendezvousClient, RendezvousError,
                                       RendezvousServer, new_secret, recv_frame, send_frame)


@pytest.fixture
def server():
    srv = RendezvousServer(new_secret()).start()
    yield srv
    srv.stop()


def _raw(server):
    sock = socket.create_connection((server.addr, server.port), timeout=5)
    magic, nonce = recv_frame(sock)
    assert magic == MAGIC and len(nonce) == 32
    return sock


def _closed(sock):
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_rendezvous_without_secret_is_refused_and_reads_nothing(server):
    RendezvousClient(server.addr, server.port, server.secret, rank=0).call(
        b"SET", [b"model", b"weights"])
    sock = _raw(server)
    # Skip the handshake and ask for the key straight away.
    send_frame(sock, [b"GET", b"model", b"1000"])
    assert _closed(sock)
    assert server.refused_connections == 1


def test_rendezvous_wrong_secret_is_refused_and_reads_nothing(server):
    RendezvousClient(server.addr, server.port, server.secret).call(b"SET", [b"k", b"v"])
    sock = _raw(server)
    send_frame(sock, [b"7", b"\0" * 32])
    assert _closed(sock)
    with pytest.raises(RendezvousError, match="refused rank 5"):
        RendezvousClient(server.addr, server.port, "not-the-secret", rank=5,
                         connect_timeout=2)
    assert server.refused_connections == 1 + _HANDSHAKE_TRIES  # the client tries a few times
    assert 5 not in server.arrived_ranks() and 7 not in server.arrived_ranks()


def test_rendezvous_secret_itself_in_place_of_mac_is_refused(server):
    sock = _raw(server)
    send_frame(sock, [b"0", server.secret.encode()])
    assert _closed(sock)


def test_rendezvous_oversized_handshake_is_refused(server):
    sock = _raw(server)
    send_frame(sock, [b"0", b"x" * 100_000])
    assert _closed(sock)


def test_rendezvous_records_arrived_ranks(server):
    for rank in (0, 2):
        RendezvousClient(server.addr, server.port, server.secret, rank=rank)
    RendezvousClient(server.addr, server.port, server.secret)  # not a rank
    assert server.arrived_ranks() == {0, 2}


def test_secret_store_semantics(server):
    from hvdlite.runner.rendezvous import connect
    store = connect(server.addr, server.port, server.secret, rank=0, timeout=5)
    store.set("a", b"1")
    store.set("s", "text")
    assert store.get("a") == b"1" and store.get("s") == b"text"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5 and store.get("n") == b"5"
    assert store.compare_set("a", b"1", b"2") == b"2"
    assert store.compare_set("a", b"1", b"3") == b"2"
    assert store.compare_set("new", b"", b"x") == b"x"
    assert store.compare_set("missing", b"e", b"x") == b"e"
    store.append("log", b"ab")
    store.append("log", b"cd")
    assert store.get("log") == b"abcd"
    assert store.check(["a", "n"]) and not store.check(["a", "nope"])
    assert store.num_keys() == 5  # a, s, n, new, log
    assert store.delete_key("a") and not store.delete_key("a")
    assert store.multi_get(["n", "s"]) == [b"5", b"text"]
    store.wait(["n", "s"])
    store.set_timeout(datetime.timedelta(seconds=0.3))
    assert store.timeout == datetime.timedelta(seconds=0.3)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out.*never"):
        store.get("never")
    with pytest.raises(RuntimeError, match="timed out.*never"):
        store.wait(["n", "never"], datetime.timedelta(seconds=0.2))
    assert time.monotonic() - t0 < 3


def test_secret_store_blocked_get_does_not_block_other_threads(server):
    from hvdlite.runner.rendezvous import connect
    store = connect(server.addr, server.port, server.secret, rank=0, timeout=10)
    got = []
    reader = threading.Thread(target=lambda: got.append(store.get("late")))
    reader.start()
    time.sleep(0.2)
    store.set("late", b"here")  # same store object, another thread
    reader.join(timeout=5)
    assert got == [b"here"]


def test_secret_store_under_torch_prefix_store_without_python_reference(server):
    import gc

    import torch.distributed as dist
    from hvdlite.runner.rendezvous import connect
    # Only the C++ PrefixStore refers to the SecretStore: it must still work.
    store = dist.PrefixStore("p", connect(server.addr, server.port, server.secret, timeout=5))
    gc.collect()
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert store.add("c", 4) == 4
    store.wait(["k"])


GLOO_RANK = r"""
import datetime, sys
import torch, torch.distributed as dist
from hvdlite.runner.rendezvous import connect
addr, port, secret, rank = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
store = connect(addr, port, secret, rank=rank, timeout=30)
pg = dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, 2,
                           datetime.timedelta(seconds=30))
t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
pg.allreduce([t]).wait()
assert t.tolist() == [3.0, 30.0], t
# Destroy the group while the interpreter is whole: left to interpreter teardown, Gloo's threads
# can outlive the Python half of the store and abort the process (as hvd.shutdown() avoids by
# dropping its groups in an atexit handler).
del pg
store.close()
print("ok", rank)
"""


def test_secret_store_gloo_allreduce_two_processes(server, tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_RANK, server.addr, str(server.port),
                               server.secret, str(rank)], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err
        assert out.strip() == f"ok {rank}"
    assert server.arrived_ranks() == {0, 1}
