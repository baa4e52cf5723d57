"""The rendezvous store: a secret-protected key-value server hosted for the ranks of a job.

hvdliterun runs a `RendezvousServer` (runner/rendezvous.py re-exports this module), as does
hvdlite.ray's executor; every rank builds a `SecretStore` (a `torch.distributed.Store`,
hvdlite/_runtime/store.py) with `connect(...)` and hands it to torch.distributed. The wire protocol
and the client are in hvdlite/_job/wire.py (Note [Rendezvous wire protocol]); this
module is the server. It has no torch import, so the launcher itself starts fast.

Threads: the server has one accepting thread plus one thread per client connection; they share
the key table under one Condition (`_lock`), which blocking `get`/`wait` requests wait on. The
client (`RendezvousClient`) keeps a small pool of authenticated connections, so one thread
blocked in `get` never stops another thread of the same process from `set`-ting the key it waits
for.
"""
import hmac
import json
import os
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence, Set

from . import keys
from .wire import (  # noqa: F401  (re-exported for the launcher and tests)
    HANDSHAKE_TIMEOUT, MAGIC, _MAX_HANDSHAKE_FRAME, RendezvousClient, RendezvousError,
    RendezvousTimeout, _mac, new_secret, recv_frame, send_frame)


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

    def failure_records(self) -> Dict[int, dict]:
        """Every rank's failure report (Note [Failure reports] in hvdlite/_runtime/failure.py)."""
        records = {}
        for key, value in self._table.items_ending(b"").items():
            if keys.is_failure(key.decode(errors="replace")):
                try:
                    record = json.loads(value)
                    records[int(record["rank"])] = record
                except (ValueError, KeyError, TypeError):
                    continue
        return records

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
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(target=self._serve, args=(conn,),
                                      name="hvdlite-rdzv-conn", daemon=True)
            thread.start()

    def _authenticate(self, conn: socket.socket) -> Optional[int]:
        """The rank the client proved it may join as, or None; the caller sends the OK."""
        conn.settimeout(HANDSHAKE_TIMEOUT)
        nonce = os.urandom(32)
        try:
            send_frame(conn, [MAGIC, nonce])
            reply = recv_frame(conn, max_size=_MAX_HANDSHAKE_FRAME)
            if len(reply) != 2:
                return None
            rank_text, mac = reply
            if not hmac.compare_digest(mac, _mac(self.secret, nonce, rank_text)):
                return None
            return int(rank_text)
        except (OSError, ValueError, ConnectionError):
            return None

    def _serve(self, conn: socket.socket) -> None:
        with self._state_lock:
            self._conns.add(conn)
        try:
            rank = self._authenticate(conn)
            if rank is None:
                with self._state_lock:
                    self._refused += 1
                return
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


