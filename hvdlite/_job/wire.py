"""The rendezvous store's wire protocol and its client, as hvd.init() uses them.

The launcher (hvdlite.runner.rendezvous) hosts the server; every rank connects with the client
here, wrapped as a torch.distributed.Store by _runtime/store.py. No torch import.

Note [Rendezvous wire protocol]
Every message is a frame: a 4-byte big-endian length, then that many bytes holding a sequence of
fields, each a 4-byte big-endian length followed by its bytes.
  1. The server sends [MAGIC, nonce] with a fresh 32-byte random nonce per connection.
  2. The client answers [rank, HMAC-SHA256(secret, nonce + b"|" + rank)]; rank is decimal ASCII
     (-1 for a client that is not a rank). The secret itself never crosses the wire.
  3. The server compares the MAC with hmac.compare_digest. On a match it records the rank as
     arrived, then answers [b"OK"] (so a client holding its OK is already counted); otherwise
     it closes the connection without reading anything else. Frames before authentication are
     limited to a few hundred bytes, and the whole handshake to HANDSHAKE_DEADLINE seconds
     (Note [Bounded handshakes] in server.py).
  4. Requests are [op, args...]; replies are [b"OK", results...], [b"TIMEOUT", message] or
     [b"ERR", message]. Blocking ops (GET, WAIT) carry their timeout in milliseconds (0 = none);
     the server does the waiting, so the client needs no polling.
"""
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from typing import Iterable, List, Optional, Sequence

from ..exceptions import RendezvousError, RendezvousTimeout

MAGIC = b"HVDLITE-RDZV-1"
HANDSHAKE_TIMEOUT = 10.0  # the client's wait for each handshake frame
HANDSHAKE_DEADLINE = 5.0  # the server's limit on a connection's whole handshake
_MAX_HANDSHAKE_FRAME = 512
_MAX_FRAME = 1 << 30
_HANDSHAKE_TRIES = 3
_REPLY_TIMEOUT = 60.0  # a live server answers non-blocking ops at once
_LEN = struct.Struct(">I")


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


def encode_frame(fields: Sequence[bytes]) -> bytes:
    body = b"".join(_LEN.pack(len(f)) + f for f in fields)
    return _LEN.pack(len(body)) + body


def send_frame(sock: socket.socket, fields: Sequence[bytes]) -> None:
    sock.sendall(encode_frame(fields))


def parse_fields(body: bytes) -> List[bytes]:
    """The fields of one frame's body; ConnectionError when they do not fill it exactly."""
    fields, pos, size = [], 0, len(body)
    while pos < size:
        if pos + 4 > size:
            raise ConnectionError("malformed frame")
        (n,) = _LEN.unpack_from(body, pos)
        pos += 4
        if pos + n > size:
            raise ConnectionError("malformed frame")
        fields.append(bytes(body[pos:pos + n]))
        pos += n
    return fields


def recv_frame(sock: socket.socket, max_size: int = _MAX_FRAME) -> List[bytes]:
    (size,) = _LEN.unpack(_recv_exact(sock, 4))
    if size > max_size:
        raise ConnectionError(f"frame of {size} bytes exceeds the limit of {max_size}")
    return parse_fields(_recv_exact(sock, size))


# ---------------------------------------------------------------------------- server
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

    def _connect(self) -> socket.socket:
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
        return sock

    def _open(self) -> socket.socket:
        # A server under a flood of strangers may close a handshake to make room (Note [Bounded
        # handshakes] in server.py), which looks like a refusal; a few quick tries tell the two
        # apart without making a wrong secret slow to report.
        for attempt in range(_HANDSHAKE_TRIES):
            sock = self._connect()
            try:
                sock.settimeout(HANDSHAKE_TIMEOUT)
                hello = recv_frame(sock, max_size=_MAX_HANDSHAKE_FRAME)
                if len(hello) != 2 or hello[0] != MAGIC:
                    raise ConnectionError("not an hvdlite rendezvous server")
                rank_text = str(self.rank).encode()
                send_frame(sock, [rank_text, _mac(self._secret, hello[1], rank_text)])
                if recv_frame(sock, max_size=_MAX_HANDSHAKE_FRAME) != [b"OK"]:
                    raise ConnectionError("unexpected handshake reply")
                break
            except (OSError, ConnectionError) as exc:
                sock.close()
                if attempt + 1 < _HANDSHAKE_TRIES and "not an hvdlite" not in str(exc):
                    time.sleep(0.05 * (attempt + 1))
                    continue
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


