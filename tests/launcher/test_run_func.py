"""hvdlite.runner.run(fn, np=...): a Python function on N local ranks."""
import os

import pytest

from hvdlite.runner import JobFailedError, run


def whoami(offset, scale=1):
    return {"rank": int(os.environ["HVDLITE_RANK"]) * scale + offset,
            "size": int(os.environ["HVDLITE_SIZE"]),
            "custom": os.environ.get("RUN_TEST_VAR")}


def fail_on_rank_1():
    if os.environ["HVDLITE_RANK"] == "1":
        raise ValueError("rank 1 cannot go on")
    return "fine"


def test_run_returns_results_in_rank_order(capfd):
    results = run(whoami, args=(100,), kwargs={"scale": 10}, np=3,
                  env={"RUN_TEST_VAR": "seen"})
    assert results == [{"rank": 100 + 10 * r, "size": 3, "custom": "seen"} for r in range(3)]


def test_run_failing_rank_raises_naming_it(capfd):
    with pytest.raises(JobFailedError) as info:
        run(fail_on_rank_1, np=2)
    assert info.value.rank == 1
    assert "rank 1" in str(info.value) and "ValueError: rank 1 cannot go on" in str(info.value)
    assert "[1]<stderr>: ValueError: rank 1 cannot go on" in capfd.readouterr().err


def test_run_rejects_a_lambda():
    with pytest.raises(TypeError, match="module-level function"):
        run(lambda: 1, np=1)
