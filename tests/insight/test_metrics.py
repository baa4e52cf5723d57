"""The /metrics endpoint (Note [Metrics] in hvdlite/_runtime/metrics.py) on 2 real ranks: the
text parses with prometheus_client's own parser, the byte and tensor counters equal what the
test moved, it is off by default, and strangers cannot grow its threads."""
import socket
import threading
import time
import urllib.request

import pytest

from tests.harness import Job

pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (pip install hvdlite[metrics])")

SIZES = [3, 100, 70000, 1 << 20]  # float32 elements: inline, shared memory, fused or not


def _free_base():
    """A port p with p and p + 1 both free."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base >= 65535:
            continue
        try:
            with socket.socket() as t:
                t.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _scrape(port):
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def scraped(base):
    import torch
    from prometheus_client.parser import text_string_to_metric_families

    import hvdlite as hvd
    hvd.init()
    for i, n in enumerate(SIZES):
        out = hvd.allreduce(torch.full((n,), float(hvd.rank() + 1)), name=f"m{i}", op=hvd.Sum)
        assert torch.equal(out, torch.full((n,), 3.0))
    gathered = hvd.allgather(torch.ones(5, 2) * hvd.rank(), name="g")
    assert gathered.shape == (10, 2)
    hvd.barrier()
    port = base + hvd.local_rank()
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]  # strangers, silent
    time.sleep(0.3)
    text = _scrape(port)
    threads_after = threading.active_count()
    for s in idle:
        s.close()
    missing = urllib.request.Request(f"http://127.0.0.1:{port}/other")
    try:
        urllib.request.urlopen(missing, timeout=10)
        other = 200
    except urllib.error.HTTPError as exc:
        other = exc.code
    totals = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("hvdlite_bytes_total", "hvdlite_tensors_total"):
                key = (sample.name, sample.labels["op"])
                totals[key] = totals.get(key, 0) + sample.value
            if sample.name == "hvdlite_round_seconds_count":
                totals["rounds"] = sample.value
            assert sample.labels.get("rank", str(hvd.rank())) == str(hvd.rank())
    hvd.shutdown()
    return totals, threads_before, threads_after, other


def test_scraped_counters_equal_the_bytes_reduced():
    base = _free_base()
    results = Job(2, "tests.insight.test_metrics", "scraped", base,
                  env={"HVDLITE_METRICS_PORT": str(base)}).wait(timeout=90)
    for totals, before, after, other in results:
        assert totals[("hvdlite_bytes_total", "allreduce")] == 4 * sum(SIZES), totals
        assert totals[("hvdlite_tensors_total", "allreduce")] == len(SIZES), totals
        assert totals[("hvdlite_bytes_total", "allgather")] == 5 * 2 * 4, totals
        assert totals[("hvdlite_tensors_total", "barrier")] == 1, totals
        assert totals["rounds"] >= 1
        assert after == before, (before, after)  # 100 idle connections, no new thread
        assert other == 404


def off_by_default():
    import torch

    import hvdlite as hvd
    from hvdlite._runtime import state
    hvd.init()
    hvd.allreduce(torch.ones(2), name="x")
    names = [t.name for t in threading.enumerate()]
    serving = state.process.metrics_server
    hvd.shutdown()
    return names, serving


def test_metrics_are_off_by_default():
    for names, serving in Job(2, "tests.insight.test_metrics", "off_by_default").wait(timeout=60):
        assert serving is None
        assert "hvdlite-metrics" not in names, names
