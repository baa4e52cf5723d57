"""Prometheus metrics of a running rank, served over HTTP when asked for.

Note [Metrics]
With HVDLITE_METRICS_PORT=BASE (hvdliterun --metrics-port BASE sets it), each rank serves
``/metrics`` on port BASE + its local rank (HVDLITE_METRICS_ADDR, default 0.0.0.0), in
Prometheus' text format written by the official ``prometheus_client`` package (the ``metrics``
extra). Everything is read from the engines when scraped (csrc/recorder.h keeps the counters):
tensors and bytes per op and transport, the round-time histogram, negotiation time, fusion
buffer fill, response-cache hits, stall warnings and failures, the straggler figures (Note
[Straggler attribution]) and elastic resets. Off by default: without the variable there is no
thread, no port, and prometheus_client is never imported.

The listener is bounded the way the rendezvous server is (Note [Bounded handshakes] in
hvdlite/_job/server.py), rather than prometheus_client's own server, which starts a thread per
connection: one thread serves every connection from one selector, at most MAX_CONNECTIONS at
once (a new one beyond that closes the oldest), each with REQUEST_DEADLINE seconds to send a
request head of at most MAX_REQUEST bytes; anything but ``GET /metrics`` gets a 404, and the
connection is closed after one answer.
"""

import errno
import os
import selectors
import socket
import sys
import threading
import time

from . import recorder as _recorder
from . import state as _state

MAX_CONNECTIONS = 32
REQUEST_DEADLINE = 5.0
MAX_REQUEST = 8192


def start():
    """Serves /metrics once per process if HVDLITE_METRICS_PORT is set (Note [Metrics])."""
    base = os.environ.get("HVDLITE_METRICS_PORT")
    process = _state.process
    if not base or process.metrics_server is not None:
        return
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        raise ImportError("HVDLITE_METRICS_PORT needs prometheus_client: pip install 'hvdlite[metrics]'") from None
    state = _state.current()
    port = int(base) + max(state.topology.local_rank, 0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    server = MetricsServer(os.environ.get("HVDLITE_METRICS_ADDR", "0.0.0.0"), port, registry)
    process.metrics_server = server
    server.start()


class _Collector:
    """Builds the metric families from the engines at each scrape."""

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                            SummaryMetricFamily)
        state = _state.peek()
        rank = str(state.topology.rank) if state is not None else ""
        base = ["rank", "engine"]
        families = {
            "tensors": CounterMetricFamily("hvdlite_tensors", "Tensors whose collective completed, by op and transport",
                                           labels=base + ["op", "transport"]),
            "bytes": CounterMetricFamily("hvdlite_bytes", "Bytes of this rank's tensors in completed collectives",
                                         labels=base + ["op", "transport"]),
            "negotiate": SummaryMetricFamily("hvdlite_negotiation_seconds",
                                             "Time each negotiation round took (quiet ones included)", labels=base),
            "fill": SummaryMetricFamily("hvdlite_fusion_fill_ratio",
                                        "Bytes of each fused batch over the fusion threshold", labels=base),
            "hits": CounterMetricFamily("hvdlite_response_cache_hits", "Requests sent as response-cache ids",
                                        labels=base),
            "misses": CounterMetricFamily("hvdlite_response_cache_misses", "Requests sent whole", labels=base),
            "warnings": CounterMetricFamily("hvdlite_stall_warnings", "Rounds that warned of a stall", labels=base),
            "stalls": CounterMetricFamily("hvdlite_stall_failures", "Tensors failed as stalled", labels=base),
            "last": GaugeMetricFamily("hvdlite_straggler_last_fraction",
                                      "Fraction of recent rounds in which the rank submitted last",
                                      labels=base + ["straggler"]),
            "median": GaugeMetricFamily("hvdlite_straggler_lag_median_seconds",
                                        "Median lag of the rank in the rounds it was last", labels=base + ["straggler"]),
            "p95": GaugeMetricFamily("hvdlite_straggler_lag_p95_seconds",
                                     "95th percentile lag of the rank in the rounds it was last",
                                     labels=base + ["straggler"]),
            "flagged": GaugeMetricFamily("hvdlite_straggler_flagged", "1 when the rank is consistently last",
                                         labels=base + ["straggler"]),
        }
        rounds = HistogramMetricFamily("hvdlite_round_seconds", "Duration of rounds that decided something",
                                       labels=base)
        for label, engine in _recorder.engines(state):
            key = [rank, label]
            m = engine.metrics()
            for op, transport, tensors, nbytes in m["traffic"]:
                families["tensors"].add_metric(key + [op, transport], tensors)
                families["bytes"].add_metric(key + [op, transport], nbytes)
            families["negotiate"].add_metric(key, m["negotiations"], m["negotiate_sum_s"])
            families["fill"].add_metric(key, m["fused_batches"], m["fusion_fill_sum"])
            families["hits"].add_metric(key, m["cache_hits"])
            families["misses"].add_metric(key, m["cache_misses"])
            families["warnings"].add_metric(key, m["stall_warnings"])
            families["stalls"].add_metric(key, m["stall_failures"])
            cumulative, buckets = 0, []
            for bound, count in zip(m["round_bounds_s"] + [float("inf")], m["round_counts"]):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            rounds.add_metric(key, buckets, m["round_sum_s"])
            for straggler, f in engine.stragglers().items():
                who = key + [str(straggler)]
                families["last"].add_metric(who, f["last_fraction"])
                families["median"].add_metric(who, f["lag_median_s"])
                families["p95"].add_metric(who, f["lag_p95_s"])
                families["flagged"].add_metric(who, 1.0 if f["flagged"] else 0.0)
        resets = CounterMetricFamily("hvdlite_elastic_resets", "Elastic resets this process went through",
                                     labels=["rank"])
        resets.add_metric([rank], _state.process.elastic.resets)
        yield from families.values()
        yield rounds
        yield resets


class _Connection:
    def __init__(self, conn):
        self.conn = conn
        self.received = bytearray()
        self.deadline = time.monotonic() + REQUEST_DEADLINE


class MetricsServer:
    """Note [Metrics]: one thread, one selector, bounded connections."""

    def __init__(self, addr, port, registry):
        self.registry = registry
        self._sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((addr, port))
        self._sock.listen(64)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._loop, name="hvdlite-metrics", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def _loop(self):
        selector = selectors.DefaultSelector()
        selector.register(self._sock, selectors.EVENT_READ, None)
        open_ = {}
        while True:
            for key, _ in selector.select(timeout=0.5):
                if key.data is None:
                    self._accept(selector, open_)
                else:
                    self._read(selector, open_, key.data)
            now = time.monotonic()
            for conn in [c for c in open_.values() if c.deadline < now]:
                self._close(selector, open_, conn)

    def _accept(self, selector, open_):
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM) and open_:
                    self._close(selector, open_, next(iter(open_.values())))
                    continue
                return
            if len(open_) >= MAX_CONNECTIONS:  # the oldest goes
                self._close(selector, open_, next(iter(open_.values())))
            conn.setblocking(False)
            entry = _Connection(conn)
            open_[conn.fileno()] = entry
            selector.register(conn, selectors.EVENT_READ, entry)

    def _read(self, selector, open_, entry):
        try:
            data = entry.conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(selector, open_, entry)
            return
        entry.received += data
        if b"\r\n\r\n" not in entry.received:
            if len(entry.received) > MAX_REQUEST:
                self._close(selector, open_, entry)
            return
        line = bytes(entry.received.split(b"\r\n", 1)[0]).split()
        self._answer(entry.conn, line)
        self._close(selector, open_, entry)

    def _answer(self, conn, line):
        if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
            try:
                body, status, kind = generate_latest(self.registry), b"200 OK", CONTENT_TYPE_LATEST.encode()
            except Exception as exc:  # noqa: BLE001 - a scrape must not end the server
                print(f"hvdlite: /metrics failed: {exc!r}", file=sys.stderr, flush=True)
                body, status, kind = b"error\n", b"500 Internal Server Error", b"text/plain"
        else:
            body, status, kind = b"not found\n", b"404 Not Found", b"text/plain"
        head = (b"HTTP/1.0 " + status + b"\r\nContent-Type: " + kind + b"\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n")
        try:
            conn.setblocking(True)
            conn.settimeout(REQUEST_DEADLINE)
            conn.sendall(head + body)
        except OSError:
            pass

    @staticmethod
    def _close(selector, open_, entry):
        open_.pop(entry.conn.fileno(), None)
        try:
            selector.unregister(entry.conn)
        except (KeyError, ValueError):
            pass
        entry.conn.close()
