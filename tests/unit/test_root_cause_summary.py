"""The launcher's summary from what it knows (Note [Root cause] in runner/errors.py), pure."""
from hvdlite.runner.errors import JobResult, RankExit


def test_a_survivor_exiting_first_still_names_the_host_it_lost():
    # The link of rank 2's host was cut: the survivors timed out and exited (without an uncaught
    # exception) before ssh noticed; rank 0 exited first and its census named rank 2.
    result = JobResult(root_cause=RankExit(0, "10.0.0.11", 1, True, "hosta"),
                       lost_contact={"text": "lost contact with rank 2 on host hostc", "ranks": [2]},
                       exits=[RankExit(0, "10.0.0.11", 1, True, "hosta"), RankExit(1, "10.0.0.12", 1, True, "hostb"),
                              RankExit(2, "10.0.0.13", -15, True, "hostc")],
                       stopped=[2])
    assert result.message().splitlines() == [
        "rank 2 (host 10.0.0.13 (hostc)) stopped answering: the others lost contact with it",
        "then rank 0 failed because of it (it had lost contact with rank 2 on host hostc)"]
    assert result.exit_code == 1


def test_reports_beat_the_order_of_exits():
    record = lambda rank, kind, msg, time, of=None: {  # noqa: E731
        "rank": rank, "host": "vm", "pid": 100 + rank, "time": time, "type": kind, "message": msg,
        "where": {"file": "train.py", "line": 9}, "consequence_of": of}
    result = JobResult(root_cause=RankExit(0, "vm", 1), exits=[RankExit(0, "vm", 1), RankExit(1, "vm", 2)],
                       failures={0: record(0, "ShutdownError", "x", 2.0, [1]),
                                 1: record(1, "KeyError", "'lr'", 1.0)})
    assert result.message().splitlines() == [
        "rank 1 (host vm, pid 101) failed first: KeyError: 'lr' (train.py, line 9); it exited with code 2",
        "then rank 0 failed because of it (ShutdownError: x)"]
    assert result.exit_code == 2 and result.cause_ranks() == [1]
