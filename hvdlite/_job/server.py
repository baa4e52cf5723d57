"""The rendezvous store: a secret-protected key-value server hosted for the ranks of a job.

hvdliterun runs a `RendezvousServer` (runner/rendezvous.py re-exports this module), as does
hvdlite.ray's executor; every rank builds a `SecretStore` (a `torch.distributed.Store`,
hvdlite/_runtime/store.py) with `connect(...)` and hands it to torch.distributed. The wire protocol
and the client are in hvdlite/_job/wire.py (Note [Rendezvous wire protocol]); this
module is the server. It has no torch import, so the launcher itself starts fast.

Threads: one thread accepts connections and carries every handshake (Note [Bounded
handshakes]); each authenticated connection then gets a thread of its own. They share the key
table under one Condition (`_lock`), which blocking `get`/`wait` requests wait on. The client
(`RendezvousClient`) keeps a small pool of authenticated connections, so one thread blocked in
`get` never stops another thread of the same process from `set`-ting the key it waits for.

Note [Bounded handshakes]
A listening port is open to anyone who can reach it, so what a stranger can make the server
hold is bounded: no thread is started before a connection has proved it knows the job's
secret. The accepting thread owns every connection still in its handshake, non-blocking, in
one selector: it sends the nonce, collects the reply as it trickles in, and verifies it. At most
MAX_PENDING connections are in their handshake at once (a new one beyond that closes the
oldest), each has HANDSHAKE_DEADLINE seconds for all of it however slowly its bytes come, a
reply frame larger than _MAX_HANDSHAKE_FRAME or anything after it closes the connection, and
an accept that fails for want of file descriptors closes the oldest pending connection and
goes on. So strangers cost at most MAX_PENDING descriptors and no threads, and a rank's
connection, which answers at once, is never starved: at worst it retries (the client does).
Nothing a connection sends before its MAC matches is stored or answered.
"""
import collections
import errno
import hmac
import json
import os
import selectors
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence, Set

from . import keys
from .wire import (  # noqa: F401  (re-exported for the launcher and tests)
    HANDSHAKE_DEADLINE, HANDSHAKE_TIMEOUT, MAGIC, _LEN, _MAX_HANDSHAKE_FRAME, RendezvousClient,
    RendezvousError, RendezvousTimeout, _mac, encode_frame, new_secret, parse_fields, recv_frame,
    send_frame)

MAX_PENDING = 64  # connections in their handshake at once (Note [Bounded handshakes])
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class _Handshake:
    """One connection in its handshake: what it has sent so far, and its deadline."""

    def __init__(self, conn: socket.socket, nonce: bytes) -> None:
        self.conn, self.nonce = conn, nonce
        self.received = bytearray()
        self.deadline = time.monotonic() + HANDSHAKE_DEADLINE


def _by_rank(values) -> Dict[int, dict]:
    """JSON records that name their rank, by rank; malformed ones are skipped."""
    records = {}
    for value in values:
        try:
            record = json.loads(value)
            records[int(record["rank"])] = record
        except (ValueError, KeyError, TypeError):
            continue
    return records


def connect(addr, port, secret, rank=-1, timeout=None):
    """hvdlite._runtime.store.connect (imports torch only when called)."""
    from hvdlite._runtime.store import connect as connect_store
    return connect_store(addr, port, secret, rank=rank, timeout=timeout)


class _KeyTable:
    """The store's state and the semantics of each operation; callers hold no locks."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._data: Dict[bytes, bytes] = {}
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def _wait_for(self, keys: Sequence[bytes], timeout_ms: int) -> bool:
        # Called with _lock held.
        deadline = None if timeout_ms <= 0 else time.monotonic() + timeout_ms / 1000.0
        while not all(k in self._data for k in keys):
            if self._closed:
                raise RendezvousError("rendezvous server is shutting down")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._lock.wait(timeout=remaining if remaining is not None else 1.0)
        return True

    def items_ending(self, suffix: bytes) -> Dict[bytes, bytes]:
        with self._lock:
            return {k: v for k, v in self._data.items() if k.endswith(suffix)}

    def items_starting(self, prefix: bytes) -> Dict[bytes, bytes]:
        with self._lock:
            return {k: v for k, v in self._data.items() if k.startswith(prefix)}

    def put(self, key: bytes, value: bytes) -> None:
        with self._lock:
            self._data[key] = value
            self._lock.notify_all()

    def peek(self, key: bytes) -> Optional[bytes]:
        with self._lock:
            return self._data.get(key)

    def handle(self, op: bytes, args: List[bytes]) -> List[bytes]:
        with self._lock:
            if op == b"SET":
                key, value = args
                self._data[key] = value
                self._lock.notify_all()
                return [b"OK"]
            if op == b"GET":
                key, timeout_ms = args
                if not self._wait_for([key], int(timeout_ms)):
                    return [b"TIMEOUT", key]
                return [b"OK", self._data[key]]
            if op == b"ADD":
                key, delta = args
                value = int(self._data.get(key, b"0")) + int(delta)
                self._data[key] = str(value).encode()
                self._lock.notify_all()
                return [b"OK", self._data[key]]
            if op == b"CAS":
                key, expected, desired = args
                current = self._data.get(key)
                # torch's semantics: a missing key matches an empty `expected`.
                if (current is None and expected == b"") or current == expected:
                    self._data[key] = desired
                    self._lock.notify_all()
                    return [b"OK", desired]
                return [b"OK", expected if current is None else current]
            if op == b"APPEND":
                key, value = args
                self._data[key] = self._data.get(key, b"") + value
                self._lock.notify_all()
                return [b"OK"]
            if op == b"WAIT":
                timeout_ms, keys = args[0], args[1:]
                if not self._wait_for(keys, int(timeout_ms)):
                    missing = [k for k in keys if k not in self._data]
                    return [b"TIMEOUT", b", ".join(missing)]
                return [b"OK"]
            if op == b"CHECK":
                return [b"OK", b"1" if all(k in self._data for k in args) else b"0"]
            if op == b"DEL":
                (key,) = args
                existed = self._data.pop(key, None) is not None
                return [b"OK", b"1" if existed else b"0"]
            if op == b"NUMKEYS":
                return [b"OK", str(len(self._data)).encode()]
            if op == b"KEYS":
                return [b"OK"] + sorted(self._data)
        return [b"ERR", b"unknown operation " + op[:32]]


class RendezvousServer:
    """Hosts the job's key-value store on (`host`, `port`), admitting only holders of `secret`.

    `host` is the address to bind: 127.0.0.1 when every rank is local, an interface address, or
    0.0.0.0 when remote ranks reach it. `addr` is what ranks should connect to (defaults to
    `host`). Port 0 picks a free port; read it from `.port` after start().
    """

    def __init__(self, secret: str, host: str = "127.0.0.1", port: int = 0,
                 addr: Optional[str] = None) -> None:
        self.secret = secret
        self.host = host
        self.addr = addr or host
        self.port = port
        self._table = _KeyTable()
        self._listener: Optional[socket.socket] = None
        self._threads: List[threading.Thread] = []
        self._conns: Set[socket.socket] = set()
        self._state_lock = threading.Lock()
        self._arrived: Dict[int, float] = {}
        self._refused = 0
        self._stopping = threading.Event()

    # -- lifecycle
    def start(self) -> "RendezvousServer":
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(128)
        listener.settimeout(0.25)  # lets the accept loop notice stop()
        self._listener = listener
        self.port = listener.getsockname()[1]
        thread = threading.Thread(target=self._accept_loop, name="hvdlite-rdzv-accept",
                                  daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._table.close()
        if self._listener is not None:
            self._listener.close()
        with self._state_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(timeout=2.0)

    def __enter__(self) -> "RendezvousServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what the launcher asks
    def arrived_ranks(self) -> Set[int]:
        """Ranks that have authenticated at least once."""
        with self._state_lock:
            return set(self._arrived)

    def lost_contact(self, rank: int) -> Optional[dict]:
        """What `rank` published before failing when it lost contact with peers (Note [Failure
        census] in hvdlite/_runtime/liveness.py): {"text": ..., "ranks": [...]}, newest generation
        first; None if nothing."""
        found = self._table.items_ending(f"/lost/{rank}".encode())
        if not found:
            return None
        newest = max(found, key=lambda k: int(k.split(b"/")[1]) if k.split(b"/")[1].isdigit() else -1)
        try:
            return json.loads(found[newest])
        except ValueError:
            return None

    # The launcher's own access to the store (no connection, no wire opcodes): keys.py's keys.
    def set(self, key: str, value: bytes) -> None:
        """Stores `value` under `key`, waking the ranks that wait for it."""
        self._table.put(key.encode(), value)

    def get(self, key: str) -> Optional[bytes]:
        """The value under `key`, or None when nobody has set it (never waits)."""
        return self._table.peek(key.encode())

    def records_under(self, prefix: str) -> Dict[int, dict]:
        """The JSON records (each with its "rank") stored under `prefix`, by rank (never waits)."""
        return _by_rank(self._table.items_starting(prefix.encode()).values())

    def failure_records(self) -> Dict[int, dict]:
        """Every rank's failure report (Note [Failure reports] in hvdlite/_runtime/failure.py)."""
        return _by_rank(value for key, value in self._table.items_ending(b"").items()
                        if keys.is_failure(key.decode(errors="replace")))

    def rank_host(self, rank: int) -> Optional[str]:
        """The host name `rank` published at hvd.init() (hvdlite/_runtime/liveness.py), if any."""
        found = self._table.items_ending(f"/{keys.proc(rank)}".encode())
        for _, value in sorted(found.items(), reverse=True):
            try:
                return json.loads(value).get("host")
            except ValueError:
                continue
        return None

    @property
    def refused_connections(self) -> int:
        with self._state_lock:
            return self._refused

    # -- threads
    def _accept_loop(self) -> None:
        """Note [Bounded handshakes]: accepts, and carries every handshake, on one thread."""
        selector = selectors.DefaultSelector()
        self._listener.setblocking(False)
        selector.register(self._listener, selectors.EVENT_READ)
        pending: "collections.OrderedDict[socket.socket, _Handshake]" = collections.OrderedDict()
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                wait = min([0.25] + [max(0.0, h.deadline - now) for h in pending.values()])
                for key, _ in selector.select(timeout=wait):
                    if key.fileobj is self._listener:
                        self._accept_all(selector, pending)
                    elif key.fileobj in pending:
                        self._read_handshake(selector, pending, pending[key.fileobj])
                now = time.monotonic()
                for handshake in [h for h in pending.values() if h.deadline <= now]:
                    self._drop(selector, pending, handshake)
        except (OSError, ValueError):
            pass  # the listener was closed by stop()
        finally:
            for handshake in list(pending.values()):
                self._drop(selector, pending, handshake, refused=False)
            selector.close()

    def _accept_all(self, selector, pending) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS and pending:
                    self._drop(selector, pending, next(iter(pending.values())))
                    continue
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    time.sleep(0.05)  # nothing of ours to free: let the system recover
                    return
                raise
            nonce = os.urandom(32)
            try:
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.send(encode_frame([MAGIC, nonce]))  # a few dozen bytes: fits the send buffer
            except OSError:
                conn.close()
                continue
            if len(pending) >= MAX_PENDING:
                self._drop(selector, pending, next(iter(pending.values())))
            handshake = _Handshake(conn, nonce)
            pending[conn] = handshake
            selector.register(conn, selectors.EVENT_READ)

    def _read_handshake(self, selector, pending, handshake) -> None:
        try:
            data = handshake.conn.recv(_MAX_HANDSHAKE_FRAME + 8)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(selector, pending, handshake)
            return
        handshake.received += data
        got = handshake.received
        if len(got) < 4:
            return
        (size,) = _LEN.unpack_from(got, 0)
        if size > _MAX_HANDSHAKE_FRAME or len(got) > 4 + size:  # oversized, or more than one frame
            self._drop(selector, pending, handshake)
            return
        if len(got) < 4 + size:
            return
        rank = self._verify(handshake.nonce, bytes(got[4:]))
        if rank is None:
            self._drop(selector, pending, handshake)
            return
        selector.unregister(handshake.conn)
        del pending[handshake.conn]
        conn = handshake.conn
        conn.setblocking(True)
        thread = threading.Thread(target=self._serve, args=(conn, rank), name="hvdlite-rdzv-conn", daemon=True)
        with self._state_lock:
            self._conns.add(conn)
        thread.start()

    def _verify(self, nonce: bytes, body: bytes) -> Optional[int]:
        """The rank the reply proves it may join as, or None."""
        try:
            reply = parse_fields(body)
            if len(reply) != 2:
                return None
            rank_text, mac = reply
            if not hmac.compare_digest(mac, _mac(self.secret, nonce, rank_text)):
                return None
            return int(rank_text)
        except (ValueError, ConnectionError):
            return None

    def _drop(self, selector, pending, handshake, refused=True) -> None:
        pending.pop(handshake.conn, None)
        try:
            selector.unregister(handshake.conn)
        except (KeyError, ValueError):
            pass
        if refused:  # counted before the close that the client sees
            with self._state_lock:
                self._refused += 1
        handshake.conn.close()

    def _serve(self, conn: socket.socket, rank: int) -> None:
        try:
            if rank >= 0:  # counted before the OK: Note [Rendezvous wire protocol], step 3
                with self._state_lock:
                    self._arrived.setdefault(rank, time.monotonic())
            try:
                send_frame(conn, [b"OK"])
            except (OSError, ConnectionError):
                return
            conn.settimeout(None)
            while not self._stopping.is_set():
                try:
                    request = recv_frame(conn)
                except (OSError, ConnectionError):
                    return
                if not request:
                    send_frame(conn, [b"ERR", b"empty request"])
                    continue
                try:
                    reply = self._table.handle(request[0], request[1:])
                except RendezvousError as exc:
                    reply = [b"ERR", str(exc).encode()]
                except (ValueError, TypeError):
                    reply = [b"ERR", b"malformed arguments for " + request[0][:32]]
                send_frame(conn, reply)
        except OSError:
            return
        finally:
            with self._state_lock:
                self._conns.discard(conn)
            conn.close()


