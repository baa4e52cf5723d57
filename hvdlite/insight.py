"""Seeing inside a running job: who is slow and what each rank's engine is doing.

``straggler_report()`` returns the figures of Note [Straggler attribution] (csrc/recorder.h),
``flight_record()`` this rank's flight record (Note [Flight record]). The dump files that put
every rank's record and stacks side by side are _runtime/recorder.py's (Note [Dump files]); the
metrics endpoint is _runtime/metrics.py's (Note [Metrics]).
"""

from .ops import _runtime


def straggler_report(process_set=None):
    """Which rank holds the job back: ``{rank: figures}`` for every rank of the process set
    (the global one by default), the same on every rank once they have decided the same rounds.

    Each rank's figures, over the last 100 negotiation rounds that completed something:
    ``last_fraction``, the fraction of them in which that rank submitted last;
    ``lag_median_s`` and ``lag_p95_s``, how long after the first rank it submitted in those
    rounds; ``rounds_last`` and ``rounds``, the counts behind the fraction; and ``flagged``,
    true when the rank is consistently last (last in at least 60% of at least 10 rounds, and in
    at least 1.75 times its share, with a median lag of at least HVDLITE_STRAGGLER_MIN_LAG_MS,
    default 10 ms). Ranks are the process set's own (0 .. size-1).
    """
    _, runtime = _runtime("straggler_report", process_set)
    return runtime.engine.stragglers()


def flight_record(process_set=None, timeout=2.5):
    """This rank's flight record for the process set: ``rounds`` (the last rounds that decided
    something: number, time, tensors, bytes, last rank and lag, the first tensors by name),
    ``pending`` (the collectives some ranks have submitted and others not, with both lists;
    None if the engine thread did not answer within `timeout` seconds), ``activity`` and
    ``activity_for_s`` (what the engine thread is doing, and for how long)."""
    _, runtime = _runtime("flight_record", process_set)
    return runtime.engine.flight_record(float(timeout))
