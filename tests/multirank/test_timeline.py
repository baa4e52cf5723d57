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


def _engines_of_one_process():
    # the global set, a process set and two torch.distributed groups of the backend, each
    # engine with a timeline file of its own (hvdlite/_runtime/groups.py timeline_for)
    import torch.distributed as dist
    hvd.init()
    pair = hvd.add_process_set([0, 1])
    hvd.allreduce(torch.ones(100), name="global.op")
    hvd.allreduce(torch.ones(100), name="set.op", process_set=pair)
    dist.init_process_group("hvdlite", init_method="hvdlite://")
    dist.all_reduce(torch.ones(100))
    second = dist.new_group(backend="hvdlite")
    dist.all_gather_into_tensor(torch.empty(200), torch.ones(100), group=second)
    dist.destroy_process_group()
    hvd.shutdown()
    return True


def test_every_engine_of_a_process_writes_its_own_timeline(tmp_path):
    assert all(run_ranks(2, __name__, "_engines_of_one_process", env={"HVDLITE_TIMELINE": str(tmp_path / "t.json")}))
    for rank in range(2):
        glob_rows, set_rows = _rows(tmp_path / f"t.rank{rank}.json"), _rows(tmp_path / f"t.set1.rank{rank}.json")
        assert "global.op" in glob_rows and "set.op" not in glob_rows, glob_rows
        assert "set.op" in set_rows and "global.op" not in set_rows, set_rows
        default, second = _rows(tmp_path / f"t.pg0.rank{rank}.json"), _rows(tmp_path / f"t.pg1.rank{rank}.json")
        assert any(r.startswith("c10d.allreduce") for r in default), default
        assert any(r.startswith("c10d.allgather_into_tensor") for r in second), second
