"""GroupStore: the store an engine's Gloo groups rendezvous through, in two requests.

Note [Group addresses in two requests]
Each Gloo group publishes its address with one store write at creation, and connects a pair of
ranks the first time they exchange, reading the peer's address then with a WAIT and a GET
(Note [Connections on first use] in groups.py). Over an engine's groups that is one write per
group and two reads per peer connected at init: the control plane's partners (every rank up to
HVDLITE_CONTROL_ALLTOALL_MAX, log2(N) + 1 beyond), each CPU channel's ring neighbours and the
broadcast tree's, so the requests per rank grew with N (19 at 8 ranks) and with the groups.

The groups write and read through a GroupStore instead. While init() builds the groups it holds
their writes; `publish()` sends them all in one MULTI_SET, and `prefetch(keys)` reads, in one
MULTI_GET, every address the paths connected at init will ask for (the caller knows which:
ControlChannel::Peers for the control plane, Gloo's ring and binomial broadcast tree for the
data groups). A group's WAIT and GET for a key read then are answered here. Any other key (a
pair first connected later, by an alltoall or a broadcast from another root) goes to the store
as before: the prefetch is a prediction, and a wrong one costs requests, never correctness.
Bytes stay O(log N) addresses per rank; requests are 2 whatever N and however many groups.

The store this wraps may be hvdlite's SecretStore, a TCPStore (torchrun), or a PrefixStore over
one: every one of them answers multi_get and multi_set in one request. A GroupStore must stay
referenced while its groups live (Note [Keeping SecretStore alive] in store.py), which nothing
in Python tracks, so it stays in the process's open stores, as a SecretStore does; once init()
has connected what it prefetched, `forget()` drops the addresses, leaving a few hundred bytes.
"""
import threading
from typing import Dict, Iterable, List

import torch.distributed as dist

from . import state as _state


def _key(key) -> str:
    return key.decode() if isinstance(key, (bytes, bytearray)) else str(key)


def _value(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class GroupStore(dist.Store):
    """A Store over `store` that holds writes until publish() and answers prefetched reads."""

    def __init__(self, store) -> None:
        super().__init__()
        self._store = store
        self._lock = threading.Lock()
        self._held: Dict[str, bytes] = {}
        self._holding = True
        self._known: Dict[str, bytes] = {}
        super().set_timeout(store.timeout)
        _state.process.open_stores.add(self)

    def __repr__(self) -> str:
        return f"GroupStore({self._store!r})"

    # -- the two requests
    def publish(self) -> None:
        """Every held write in one request; later writes go straight to the store."""
        with self._lock:
            held, self._held, self._holding = self._held, {}, False
        if held:
            self._store.multi_set(list(held), list(held.values()))

    def prefetch(self, keys: Iterable[str]) -> None:
        """Reads `keys` in one request (waiting until each exists) and answers them from here on."""
        with self._lock:
            keys = [k for k in dict.fromkeys(keys) if k not in self._known]
        if keys:
            values = self._store.multi_get(keys)
            with self._lock:
                self._known.update(zip(keys, (bytes(v) for v in values)))

    def forget(self) -> None:
        """Drops the prefetched addresses: their pairs are connected, and Gloo reads a pair's
        address once."""
        with self._lock:
            self._known = {}

    # -- the Store interface, as the groups use it
    def set_timeout(self, timeout) -> None:
        super().set_timeout(timeout)

    def set(self, key, value) -> None:
        key, value = _key(key), _value(value)
        with self._lock:
            if self._holding:
                self._held[key] = value
                return
        self._store.set(key, value)

    def get(self, key) -> bytes:
        key = _key(key)
        with self._lock:
            if key in self._known:
                return self._known[key]
            if key in self._held:
                return self._held[key]
        return self._store.get(key)

    def wait(self, keys, timeout=None) -> None:
        with self._lock:
            missing = [k for k in map(_key, keys) if k not in self._known and k not in self._held]
        if missing:
            if timeout is None:
                self._store.wait(missing)
            else:
                self._store.wait(missing, timeout)

    def check(self, keys) -> bool:
        with self._lock:
            missing = [k for k in map(_key, keys) if k not in self._known and k not in self._held]
        return not missing or self._store.check(missing)

    def multi_get(self, keys) -> List[bytes]:
        keys = [_key(k) for k in keys]
        self.prefetch(keys)
        with self._lock:
            return [self._known[k] for k in keys]

    def multi_set(self, keys, values) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)

    def has_extended_api(self) -> bool:
        return True

    def add(self, key, value: int) -> int:
        return self._store.add(_key(key), value)

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        return self._store.compare_set(_key(key), expected_value, desired_value)

    def append(self, key, value) -> None:
        self._store.append(_key(key), value)

    def delete_key(self, key) -> bool:
        with self._lock:
            self._known.pop(_key(key), None)
        return self._store.delete_key(_key(key))

    def num_keys(self) -> int:
        return self._store.num_keys()


def ring_peers(rank: int, size: int) -> List[int]:
    """Gloo's ring allreduce and allgather: the neighbours on either side."""
    return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})


def broadcast_peers(rank: int, size: int, root: int = 0) -> List[int]:
    """Gloo's broadcast from `root`: a binomial tree over ranks relative to the root, where
    relative rank v's parent is v with its highest bit cleared and its children are v + 2^k
    for every 2^k > v (measured: the reads Gloo's lazy connections make)."""
    v = (rank - root) % size
    peers = []
    if v:
        peers.append(v - (1 << (v.bit_length() - 1)))
    step = 1 << v.bit_length() if v else 1
    while v + step < size:
        peers.append(v + step)
        step <<= 1
    return sorted({(p + root) % size for p in peers})
