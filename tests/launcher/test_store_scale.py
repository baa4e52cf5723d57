"""The rendezvous store at a thousand clients (Note [One loop serves the store] in
hvdlite/_job/server.py): one thread whatever the number of connections, blocking requests parked
and answered when their keys arrive, MULTI_GET and MULTI_SET as single requests, and the
requests one hvd.init() and one init_process_group("hvdlite") make per rank counted at three
job sizes."""
import os
import resource
import socket
import threading

import pytest
import torch.distributed as dist

from hvdlite._job.wire import _mac, encode_frame, recv_frame
from hvdlite.runner.rendezvous import RendezvousClient, RendezvousServer, new_secret
from tests.harness import Job, run_ranks

CLIENTS = 1000


def _rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _authenticated(server, rank):
    sock = socket.create_connection((server.addr, server.port), timeout=30)
    _, nonce = recv_frame(sock)
    rank_text = str(rank).encode()
    sock.sendall(encode_frame([rank_text, _mac(server.secret, nonce, rank_text)]))
    assert recv_frame(sock) == [b"OK"]
    return sock


@pytest.fixture
def many_descriptors():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * CLIENTS + 256  # both ends of every connection live in this process
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"needs {need} file descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_thousand_clients_wait_together_on_one_server_thread(many_descriptors):
    server = RendezvousServer(new_secret()).start()
    threads_before = threading.active_count()
    rss_before = _rss_kib()
    try:
        socks = [_authenticated(server, rank) for rank in range(CLIENTS)]
        assert threading.active_count() == threads_before  # no thread per connection
        assert server.arrived_ranks() == set(range(CLIENTS))
        names = [f"rank/{r}".encode() for r in range(CLIENTS)]
        # every client first asks for every record, none of which exists yet: all park
        for sock in socks:
            sock.sendall(encode_frame([b"MULTI_GET", b"60000", *names]))
        # then each publishes its own, the last of which answers everyone
        setter = RendezvousClient(server.addr, server.port, server.secret, rank=-1)
        for r in range(CLIENTS):
            setter.call(b"SET", [names[r], f"record of {r}".encode()])
        want = [b"OK"] + [f"record of {r}".encode() for r in range(CLIENTS)]
        for sock in socks:
            assert recv_frame(sock) == want
        # one request each for the whole table, besides the setter's
        counts = server.requests_by_rank()
        assert all(counts[r] == 1 for r in range(CLIENTS)), counts
        assert counts[-1] == CLIENTS
        # the same connections take a MULTI_SET and a WAIT that times out naming what is missing
        socks[0].sendall(encode_frame([b"MULTI_SET", b"a", b"1", b"b", b"2"]))
        assert recv_frame(socks[0]) == [b"OK"]
        socks[1].sendall(encode_frame([b"WAIT", b"200", b"a", b"never"]))
        assert recv_frame(socks[1]) == [b"TIMEOUT", b"never"]
        socks[2].sendall(encode_frame([b"MULTI_GET", b"0", b"b", b"a"]))
        assert recv_frame(socks[2]) == [b"OK", b"2", b"1"]
        assert threading.active_count() == threads_before
        # a thousand connections and their parked requests cost megabytes, not a thread each
        assert _rss_kib() - rss_before < 200 * 1024
        for sock in socks:
            sock.close()
        setter.close()
    finally:
        server.stop()
    assert not server._thread.is_alive()


def test_a_client_that_leaves_while_parked_costs_nothing_later(many_descriptors):
    server = RendezvousServer(new_secret()).start()
    try:
        for _ in range(50):
            sock = _authenticated(server, 0)
            sock.sendall(encode_frame([b"GET", b"never-set", b"0"]))
            sock.close()
        client = RendezvousClient(server.addr, server.port, server.secret, rank=1)
        client.call(b"SET", [b"never-set", b"now"])  # wakes fifty departed waiters
        assert client.call(b"GET", [b"never-set", b"1000"], 1000) == [b"now"]
        client.close()
        # every departed connection was closed and forgot its park
        assert not server._waiters
    finally:
        server.stop()


def _init_and_shutdown():
    import hvdlite as hvd
    hvd.init()
    hvd.shutdown()
    return True


def _backend_group_and_destroy():
    import torch.distributed as dist
    import hvdlite  # noqa: F401  (registers the backend)
    dist.init_process_group("hvdlite", init_method="hvdlite://")
    dist.destroy_process_group()
    return True


class _CountingStore(dist.Store):
    """A store that counts the calls made to the one it wraps: on a TCPStore each is a request
    (multi_get and multi_set included)."""

    def __init__(self, store):
        super().__init__()
        self._store, self.calls = store, 0
        super().set_timeout(store.timeout)

    def _call(self, name, *args):
        self.calls += 1
        return getattr(self._store, name)(*args)

    def set(self, key, value):
        return self._call("set", key, value)

    def get(self, key):
        return self._call("get", key)

    def wait(self, keys, *timeout):
        return self._call("wait", keys, *timeout)

    def check(self, keys):
        return self._call("check", keys)

    def add(self, key, value):
        return self._call("add", key, value)

    def multi_get(self, keys):
        return self._call("multi_get", keys)

    def multi_set(self, keys, values):
        return self._call("multi_set", keys, values)

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, expected, desired)

    def delete_key(self, key):
        return self._call("delete_key", key)

    def num_keys(self):
        return self._call("num_keys")

    def has_extended_api(self):
        return True


def _init_through_a_plain_store():
    """hvd.init() as under torchrun, mpirun or srun: the job's TCPStore, no hvdliterun store;
    returns the calls init() made to it."""
    import hvdlite as hvd
    from hvdlite import basics
    made = []
    plain = basics._store_for

    def counted(rendezvous, topology):
        store = plain(rendezvous, topology)
        assert isinstance(store, dist.TCPStore), store  # the plain path, not hvdliterun's store
        made.append(_CountingStore(store))
        return made[-1]
    basics._store_for = counted
    hvd.init()
    hvd.shutdown()
    return made[0].calls


def _requests_per_rank(size, job="_init_and_shutdown", **env):
    server = RendezvousServer(new_secret()).start()
    try:
        env = {"HVDLITE_RENDEZVOUS_SECRET": server.secret, "HVDLITE_RENDEZVOUS_PORT": str(server.port),
               "HVDLITE_CPU_CHANNELS": "2", **env}
        assert all(Job(size, "tests.launcher.test_store_scale", job, env=env).wait(timeout=120))
        counts = server.requests_by_rank()
    finally:
        server.stop()
    assert sorted(counts) == list(range(size)), counts
    return counts


# the control plane over the control link (its address goes out with the Gloo groups') and the
# data over Gloo, as across hosts
_ACROSS_HOSTS = {"HVDLITE_SHARED_MEMORY": "0"}


@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, _ACROSS_HOSTS], ids=["one host", "as across hosts"])
def test_init_makes_at_most_ten_requests_per_rank_whatever_the_size(env):
    """hvd.init()'s store requests per rank do not grow with the job: one write and one read of
    every rank's record, the shared-memory agreement on one host, and the Gloo groups'
    addresses in two requests (Note [Group addresses in two requests] in
    hvdlite/_runtime/group_store.py), where each group used to write once and read twice per
    peer it connected to (19 requests per rank at 8 ranks)."""
    counts = {size: _requests_per_rank(size, **env) for size in (2, 4, 8)}
    per_rank = {size: set(c.values()) for size, c in counts.items()}
    assert max(max(v) for v in per_rank.values()) <= 10, per_rank
    assert len(set.union(*per_rank.values())) == 1, per_rank  # the same at every size and rank


@pytest.mark.slow
def test_a_process_group_of_the_backend_makes_as_few_requests_per_rank_whatever_the_size():
    """init_process_group("hvdlite") through hvdliterun's store (init_method="hvdlite://")
    builds its engine as hvd.init() does, so its requests per rank do not grow with the job
    either (those torch's own rendezvous adds included)."""
    counts = {size: _requests_per_rank(size, "_backend_group_and_destroy") for size in (2, 4, 8)}
    per_rank = {size: set(c.values()) for size, c in counts.items()}
    assert max(max(v) for v in per_rank.values()) <= 10, per_rank
    assert len(set.union(*per_rank.values())) == 1, per_rank


@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, _ACROSS_HOSTS], ids=["one host", "as across hosts"])
def test_init_through_torchruns_store_makes_as_few_requests_whatever_the_size(env):
    """Under torchrun, mpirun or srun hvd.init() rendezvouses through the job's TCPStore, where
    multi_get and multi_set are single requests too: the calls init() makes to it (counted by a
    wrapper in each rank) are the same few at every size and rank."""
    calls = {size: run_ranks(size, "tests.launcher.test_store_scale", "_init_through_a_plain_store", env={"HVDLITE_CPU_CHANNELS": "2", **env},
                             timeout=120) for size in (2, 4, 8)}
    per_rank = {size: set(c) for size, c in calls.items()}
    assert max(max(v) for v in per_rank.values()) <= 10, per_rank
    assert len(set.union(*per_rank.values())) == 1, per_rank
