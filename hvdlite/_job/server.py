"""The rendezvous store: a secret-protected key-value server hosted for the ranks of a job.

hvdliterun runs a `RendezvousServer` (runner/rendezvous.py re-exports this module), as does
hvdlite.ray's executor; every rank builds a `SecretStore` (a `torch.distributed.Store`,
hvdlite/_runtime/store.py) with `connect(...)` and hands it to torch.distributed. The wire protocol
and the client are in hvdlite/_job/wire.py (Note [Rendezvous wire protocol]), the keys and what
each operation does in table.py (Note [Store operations]); this module is the server. It has no
torch import, so the launcher itself starts fast.

Note [One loop serves the store]
One thread serves every connection, whatever the job's size: it accepts, carries every
handshake (Note [Bounded handshakes]) and answers every authenticated connection's requests
from one selector, so a thousand ranks cost a thousand sockets and no threads (a thread per
connection cost the launcher a thread per rank, and thousands of them at a thousand ranks). A
connection is read only up to the end of its current request, and not at all while its reply
is being sent or its request waits, so it holds at most one request and one reply. A blocking
request (GET, WAIT, MULTI_GET of keys not set yet) is parked on the first key it still misses;
a request that writes that key (or the launcher's own `set`, which wakes the loop through a
socket pair) moves it on to the next missing key, looking at each of its keys once however
they arrive (a thousand ranks each waiting for a thousand records cost a million looks, not a
billion), and asks it again once none is missing; its deadline, kept in a heap, answers TIMEOUT
naming the keys still missing. The key table has its own lock, so the launcher's threads read it directly.

Note [Bounded handshakes]
A listening port is open to anyone who can reach it, so what a stranger can make the server
hold is bounded: nothing is read from a connection beyond its handshake before it has proved it
knows the job's secret. The loop sends the nonce, collects the reply as it trickles in, and
verifies it. At most MAX_PENDING connections are in their handshake at once (a new one beyond
that closes the oldest), each has HANDSHAKE_DEADLINE seconds for all of it however slowly its
bytes come, a reply frame larger than _MAX_HANDSHAKE_FRAME or anything after it closes the
connection, and an accept that fails for want of file descriptors closes the oldest pending
connection and goes on. So strangers cost at most MAX_PENDING descriptors and no threads, and a
rank's connection, which answers at once, is never starved: at worst it retries (the client
does). Nothing a connection sends before its MAC matches is stored or answered.
"""
import collections
import errno
import heapq
import hmac
import itertools
import json
import os
import selectors
import socket
import threading
import time
from typing import Dict, List, Optional, Set

from . import keys
from .table import Blocked, KeyTable, timed_out
from .wakeup import Wakeup
from .wire import (  # noqa: F401  (re-exported for the launcher and tests)
    HANDSHAKE_DEADLINE, HANDSHAKE_TIMEOUT, MAGIC, _LEN, _MAX_FRAME, _MAX_HANDSHAKE_FRAME,
    RendezvousClient, RendezvousError, RendezvousTimeout, _mac, encode_frame, new_secret,
    parse_fields, recv_frame, send_frame)

MAX_PENDING = 64  # connections in their handshake at once (Note [Bounded handshakes])
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_READ_AT_ONCE = 1 << 20
_LISTENER, _WAKE = "listener", "wake"


class _Handshake:
    """One connection in its handshake: what it has sent so far, and its deadline."""

    def __init__(self, conn: socket.socket, nonce: bytes) -> None:
        self.conn, self.nonce = conn, nonce
        self.received = bytearray()
        self.deadline = time.monotonic() + HANDSHAKE_DEADLINE


class _Conn:
    """An authenticated connection (Note [One loop serves the store]): the bytes of its next
    request, the rest of its reply, and the request it has parked, if any."""

    def __init__(self, sock: socket.socket, rank: int) -> None:
        self.sock, self.rank = sock, rank
        self.inbox = bytearray()
        self.outbox = memoryview(b"")
        self.events = 0            # what the selector watches it for (0: not registered)
        self.parked: Optional[List[bytes]] = None  # the waiting request: [op, args...]
        self.parked_on: Optional[bytes] = None     # the key it waits for
        self.missing: List[bytes] = []             # the keys it lacked when it parked
        self.cursor = 0                            # missing[:cursor] have been set since
        self.ticket = 0            # which park its deadline's heap entry belongs to


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


class RendezvousServer:
    """Hosts the job's key-value store on (`host`, `port`), admitting only holders of `secret`.

    `host` is the address to bind: 127.0.0.1 when every rank is local, an interface address, or
    0.0.0.0 when remote ranks reach it. `addr` is what ranks should connect to (defaults to
    `host`). Port 0 picks a free port; read it from `.port` after start(). One thread serves
    everything (Note [One loop serves the store]).
    """

    def __init__(self, secret: str, host: str = "127.0.0.1", port: int = 0,
                 addr: Optional[str] = None) -> None:
        self.secret = secret
        self.host = host
        self.addr = addr or host
        self.port = port
        self._table = KeyTable()
        self._listener: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._selector = selectors.DefaultSelector()
        self._wakeup = Wakeup()  # the launcher's set() wakes the loop
        self._state_lock = threading.Lock()
        self._arrived: Dict[int, float] = {}
        self._refused = 0
        self._requests: Dict[int, int] = collections.Counter()  # by rank (-1: not a rank)
        self._written: List[bytes] = []  # keys the launcher set, for the loop to wake on
        self._stopping = threading.Event()
        # the loop's own state
        self._conns: Set[_Conn] = set()
        self._waiters: Dict[bytes, List[_Conn]] = {}
        self._deadlines: list = []
        self._tickets = itertools.count(1)

    # -- lifecycle
    def start(self) -> "RendezvousServer":
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(1024)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._selector.register(listener, selectors.EVENT_READ, _LISTENER)
        self._selector.register(self._wakeup, selectors.EVENT_READ, _WAKE)
        self._thread = threading.Thread(target=self._loop, name="hvdlite-rdzv", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._wakeup.wake()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

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
        with self._state_lock:
            self._written.append(key.encode())
        self._wakeup.wake()

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

    def requests_by_rank(self) -> Dict[int, int]:
        """Requests answered so far, by the rank that sent them (-1: not a rank); for tests
        and the scale bench."""
        with self._state_lock:
            return dict(self._requests)

    # -- the loop (Note [One loop serves the store])
    def _loop(self) -> None:
        pending: "collections.OrderedDict[socket.socket, _Handshake]" = collections.OrderedDict()
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                soonest = [0.25] + [h.deadline - now for h in pending.values()]
                if self._deadlines:
                    soonest.append(self._deadlines[0][0] - now)
                for key, events in self._selector.select(timeout=max(0.0, min(soonest))):
                    what = key.data
                    if what == _LISTENER:
                        self._accept_all(pending)
                    elif what == _WAKE:
                        self._woken()
                    elif isinstance(what, _Handshake):
                        self._read_handshake(pending, what)
                    elif what in self._conns:
                        try:
                            if events & selectors.EVENT_WRITE:
                                self._flush(what)
                            elif events & selectors.EVENT_READ:
                                self._read(what)
                        except Exception:  # noqa: BLE001 - one bad connection must not stop the store
                            self._close(what)
                now = time.monotonic()
                for handshake in [h for h in pending.values() if h.deadline <= now]:
                    self._drop(pending, handshake)
                self._expire(now)
        except (OSError, ValueError):
            pass  # the selector or the listener was closed under the loop: it is stopping
        finally:
            for handshake in list(pending.values()):
                self._drop(pending, handshake, refused=False)
            for conn in list(self._conns):
                if conn.parked is not None:  # best effort: the client may be gone
                    try:
                        conn.sock.send(encode_frame([b"ERR", b"rendezvous server is shutting down"]))
                    except OSError:
                        pass
                self._close(conn)
            if self._listener is not None:
                self._listener.close()
            self._wakeup.close()
            self._selector.close()

    def _accept_all(self, pending) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS and pending:
                    self._drop(pending, next(iter(pending.values())))
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
                self._drop(pending, next(iter(pending.values())))
            handshake = _Handshake(conn, nonce)
            pending[conn] = handshake
            self._selector.register(conn, selectors.EVENT_READ, handshake)

    def _read_handshake(self, pending, handshake) -> None:
        try:
            data = handshake.conn.recv(_MAX_HANDSHAKE_FRAME + 8)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(pending, handshake)
            return
        handshake.received += data
        got = handshake.received
        if len(got) < 4:
            return
        (size,) = _LEN.unpack_from(got, 0)
        if size > _MAX_HANDSHAKE_FRAME or len(got) > 4 + size:  # oversized, or more than one frame
            self._drop(pending, handshake)
            return
        if len(got) < 4 + size:
            return
        rank = self._verify(handshake.nonce, bytes(got[4:]))
        if rank is None:
            self._drop(pending, handshake)
            return
        self._selector.unregister(handshake.conn)
        del pending[handshake.conn]
        conn = _Conn(handshake.conn, rank)
        self._conns.add(conn)
        if rank >= 0:  # counted before the OK: Note [Rendezvous wire protocol], step 3
            with self._state_lock:
                self._arrived.setdefault(rank, time.monotonic())
        self._send(conn, [b"OK"])

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

    def _drop(self, pending, handshake, refused=True) -> None:
        pending.pop(handshake.conn, None)
        try:
            self._selector.unregister(handshake.conn)
        except (KeyError, ValueError):
            pass
        if refused:  # counted before the close that the client sees
            with self._state_lock:
                self._refused += 1
        handshake.conn.close()

    # -- authenticated connections
    def _watch(self, conn: _Conn, events: int) -> None:
        if events == conn.events:
            return
        if conn.events == 0:
            self._selector.register(conn.sock, events, conn)
        elif events == 0:
            self._selector.unregister(conn.sock)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    def _close(self, conn: _Conn) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        self._unpark(conn)
        self._watch(conn, 0)
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        """Reads no further than the end of the current request (Note [One loop serves the
        store])."""
        have = len(conn.inbox)
        want = 4 - have if have < 4 else 4 + _LEN.unpack_from(conn.inbox, 0)[0] - have
        try:
            data = conn.sock.recv(min(want, _READ_AT_ONCE))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.inbox += data
        if len(conn.inbox) < 4:
            return
        (size,) = _LEN.unpack_from(conn.inbox, 0)
        if size > _MAX_FRAME:
            self._close(conn)
            return
        if len(conn.inbox) < 4 + size:
            return
        body = bytes(conn.inbox[4:])
        conn.inbox = bytearray()
        try:
            request = parse_fields(body)
        except ConnectionError:
            self._close(conn)
            return
        with self._state_lock:
            self._requests[conn.rank] += 1
        if not request:
            self._send(conn, [b"ERR", b"empty request"])
            return
        self._answer(conn, request, first=True)

    def _answer(self, conn: _Conn, request: List[bytes], first: bool) -> None:
        """Answers `request`, or parks it until a key it waits for is written."""
        op = request[0]
        try:
            outcome, written = self._table.handle(op, request[1:])
        except (ValueError, TypeError):
            outcome, written = [b"ERR", b"malformed arguments for " + op[:32]], ()
        if isinstance(outcome, Blocked):
            self._park(conn, request, outcome, first)
        else:
            self._send(conn, outcome)
        for key in written:
            self._written_key(key)

    def _park(self, conn: _Conn, request: List[bytes], blocked: Blocked, first: bool) -> None:
        if first:  # a request parked again keeps its first deadline
            conn.ticket = next(self._tickets)
            if blocked.timeout_ms > 0:
                deadline = time.monotonic() + blocked.timeout_ms / 1000.0
                heapq.heappush(self._deadlines, (deadline, conn.ticket, conn))
        conn.parked, conn.missing, conn.cursor = request, blocked.missing, 0
        self._wait_for_next(conn)
        self._watch(conn, 0)

    def _wait_for_next(self, conn: _Conn) -> None:
        conn.parked_on = conn.missing[conn.cursor]
        self._waiters.setdefault(conn.parked_on, []).append(conn)

    def _unpark(self, conn: _Conn) -> Optional[List[bytes]]:
        request, key = conn.parked, conn.parked_on
        conn.parked = conn.parked_on = None
        conn.missing = []
        if key is not None:
            waiting = self._waiters.get(key, [])
            if conn in waiting:
                waiting.remove(conn)
            if not waiting:
                self._waiters.pop(key, None)
        return request

    def _written_key(self, key: bytes) -> None:
        for conn in self._waiters.pop(key, []):
            conn.parked_on = None  # already off the list
            if conn.parked is None or conn not in self._conns:
                continue
            conn.cursor = self._table.first_missing(conn.missing, conn.cursor + 1)
            if conn.cursor < len(conn.missing):
                self._wait_for_next(conn)
                continue
            request = self._unpark(conn)
            self._answer(conn, request, first=False)  # parks again if a key went meanwhile

    def _woken(self) -> None:
        self._wakeup.drain()
        with self._state_lock:
            written, self._written = self._written, []
        for key in written:
            self._written_key(key)

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, ticket, conn = heapq.heappop(self._deadlines)
            if conn.ticket != ticket or conn.parked is None or conn not in self._conns:
                continue  # answered since, or gone
            request = self._unpark(conn)
            outcome, _ = self._table.handle(request[0], request[1:])
            self._send(conn, timed_out(outcome) if isinstance(outcome, Blocked) else outcome)

    def _send(self, conn: _Conn, fields: List[bytes]) -> None:
        conn.outbox = memoryview(encode_frame(fields))
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            while conn.outbox:
                sent = conn.sock.send(conn.outbox)
                conn.outbox = conn.outbox[sent:]
        except (BlockingIOError, InterruptedError):
            self._watch(conn, selectors.EVENT_WRITE)
            return
        except OSError:
            self._close(conn)
            return
        self._watch(conn, selectors.EVENT_READ)
