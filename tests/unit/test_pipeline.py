"""The data plane's shape (csrc/pipeline.h): the one chunk cut, and the window of works in flight
that every pipelined loop runs on, driven with scripted works in one process.

A scripted work ends only when waited for; the tests check the window's rules against the
events: at most one work per lane, starts in lane order, every started work waited for exactly
once (also after a failure), nothing started after a failure, and the first failure thrown.
"""

import pytest

import hvdlite  # noqa: F401  (imports torch, then the extension)
from hvdlite import _core


@pytest.mark.parametrize("total,per,first", [(0, 4, 0), (1, 4, 0), (16, 4, 0), (17, 4, 0), (17, 4, 1),
                                             (100, 8, 2), (7, 100, 0), (7, 100, 3)])
def test_cut_chunks_covers_the_total_in_order(total, per, first):
    chunks = _core._cut_chunks(total, per, first)
    at = 0
    for i, (begin, n) in enumerate(chunks):
        assert begin == at and n > 0
        want = first if i == 0 and first > 0 else per
        assert n == want or (i == len(chunks) - 1 and n < want)  # only the last is short
        at += n
    assert at == total


def test_cut_chunks_refuses_empty_chunks():
    with pytest.raises(ValueError, match="chunks of 0"):
        _core._cut_chunks(10, 0)


def run(count, lanes, lag, **failures):
    events, error = _core._window_schedule(count, lanes, lag, **failures)
    starts = [k for kind, k in events if kind == "start"]
    waits = [k for kind, k in events if kind == "wait"]
    return events, starts, waits, error


def check_lanes(events, lanes):
    """A work starts only after its lane's work before it was waited for."""
    waited = set()
    for kind, k in events:
        if kind == "start" and k >= lanes:
            assert k - lanes in waited, (k, events)
        elif kind == "wait":
            waited.add(k)


@pytest.mark.parametrize("count,lanes,lag", [(1, 1, 1), (5, 1, 1), (9, 2, 1), (9, 2, 0), (10, 3, 2), (10, 4, 0)])
def test_every_work_starts_once_and_is_waited_for_once_in_lane_order(count, lanes, lag):
    events, starts, waits, error = run(count, lanes, lag)
    assert error == ""
    assert sorted(starts) == list(range(count)) and sorted(waits) == list(range(count))
    assert starts == sorted(starts)  # lanes free up in order here: starts come in order
    check_lanes(events, lanes)


@pytest.mark.parametrize("lanes,lag", [(1, 1), (2, 1), (3, 0), (4, 2)])
@pytest.mark.parametrize("at", [0, 3, 8])
def test_a_failed_start_stops_the_rest_and_every_started_work_is_waited_for(lanes, lag, at):
    events, starts, waits, error = run(9, lanes, lag, fail_start=at)
    assert error == f"start {at}"
    assert max(starts) == at  # nothing starts after the failure
    assert sorted(waits) == [k for k in starts if k != at]  # the failed start has nothing to wait for
    check_lanes(events, lanes)


@pytest.mark.parametrize("lanes,lag", [(1, 1), (2, 1), (3, 0), (4, 2)])
@pytest.mark.parametrize("at", [0, 4, 8])
def test_a_failed_wait_stops_later_starts_and_the_first_failure_is_thrown(lanes, lag, at):
    events, starts, waits, error = run(9, lanes, lag, fail_wait=at, also_fail=[at + 1])
    assert error == f"wait {at}"  # the later one that also fails is waited for, not thrown
    assert sorted(waits) == sorted(starts)  # every started work waited for
    failed_at = events.index(("wait", at))
    assert not [e for e in events[failed_at:] if e[0] == "start"]
    check_lanes(events, lanes)
