"""HVDLITE_TIMELINE writes a Chrome trace per rank that Perfetto / chrome://tracing can open."""

import json

import torch

import hvdlite as hvd
from tests.harness import run_ranks


def _traced():
    hvd.init()
    rank = hvd.rank()
    hvd.allreduce(torch.ones(4), name="tiny")                      # inlined in the round
    hvd.allreduce(torch.ones(100_000), name="big")                 # through Gloo
    handles = [hvd.allreduce_async(torch.ones(1000), name=f"grad.{i}") for i in range(5)]
    for h in handles:
        hvd.synchronize(h)
    hvd.allgather(torch.ones(rank + 1, 300), name="gathered")
    hvd.shutdown()
    return True


def test_timeline_is_a_valid_chrome_trace_with_per_tensor_phases(tmp_path):
    path = str(tmp_path / "trace.json")
    assert all(run_ranks(2, __name__, "_traced", env={"HVDLITE_TIMELINE": path}))
    for rank in range(2):
        with open(tmp_path / f"trace.rank{rank}.json") as f:
            events = json.load(f)
        rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        assert {"tiny", "big", "gathered", "rounds"} <= set(rows.values()) and \
            {f"grad.{i}" for i in range(5)} <= set(rows.values())
        spans = {}
        for e in events:
            if e.get("ph") == "X":
                assert e["pid"] == rank and e["dur"] >= 0 and e["ts"] > 0
                spans.setdefault(rows[e["tid"]], []).append(e["name"])
        assert spans["tiny"] == ["NEGOTIATE", "INLINE"]
        assert spans["big"] == ["NEGOTIATE", "COPY_IN", "COLLECTIVE", "COPY_OUT"]
        assert spans["gathered"][0] == "NEGOTIATE" and "COLLECTIVE" in spans["gathered"]
        assert any(e.get("name") == "round" and e["ph"] == "i" for e in events)



def _started_at_run_time(directory):
    hvd.init()
    hvd.allreduce(torch.ones(8), name="before")               # no timeline yet
    hvd.start_timeline(f"{directory}/first.json", mark_cycles=True)
    hvd.allreduce(torch.ones(8), name="during.first")
    hvd.start_timeline(f"{directory}/second.json")            # closes the first, opens the second
    hvd.allreduce(torch.ones(8), name="during.second")
    hvd.stop_timeline()                                       # closed when this returns
    hvd.allreduce(torch.ones(8), name="after")
    hvd.stop_timeline()                                       # nothing to stop: a no-op
    hvd.shutdown()
    return True


def _rows(path):
    with open(path) as f:
        events = json.load(f)  # a complete, valid JSON array: the file was closed
    return {e["args"]["name"] for e in events if e.get("name") == "thread_name"}


def test_timeline_started_and_stopped_at_run_time(tmp_path):
    assert all(run_ranks(2, __name__, "_started_at_run_time", str(tmp_path)))
    for rank in range(2):
        first, second = _rows(tmp_path / f"first.rank{rank}.json"), _rows(tmp_path / f"second.rank{rank}.json")
        assert "during.first" in first and not {"before", "during.second", "after"} & first
        assert "during.second" in second and not {"before", "during.first", "after"} & second
