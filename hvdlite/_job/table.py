"""The rendezvous store's keys and what each operation does to them.

`KeyTable.handle` answers one request at once: a reply, or `Blocked` naming the keys a blocking
request (GET, WAIT, MULTI_GET) still waits for. The server (server.py) parks such a request and
asks again (`handle` once more) when one of those keys is written; `handle` reports every key a
request wrote, so the server knows whom to wake. One lock guards the keys, since the launcher
reads and writes them from its own threads (`put`, `peek`, `items_*`) while the server's loop
answers requests. Nothing here blocks or touches a socket.

Note [Store operations]
SET, GET, ADD, CAS, APPEND, WAIT, CHECK, DEL, NUMKEYS and KEYS are torch.distributed.Store's
operations with its semantics. MULTI_GET and MULTI_SET carry many keys in one request: a rank
that needs every rank's record reads them with one MULTI_GET (it waits until every key exists,
as GET does for one), so hvd.init() costs each rank a constant number of requests whatever the
job's size (docs/performance.md, Scale). Blocking operations carry their timeout in
milliseconds first (0: no limit).
"""
import threading
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union


class Blocked(NamedTuple):
    """A blocking request that waits for `missing` (keys not yet set) for `timeout_ms`."""
    missing: List[bytes]
    timeout_ms: int


Reply = List[bytes]
# What a request wrote (the keys whose waiters should be asked again) beside its outcome.
Outcome = Tuple[Union[Reply, Blocked], Sequence[bytes]]


class KeyTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: Dict[bytes, bytes] = {}

    # -- the launcher's own access (any thread)
    def put(self, key: bytes, value: bytes) -> None:
        with self._lock:
            self._data[key] = value

    def peek(self, key: bytes) -> Optional[bytes]:
        with self._lock:
            return self._data.get(key)

    def items_ending(self, suffix: bytes) -> Dict[bytes, bytes]:
        with self._lock:
            return {k: v for k, v in self._data.items() if k.endswith(suffix)}

    def items_starting(self, prefix: bytes) -> Dict[bytes, bytes]:
        with self._lock:
            return {k: v for k, v in self._data.items() if k.startswith(prefix)}

    def first_missing(self, keys: Sequence[bytes], start: int) -> int:
        """The index of the first of keys[start:] not set, or len(keys)."""
        with self._lock:
            data = self._data
            while start < len(keys) and keys[start] in data:
                start += 1
            return start

    # -- requests (Note [Store operations]); raises ValueError or TypeError on malformed args
    def handle(self, op: bytes, args: List[bytes]) -> Outcome:
        with self._lock:
            return self._handle(op, args)

    def _handle(self, op: bytes, args: List[bytes]) -> Outcome:
        data = self._data
        if op == b"SET":
            key, value = args
            data[key] = value
            return [b"OK"], (key,)
        if op == b"GET":
            key, timeout_ms = args
            if key not in data:
                return Blocked([key], int(timeout_ms)), ()
            return [b"OK", data[key]], ()
        if op in (b"WAIT", b"MULTI_GET"):  # the same wait; MULTI_GET answers the values too
            timeout_ms, keys = int(args[0]), args[1:]
            absent = [k for k in keys if k not in data]
            if absent:
                return Blocked(absent, timeout_ms), ()
            return [b"OK"] + ([data[k] for k in keys] if op == b"MULTI_GET" else []), ()
        if op == b"MULTI_SET":
            if len(args) % 2:
                raise ValueError("odd field count")
            written = args[0::2]
            for key, value in zip(written, args[1::2]):
                data[key] = value
            return [b"OK"], written
        if op == b"ADD":
            key, delta = args
            value = int(data.get(key, b"0")) + int(delta)
            data[key] = str(value).encode()
            return [b"OK", data[key]], (key,)
        if op == b"CAS":
            key, expected, desired = args
            current = data.get(key)
            # torch's semantics: a missing key matches an empty `expected`.
            if (current is None and expected == b"") or current == expected:
                data[key] = desired
                return [b"OK", desired], (key,)
            return [b"OK", expected if current is None else current], ()
        if op == b"APPEND":
            key, value = args
            data[key] = data.get(key, b"") + value
            return [b"OK"], (key,)
        if op == b"CHECK":
            return [b"OK", b"1" if all(k in data for k in args) else b"0"], ()
        if op == b"DEL":
            (key,) = args
            return [b"OK", b"1" if data.pop(key, None) is not None else b"0"], ()
        if op == b"NUMKEYS":
            return [b"OK", str(len(data)).encode()], ()
        if op == b"KEYS":
            return [b"OK"] + sorted(data), ()
        return [b"ERR", b"unknown operation " + op[:32]], ()


def timed_out(blocked: Blocked) -> Reply:
    """The reply to a blocking request whose time ran out."""
    return [b"TIMEOUT", b", ".join(blocked.missing)]

