"""The task that network discovery runs on every host of a job (python -m hvdlite.runner.task_service).

Note [Network discovery]
Before ranks start on more than one host, the launcher (the driver, discovery.py) starts this
task on every host, over the same ssh as the ranks (locally for its own host), with the job's
secret. The task
  1. lists its host's interfaces and IPv4 addresses (loopback left out);
  2. tries every address the driver listed for itself, and talks to the driver's rendezvous
     store through the first it reaches, reporting which ones it reached;
  3. listens on one port on every address and publishes its interfaces and that port;
  4. once its ring neighbours have published (the hosts before and after it in the job's host
     order: `neighbours`), probes them on every address they listed: a TCP connection, then a
     challenge with the prober's own proof (an HMAC of the job's secret), which the peer
     answers with an HMAC of the secret, the challenge and its own index, so a reply from some
     other program on that address does not count, and a stranger's challenge gets no answer
     at all;
  5. publishes what it reached, keeps answering probes until the driver says done, and exits.
The driver keeps the interface names through which every host reached its neighbours, both
ways round the ring. Probing every pair cost each host a probe and a store request per other
host (O(H^2) in all); the ring costs each host two, whatever the job's size, and still tries
every link of a ring that the ranks' own ring collectives use. Keys live under `discovery/` in
the job's store; the store's secret protects them. No torch.

The probe port answers on one thread, as the rendezvous server handshakes (Note [Bounded
handshakes] in hvdlite/_job/server.py): every connection non-blocking in one selector, at most
MAX_PENDING at once (the oldest closed first), PROBE_TIMEOUT for the whole exchange however
slowly the bytes come, anything beyond the probe closes it, and an accept that fails for want
of descriptors frees the oldest. So strangers cannot starve the peers' probes, which arrive
and are answered at once.
"""
import collections
import errno
import hashlib
import hmac
import json
import os
import secrets
import selectors
import socket
import sys
import threading
import time
from typing import Dict, List

from hvdlite._job.netif import interface_addresses
from hvdlite._job.wire import RendezvousClient, RendezvousError

PROBE_TIMEOUT = 2.0
MAX_PENDING = 64
_CHALLENGE = 16
_PROBE = _CHALLENGE + 32  # the challenge and the prober's proof
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def interfaces() -> Dict[str, List[str]]:
    """Interface name -> its IPv4 addresses, loopback left out."""
    return {name: [addr] for name, addr in interface_addresses().items() if not addr.startswith("127.")}


def _proof(secret: str, challenge: bytes, index: int) -> bytes:
    """The answering task's proof."""
    return hmac.new(secret.encode(), b"answer|" + challenge + b"|" + str(index).encode(), hashlib.sha256).digest()


def _prober_proof(secret: str, challenge: bytes) -> bytes:
    return hmac.new(secret.encode(), b"probe|" + challenge, hashlib.sha256).digest()


def _serve(listener: socket.socket, secret: str, index: int) -> None:
    """Answers probes (the module's docstring says how strangers are bounded)."""
    selector = selectors.DefaultSelector()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ)
    pending = collections.OrderedDict()  # conn -> [received bytes, deadline]

    def drop(conn):
        pending.pop(conn, None)
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    try:
        while True:
            now = time.monotonic()
            wait = min([0.25] + [max(0.0, d - now) for _, d in pending.values()])
            for key, _ in selector.select(timeout=wait):
                if key.fileobj is listener:
                    while True:
                        try:
                            conn, _ = listener.accept()
                        except (BlockingIOError, InterruptedError):
                            break
                        except OSError as exc:
                            if exc.errno not in _OUT_OF_DESCRIPTORS:
                                raise
                            if pending:
                                drop(next(iter(pending)))
                            else:
                                time.sleep(0.05)
                            break
                        conn.setblocking(False)
                        if len(pending) >= MAX_PENDING:
                            drop(next(iter(pending)))
                        pending[conn] = [b"", time.monotonic() + PROBE_TIMEOUT]
                        selector.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                if conn not in pending:
                    continue
                try:
                    data = conn.recv(_PROBE + 1)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                got = pending[conn][0] + data
                pending[conn][0] = got
                if not data or len(got) > _PROBE:
                    drop(conn)
                elif len(got) == _PROBE:
                    challenge, proof = got[:_CHALLENGE], got[_CHALLENGE:]
                    if hmac.compare_digest(proof, _prober_proof(secret, challenge)):
                        try:  # 40 bytes on a fresh connection: the send buffer takes them whole
                            conn.send(str(index).encode().rjust(8) + _proof(secret, challenge, index))
                        except OSError:
                            pass
                    drop(conn)
            now = time.monotonic()
            for conn in [c for c, (_, deadline) in pending.items() if deadline <= now]:
                drop(conn)
    except (OSError, ValueError):
        pass  # the listener was closed: discovery is over
    finally:
        for conn in list(pending):
            drop(conn)
        selector.close()


def probe(addr: str, port: int, secret: str, index: int) -> bool:
    """True if the task with `index` answers at addr:port."""
    challenge = secrets.token_bytes(_CHALLENGE)
    try:
        with socket.create_connection((addr, port), timeout=PROBE_TIMEOUT) as sock:
            sock.settimeout(PROBE_TIMEOUT)
            sock.sendall(challenge + _prober_proof(secret, challenge))
            reply = b""
            while len(reply) < 8 + 32:
                chunk = sock.recv(8 + 32 - len(reply))
                if not chunk:
                    return False
                reply += chunk
    except OSError:
        return False
    return reply[:8].strip() == str(index).encode() and hmac.compare_digest(
        reply[8:], _proof(secret, challenge, index))


def neighbours(index: int, count: int) -> List[int]:
    """The hosts that host `index` of `count` probes (Note [Network discovery]): the ones before
    and after it in the ring of hosts."""
    return sorted({(index - 1) % count, (index + 1) % count} - {index})


def reach_driver(addrs: List[str], port: int, secret: str):
    """(client through the first reachable driver address, every address reached)."""
    reached = []
    for addr in addrs:
        try:
            with socket.create_connection((addr, port), timeout=PROBE_TIMEOUT):
                reached.append(addr)
        except OSError:
            continue
    if not reached:
        return None, reached
    return RendezvousClient(reached[0], port, secret, connect_timeout=10.0), reached


def main() -> int:
    env = os.environ
    secret = env["HVDLITE_TASK_SECRET"]
    index, count = int(env["HVDLITE_TASK_INDEX"]), int(env["HVDLITE_TASK_COUNT"])
    port = int(env["HVDLITE_TASK_DRIVER_PORT"])
    timeout_ms = int(float(env.get("HVDLITE_TASK_TIMEOUT", "60")) * 1000)
    client, reached = reach_driver(env["HVDLITE_TASK_DRIVER_ADDRS"].split(","), port, secret)
    if client is None:
        print(f"hvdlite discovery task on {socket.gethostname()}: cannot reach the launcher at any of "
              f"{env['HVDLITE_TASK_DRIVER_ADDRS']} port {port}", file=sys.stderr, flush=True)
        return 3
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))
    listener.listen(64)
    threading.Thread(target=_serve, args=(listener, secret, index), daemon=True).start()
    mine = {"hostname": socket.gethostname(), "interfaces": interfaces(),
            "port": listener.getsockname()[1], "driver_reached": reached}
    key = lambda *parts: "/".join(("discovery",) + tuple(str(p) for p in parts)).encode()  # noqa: E731
    client.call(b"SET", [key(index, "info"), json.dumps(mine).encode()])
    started = time.monotonic()
    results = {}
    for other in neighbours(index, count):
        info = json.loads(client.call(b"GET", [key(other, "info"), str(timeout_ms).encode()], timeout_ms)[0])
        results[other] = [[name, addr, probe(addr, info["port"], secret, other)]
                          for name, addrs in info["interfaces"].items() for addr in addrs]
    client.call(b"SET", [key(index, "probes"), json.dumps(
        {"results": results, "seconds": time.monotonic() - started}).encode()])
    try:  # keep answering the others' probes until the driver has what it needs
        client.call(b"GET", [key("done"), str(timeout_ms).encode()], timeout_ms)
    except RendezvousError:
        pass
    listener.close()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
