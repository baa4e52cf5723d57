"""hvdliterun's flags for seeing inside a job, and the merged report from records (pure, one
process)."""
from hvdlite._job import dumps
from hvdlite.runner.launch import parse_config


def test_straggler_and_metrics_flags_become_variables():
    config, _ = parse_config(["-np", "2", "--straggler-report", "30", "--metrics-port", "9100", "x"])
    assert config.knobs.core_env() == {"HVDLITE_STRAGGLER_REPORT_SECONDS": "30", "HVDLITE_METRICS_PORT": "9100"}


def test_dump_needs_no_command():
    config, args = parse_config(["--dump"])
    assert config is None and args.dump == ""
    config, args = parse_config(["--dump", "/tmp/somejob"])
    assert config is None and args.dump == "/tmp/somejob"


def _record(rank, pending, where):
    return {"id": "hvdlite-0-global-r9", "reasons": ["SIGUSR1"], "rank": rank, "size": 3, "host": "h", "pid": 100 + rank,
            "engines": {"global": {"rank": rank, "size": 3, "rounds": [], "pending": pending,
                                   "activity": "negotiating round 9", "activity_for_s": 0.1}},
            "threads": [], "where": where}


def test_the_report_merges_the_ranks_views_and_names_where_the_missing_rank_is():
    early = [{"name": "w", "op": "allreduce", "bytes": 4096, "waited_s": 1.0, "submitted": [0], "missing": [1, 2]}]
    late = [{"name": "w", "op": "allreduce", "bytes": 4096, "waited_s": 2.5, "submitted": [0, 2], "missing": [1]}]
    records = {0: _record(0, early, {"file": "t.py", "line": 7, "function": "<module>", "code": "hvd.allreduce(x)"}),
               1: _record(1, None, {"file": "t.py", "line": 5, "function": "step", "code": "time.sleep(9)"}),
               2: _record(2, late, None)}
    text = dumps.report(records)
    assert "3 of 3 ranks wrote a record" in text
    assert "allreduce 'w' (4.0 KB), waiting 2.5 s: submitted by ranks 0, 2; missing rank 1" in text, text
    assert "rank 1 is at t.py:5 in step: time.sleep(9)" in text, text
    del records[1]
    text = dumps.report(records)
    assert "2 of 3 ranks wrote a record (missing: rank 1)" in text, text
    assert "rank 1 is at unknown (this rank wrote no dump" in text, text
