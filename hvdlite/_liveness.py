"""Naming a lost rank: which peer died, when the transport only says "connection reset".

At init every rank publishes its host name and pid in the rendezvous store (with the build
and settings record of _settings.py); before the engines start each rank reads the whole table
(a rendezvous of every rank). When an engine
reports a rank failure, ranks on the same host can be checked directly: a peer whose pid no
longer runs (or is a zombie) is the lost rank. Peers on other hosts are named by the address
in the transport's message, mapped to the ranks on that host.
"""

import json
import os
import re
import socket
import time

_KEY = "proc/{}"


def publish(store, prefix, rank, extra=None):
    info = {"host": socket.gethostname(), "pid": os.getpid(), **(extra or {})}
    try:
        info["addr"] = socket.gethostbyname(info["host"])
    except OSError:
        info["addr"] = ""
    store.set(prefix + _KEY.format(rank), json.dumps(info))


def read(store, prefix, size):
    return [json.loads(store.get(prefix + _KEY.format(r))) for r in range(size)]


def _running(pid):
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
        dead = [r for r, pid in local if not _running(pid)]
        if dead or time.monotonic() >= deadline or not local:
            return dead
        time.sleep(0.05)


def describe(peers, my_rank, message):
    """(text to append, ranks) naming what is known about the lost peer."""
    dead = lost_ranks(peers, my_rank)
    if dead:
        names = ", ".join(f"rank {r} (pid {peers[r]['pid']} on {peers[r]['host']})" for r in dead)
        return f"lost {names}: {'it has' if len(dead) == 1 else 'they have'} exited", dead
    match = re.search(r"\[([0-9a-fA-F.:]+)\]:\d+", message)
    if match:
        addr = match.group(1)
        ranks = [r for r, p in enumerate(peers) if r != my_rank and addr in (p.get("addr"), p["host"])]
        if ranks and addr not in ("127.0.0.1", "::1"):
            return f"the peer at {addr} (hosting ranks {ranks}) stopped answering", ranks
    return "", None
