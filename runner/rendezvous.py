"""The rendezvous store: a secret-protected key-value server the launcher hosts for its ranks.

The launcher runs a `RendezvousServer`; every rank builds a `SecretStore` (a
`torch.distributed.Store`, see store.py) with `connect(...)` and hands it to torch.distributed.
This module has no torch import, so the launcher itself starts fast.

Threads: the server has one accepting thread plus one thread per client connection; they share
the key table under one Condition (`_lock`), which blocking `get`/`wait` requests wait on. The
client (`RendezvousClient`) keeps a small pool of authenticated connections, so one thread
blocked in `get` never stops another thread of the same process from `set`-ting the key it waits
for.

Note [Rendezvous wire protocol]
Every message is a frame: a 4-byte big-endian length, then that many bytes holding a sequence of
fields, each a 4-byte big-endian length followed by its bytes.
  1. The server sends [MAGIC, nonce] with a fresh 32-byte random nonce per connection.
  2. The client answers [rank, HMAC-SHA256(secret, nonce + b"|" + rank)]; rank is decimal ASCII
     (-1 for a client that is not a rank). The secret itself never crosses the wire.
  3. The server compares the MAC with hmac.compare_digest. On a match it records the rank as
     arrived, then answers [b"OK"] (so a client holding its OK is already counted); otherwise
     it closes the connection without reading anything else. Frames before authentication are
     limited to a few hundred bytes, and the handshake to HANDSHAKE_TIMEOUT seconds.
  4. Requests are [op, args...]; replies are [b"OK", results...], [b"TIMEOUT", message] or
     [b"ERR", message]. Blocking ops (GET, WAIT) carry their timeout in milliseconds (0 = none);
     the server does the waiting, so the client needs no polling.
"""
import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
import time
from typing import Dict, Iterable, List, Optional, Sequence, Set

MAGIC = b"HVDLITE-RDZV-1"
HANDSHAKE_TIMEOUT = 10.0
_MAX_HANDSHAKE_FRAME = 512
_MAX_FRAME = 1 << 30
_REPLY_TIMEOUT = 60.0  # a live server answers non-blocking ops at once
_LEN = struct.Struct(">I")


class RendezvousError(RuntimeError):
    """The rendezvous store refused the client, lost the connection or reported an error."""


class RendezvousTimeout(RendezvousError):
    """A blocking get/wait did not see its keys within the timeout."""


def new_secret() -> str:
    """A fresh per-job secret as hex; only the launched ranks receive it."""
    return secrets.token_hex(32)


def _mac(secret: str, nonce: bytes, rank: bytes) -> bytes:
    return hmac.new(secret.encode(), nonce + b"|" + rank, hashlib.sha256).digest()


# ---------------------------------------------------------------------------- framing
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def send_frame(sock: socket.socket, fields: Sequence[bytes]) -> None:
    body = b"".join(_LEN.pack(len(f)) + f for f in fields)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_frame(sock: socket.socket, max_size: int = _MAX_FRAME) -> List[bytes]:
    (size,) = _LEN.unpack(_recv_exact(sock, 4))
    if size > max_size:
        raise ConnectionError(f"frame of {size} bytes exceeds the limit of {max_size}")
    body = _recv_exact(sock, size)
    fields, pos = [], 0
    while pos < size:
        if pos + 4 > size:
            raise ConnectionError("malformed frame")
        (n,) = _LEN.unpack_from(body, pos)
        pos += 4
        if pos + n > size:
            raise ConnectionError("malformed frame")
        fields.append(body[pos:pos + n])
        pos += n
    return fields


# ---------------------------------------------------------------------------- server
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


# ---------------------------------------------------------------------------- client
class RendezvousClient:
    """A torch-free, thread-safe client: a pool of authenticated connections.

    Each call borrows an idle connection (or opens and authenticates a new one), so concurrent
    threads never share a socket and a blocking get never holds up a set from another thread.
    """

    def __init__(self, addr: str, port: int, secret: str, rank: int = -1,
                 connect_timeout: float = 60.0) -> None:
        self.addr, self.port, self.rank = addr, int(port), int(rank)
        self._secret = secret
        self._connect_timeout = connect_timeout
        self._idle: List[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._release(self._open())  # fail now, not at the first operation

    def _open(self) -> socket.socket:
        deadline = time.monotonic() + self._connect_timeout
        while True:
            try:
                sock = socket.create_connection((self.addr, self.port), timeout=10.0)
                break
            except (ConnectionRefusedError, socket.timeout, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise RendezvousError(
                        f"cannot reach the rendezvous store at {self.addr}:{self.port} "
                        f"within {self._connect_timeout:.0f} s: {exc}") from None
                time.sleep(0.1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            hello = recv_frame(sock, max_size=_MAX_HANDSHAKE_FRAME)
            if len(hello) != 2 or hello[0] != MAGIC:
                raise ConnectionError("not an hvdlite rendezvous server")
            rank_text = str(self.rank).encode()
            send_frame(sock, [rank_text, _mac(self._secret, hello[1], rank_text)])
            if recv_frame(sock, max_size=_MAX_HANDSHAKE_FRAME) != [b"OK"]:
                raise ConnectionError("unexpected handshake reply")
        except (OSError, ConnectionError) as exc:
            sock.close()
            raise RendezvousError(
                f"the rendezvous store at {self.addr}:{self.port} refused rank {self.rank} "
                f"({exc}); is HVDLITE_RENDEZVOUS_SECRET the one this job's launcher set?"
            ) from None
        sock.settimeout(None)
        return sock

    def _acquire(self) -> socket.socket:
        with self._lock:
            if self._closed:
                raise RendezvousError("rendezvous client is closed")
            if self._idle:
                return self._idle.pop()
        return self._open()

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < 8:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def call(self, op: bytes, args: Iterable[bytes],
             timeout_ms: Optional[int] = None) -> List[bytes]:
        """Send one request and return the result fields; raises on TIMEOUT/ERR.

        `timeout_ms` is the server-side wait of a blocking op (0 = forever); None means the op
        does not block.
        """
        sock = self._acquire()
        try:
            # The server enforces timeout_ms; the socket timeout only guards a dead server.
            if timeout_ms is None:
                sock.settimeout(_REPLY_TIMEOUT)
            else:
                sock.settimeout(None if timeout_ms <= 0 else timeout_ms / 1000.0 + _REPLY_TIMEOUT)
            send_frame(sock, [op, *args])
            reply = recv_frame(sock)
        except (OSError, ConnectionError) as exc:
            sock.close()
            raise RendezvousError(
                f"lost the connection to the rendezvous store at {self.addr}:{self.port} "
                f"during {op.decode()}: {exc}") from None
        self._release(sock)
        status, rest = reply[0], reply[1:]
        if status == b"OK":
            return rest
        message = rest[0].decode(errors="replace") if rest else ""
        if status == b"TIMEOUT":
            raise RendezvousTimeout(
                f"rendezvous store: timed out after {(timeout_ms or 0) / 1000.0:g} s waiting for "
                f"key(s) {message}")
        raise RendezvousError(f"rendezvous store: {op.decode()} failed: {message}")


def connect(addr: str, port: int, secret: str, rank: int = -1, timeout=None):
    """Connect to the launcher's rendezvous store and return a `SecretStore`.

    `timeout` (a datetime.timedelta or seconds; default 300 s) bounds both reaching the server
    and every blocking get/wait. Raises RendezvousError when the server refuses the secret.
    This is what hvd.init() calls; it imports torch.
    """
    from .store import SecretStore
    return SecretStore(addr, port, secret, rank=rank, timeout=timeout)


def connect_from_environ(environ=None, timeout=None):
    """`connect` with the HVDLITE_RENDEZVOUS_* and HVDLITE_RANK variables the launcher set.

    Returns None when HVDLITE_RENDEZVOUS_ADDR is not set (not started by hvdliterun).
    """
    env = os.environ if environ is None else environ
    if not env.get("HVDLITE_RENDEZVOUS_ADDR"):
        return None
    names = ("HVDLITE_RENDEZVOUS_PORT", "HVDLITE_RENDEZVOUS_SECRET", "HVDLITE_RANK")
    missing = [n for n in names if not env.get(n)]
    if missing:
        raise RendezvousError(
            "HVDLITE_RENDEZVOUS_ADDR is set but " + ", ".join(missing) + " is not")
    try:
        port, rank = int(env["HVDLITE_RENDEZVOUS_PORT"]), int(env["HVDLITE_RANK"])
    except ValueError:
        raise RendezvousError(
            f"HVDLITE_RENDEZVOUS_PORT={env['HVDLITE_RENDEZVOUS_PORT']!r} and "
            f"HVDLITE_RANK={env['HVDLITE_RANK']!r} must be whole numbers") from None
    return connect(env["HVDLITE_RENDEZVOUS_ADDR"], port, env["HVDLITE_RENDEZVOUS_SECRET"],
                   rank=rank, timeout=timeout)


def __getattr__(name: str):
    # SecretStore subclasses torch.distributed.Store; import torch only when someone asks.
    if name == "SecretStore":
        from .store import SecretStore
        return SecretStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

