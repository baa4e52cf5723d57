"""SecretStore: the rendezvous client as a torch.distributed.Store, and connecting to it.

torch lets Python subclass `torch.distributed.Store` (a pybind trampoline forwards the C++
virtual calls to the Python methods), so Gloo, NCCL and PrefixStore use this store exactly like
a TCPStore. All the wire work is in rendezvous.RendezvousClient; this file only adapts types and
timeouts. Safe to use from several threads (the client pools its connections).
"""
import datetime
from typing import List, Optional, Sequence, Union

import torch.distributed as dist

from . import state as _state
from .._job.wire import RendezvousClient, RendezvousError, RendezvousTimeout

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)

# torch raises DistStoreError on store timeouts; callers (and torch itself) may catch it.
_StoreError = getattr(dist, "DistStoreError", RuntimeError)


class StoreTimeoutError(_StoreError):
    pass


# Note [Keeping SecretStore alive]
# A Python subclass of a pybind class lives in two halves: the C++ Store, which PrefixStore and
# process groups hold by intrusive_ptr, and the Python object, which holds the overrides. When
# the last *Python* reference goes (e.g. PrefixStore("p", connect(...)) with no variable), the
# Python half is freed and every later call fails with "Not implemented" inside c10d. So each
# open SecretStore stays in a set (_state.process.open_stores) until close(). hvd.shutdown()
# does not close it: the process keeps its store so that a later init() (a new generation) can
# rendezvous again.


def _as_timedelta(timeout) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _ms(timeout: datetime.timedelta) -> int:
    # A zero timedelta is c10d's kNoTimeout: wait forever (0 on the wire).
    return max(0, int(timeout.total_seconds() * 1000))


def _bytes(value: Union[str, bytes, bytearray, Sequence[int]]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class SecretStore(dist.Store):
    """A Store backed by the launcher's secret-protected rendezvous server.

    Keys are str (bytes accepted), values are bytes (str is encoded as UTF-8). `get` and `wait`
    block until the keys exist, up to the store timeout (`set_timeout`, default 300 s), and then
    raise StoreTimeoutError (a torch DistStoreError). Every other failure raises RuntimeError.
    """

    def __init__(self, addr: str, port: int, secret: str, rank: int = -1,
                 timeout: Union[None, float, datetime.timedelta] = None) -> None:
        super().__init__()
        td = _as_timedelta(timeout)
        self._timeout = td
        super().set_timeout(td)
        connect_s = td.total_seconds() if td.total_seconds() > 0 else 300.0
        try:
            self._client = RendezvousClient(addr, port, secret, rank=rank,
                                            connect_timeout=connect_s)
        except RendezvousError as exc:
            raise RuntimeError(str(exc)) from None
        self.addr, self.port, self.rank = addr, int(port), rank
        _state.process.open_stores.add(self)

    def __repr__(self) -> str:
        return f"SecretStore({self.addr}:{self.port}, rank={self.rank})"

    def _call(self, op: bytes, args, timeout: Optional[datetime.timedelta] = None) -> List[bytes]:
        try:
            return self._client.call(op, args, None if timeout is None else _ms(timeout))
        except RendezvousTimeout as exc:
            raise StoreTimeoutError(str(exc)) from None
        except RendezvousError as exc:
            raise RuntimeError(str(exc)) from None

    # -- timeouts
    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = _as_timedelta(timeout)
        super().set_timeout(self._timeout)

    # -- the Store interface
    def set(self, key, value) -> None:
        self._call(b"SET", [_bytes(key), _bytes(value)])

    def get(self, key) -> bytes:
        return self._call(b"GET", [_bytes(key), str(_ms(self._timeout)).encode()],
                          self._timeout)[0]

    def add(self, key, value: int) -> int:
        return int(self._call(b"ADD", [_bytes(key), str(int(value)).encode()])[0])

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        return self._call(b"CAS", [_bytes(key), _bytes(expected_value),
                                   _bytes(desired_value)])[0]

    def append(self, key, value) -> None:
        self._call(b"APPEND", [_bytes(key), _bytes(value)])

    def multi_get(self, keys) -> List[bytes]:
        """Every key's value in one request, waiting (as get does) until all of them exist."""
        keys = [_bytes(k) for k in keys]
        if not keys:
            return []
        return self._call(b"MULTI_GET", [str(_ms(self._timeout)).encode()] + keys, self._timeout)

    def multi_set(self, keys, values) -> None:
        fields = []
        for k, v in zip(keys, values):
            fields += [_bytes(k), _bytes(v)]
        if fields:
            self._call(b"MULTI_SET", fields)

    def has_extended_api(self) -> bool:
        return True  # append, multi_get and multi_set are single requests

    def wait(self, keys, timeout: Optional[datetime.timedelta] = None) -> None:
        td = self._timeout if timeout is None else _as_timedelta(timeout)
        self._call(b"WAIT", [str(_ms(td)).encode()] + [_bytes(k) for k in keys], td)

    def check(self, keys) -> bool:
        return self._call(b"CHECK", [_bytes(k) for k in keys])[0] == b"1"

    def delete_key(self, key) -> bool:
        return self._call(b"DEL", [_bytes(key)])[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(b"NUMKEYS", [])[0])

    def close(self) -> None:
        """Close the pooled connections; later calls fail. See Note [Keeping SecretStore
        alive]: an open store is never garbage collected."""
        _state.process.open_stores.discard(self)
        self._client.close()


def connect(addr: str, port: int, secret: str, rank: int = -1, timeout=None):
    """Connect to the launcher's rendezvous store and return a `SecretStore`.

    `timeout` (a datetime.timedelta or seconds; default 300 s) bounds both reaching the server
    and every blocking get/wait. Raises RendezvousError when the server refuses the secret.
    This is what hvd.init() calls.
    """
    return SecretStore(addr, port, secret, rank=rank, timeout=timeout)
