"""Naming a lost rank: which peer died, when the transport only says "connection reset" or
"timed out".

At init every rank publishes its host name and pid in the rendezvous store (with the build
and settings record of _runtime/settings.py); before the engines start each rank reads the whole table
in one request (a rendezvous of every rank). When an engine
reports a rank failure, ranks on the same host can be checked directly: a peer whose pid no
longer runs (or is a zombie) is the lost rank. Peers on other hosts are named by the address
in the transport's message, mapped to the ranks on that host, and by a census.

Note [Failure census]
A host whose link is cut, or whose every process was killed, cannot say so; a timeout does not
say who stopped answering. So when its engine reports a rank failure, every surviving rank
writes "I am here" under `census/<rank>` in the job's store and waits up to CENSUS_SECONDS for
every other rank's: the ranks that do not appear are the ones lost (a peer on this host whose
pid has exited is lost for certain). Each rank then writes what it concluded under
`lost/<rank>`, which the launcher reads to name the lost host in its summary. The store may be
unreachable too (it lives on a lost host under torchrun), so the census runs on a helper thread
and is abandoned after CENSUS_SECONDS plus a second.
"""

import json
import os
import re
import socket
import threading
import time

from .._job import netif as _netif
from .._job import keys

CENSUS_SECONDS = 2.0


def _addresses():
    """Every IPv4 address of this host's interfaces: the transport names a peer by one of them."""
    return sorted(set(_netif.interface_addresses().values()))


def publish(store, prefix, rank, extra=None):
    # The interfaces' addresses, not a lookup of the host name: the transport names a peer by
    # one of them, and a lookup is a name server's round trip per rank (on a host whose
    # resolver cannot reach its server, a 5 s timeout) for an address that is either among them
    # or one no peer connects from.
    info = {"host": socket.gethostname(), "pid": os.getpid(), "addrs": _addresses(), **(extra or {})}
    store.set(prefix + keys.proc(rank), json.dumps(info))


def read(store, prefix, size):
    """Every rank's record, once all are published: one request whatever the job's size
    (Note [Store operations] in _job/table.py). multi_get waits for missing keys, as get does,
    on every store: SecretStore's MULTI_GET, TCPStore's, and Store's default of a get per key."""
    return [json.loads(v) for v in store.multi_get([prefix + keys.proc(r) for r in range(size)])]


def running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return True


def lost_ranks(peers, my_rank, wait_seconds=1.0):
    """Ranks on this host whose process has exited (polls briefly: the peer may be exiting)."""
    host = socket.gethostname()
    local = [(r, p["pid"]) for r, p in enumerate(peers) if r != my_rank and p["host"] == host]
    deadline = time.monotonic() + wait_seconds
    while True:
        dead = [r for r, pid in local if not running(pid)]
        if dead or time.monotonic() >= deadline or not local:
            return dead
        time.sleep(0.05)


def _census(store, prefix, size, my_rank, known_dead):
    """Ranks that did not answer the census (Note [Failure census]), or None if it failed."""
    result = {}

    def run():
        store.set(f"{prefix}census/{my_rank}", "1")
        waiting = [r for r in range(size) if r != my_rank and r not in known_dead]
        deadline = time.monotonic() + CENSUS_SECONDS
        while waiting and time.monotonic() < deadline:
            waiting = [r for r in waiting if not store.check([f"{prefix}census/{r}"])]
            if waiting:
                time.sleep(0.05)
        result["missing"] = waiting

    thread = threading.Thread(target=run, name="hvdlite-census", daemon=True)
    thread.start()
    thread.join(CENSUS_SECONDS + 1.0)
    return result.get("missing")


def _name(peers, r):
    return f"rank {r} (pid {peers[r]['pid']} on {peers[r]['host']})"


def describe(peers, my_rank, message, store=None, prefix="", wait_seconds=1.0):
    """(text to append, ranks) naming what is known about the lost peers; with `store`, after a
    census of the job's ranks (only for the global engine's failures: every rank takes part)."""
    dead = lost_ranks(peers, my_rank, wait_seconds)
    missing = None
    if store is not None and len(peers) > 1:
        missing = _census(store, prefix, len(peers), my_rank, dead)
    lost = sorted(set(dead) | set(missing or ()))
    if lost:
        parts = []
        for r in lost:
            why = "it has exited" if r in dead else f"it did not answer within {CENSUS_SECONDS:g} s"
            parts.append(f"{_name(peers, r)}: {why}")
        hosts = sorted({peers[r]["host"] for r in lost})
        summary = (f"lost contact with {'rank' if len(lost) == 1 else 'ranks'} "
                   f"{', '.join(map(str, lost))} on {'host' if len(hosts) == 1 else 'hosts'} {', '.join(hosts)}")
        if store is not None:
            try:
                store.set(f"{prefix}lost/{my_rank}", json.dumps({"text": summary, "ranks": lost}))
            except Exception:  # noqa: BLE001 - the store may be what was lost
                pass
        return "lost " + "; ".join(parts), lost
    match = re.search(r"\[([0-9a-fA-F.:]+)\]:\d+", message)
    if match:
        addr = match.group(1)
        ranks = [r for r, p in enumerate(peers)
                 if r != my_rank and (addr == p["host"] or addr in p.get("addrs", ()))]
        if ranks and addr not in ("127.0.0.1", "::1"):
            host = peers[ranks[0]]["host"]
            return f"the peer at {addr} (host {host}, ranks {ranks}) stopped answering", ranks
    return "", None
