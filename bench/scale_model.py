"""What one negotiation round costs a rank at N ranks, from the real code where it can run here.

    python bench/scale_model.py [--sizes 64,256,1024,4096,16384] [--measure-up-to 1024]

The message: a cached ResNet-50 step (161 gradients) encoded by the real encoder with the real
response cache (a two-rank controller harness that has seen the step once), so each request
travels as its cache id. Inlined tensor values are left out (they ride in every exchange alike).

The exchanges, per rank and round:
  - alltoall of slots (a Gloo group's, with HVDLITE_CONTROL_LINK=0, up to
    HVDLITE_CONTROL_ALLTOALL_MAX): N - 1 messages of one slot each, the slot sized by the real
    SlotSizer from the round's lengths;
  - recursive doubling (over the control link at every N, Note [Control link] in
    csrc/control_link.h; on a Gloo group above HVDLITE_CONTROL_ALLTOALL_MAX): the real Hypercube, run by N virtual ranks over in-memory
    mailboxes up to --measure-up-to (one thread each), which counts every transfer and byte; past
    that, the same schedule counted by formula (printed side by side where both exist);
  - the cached round (Note [Cached rounds] in csrc/cached_round.h), which a steady step takes
    wherever rounds go by recursive doubling: the real offers (161 ids ready, no inlined values), combined by the real Hypercube
    Reduce over the same mailboxes, one combined offer per transfer; formula beyond.

CPU per round and rank: the real Controller (a harness with N ranks that has decided the step
once) timed on this machine, for a full round (every rank's 161 requests built from the response
cache, as decoding N cached messages builds them, then decided) and for a cached round (the
remembered decisions repeated: Controller::ProcessRepeated).

Latency (alpha-beta): an alltoall's messages are all in flight at once, alpha + the bytes a rank
sends / beta + a per-message cost; the hypercube's steps run one after another, each alpha + its
bytes / beta + the per-message cost. alpha 25 and 5 microseconds, beta 10 Gbit/s, 2 us per
message. These constants are assumptions, not calibrated: the namespace-host runs of
bench/scale.py put K processes on two cores, where thread hand-offs, not the link, set the time.
"""
import argparse
import ctypes
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hvdlite  # noqa: E402,F401  (imports torch, then the extension)
from hvdlite import _core  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import resnet50_shapes  # noqa: E402

BETA = 10e9 / 8  # bytes per second
PER_MESSAGE = 2e-6


def cached_step_message():
    """Bytes of one rank's message for a cached ResNet-50 step, as the engine would send it."""
    harness = _core._ControllerHarness(2, cache_capacity=1024)
    requests = [{"name": f"grad.{i}", "shape": list(shape)} for i, shape in enumerate(resnet50_shapes())]
    message = {"requests": requests}
    first, _ = harness.wire(0, message)  # not cached yet: names and shapes in full
    harness.round([message, message])     # decided once: now in the cache
    cached, names = harness.wire(0, message)
    assert len(names) == 161
    return first, cached


def hypercube_by_formula(n, length, slot):
    """(transfers sent, bytes sent) by the rank that sends most, and the steps in sequence."""
    core = 1 << int(math.floor(math.log2(n)))
    steps = int(math.log2(core))
    extras = n - core
    entry = 8 + length  # rank and length words, then the message
    frame = 8 + 4       # header, count
    worst_sent, worst_bytes = 0, 0
    for rank in (0, core - 1):  # with a folded-in partner, and without
        held = 1 + (1 if rank + core < n else 0)
        sent = 0
        total = 0
        for k in range(steps):
            sent += 1
            total += frame + held * entry
            held *= 2
        if rank + core < n:
            sent += 1
            total += frame + (n - 1) * entry
        if sent > worst_sent or total > worst_bytes:
            worst_sent, worst_bytes = max(sent, worst_sent), max(total, worst_bytes)
    return worst_sent, worst_bytes, steps + (2 if extras else 0)


KEPT = []


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def resident():
    """Bytes of the C heap in use (glibc's mallinfo2: allocated and not freed), so what a round
    allocated and freed again does not count."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def round_cpu(n):
    """(full round, cached round) CPU seconds per round of the real controller at n ranks, and
    the memory its tables hold (the response cache keeps every rank's request)."""
    message = {"requests": [{"name": f"grad.{i}", "shape": list(shape)}
                            for i, shape in enumerate(resnet50_shapes())]}
    before = resident()
    harness = _core._ControllerHarness(n, cache_capacity=1024)
    harness.round([message] * n)
    tables = resident() - before
    expand, decide, repeat = harness.repeat_cost(message, 2)
    KEPT.append(harness)  # freed memory would be reused by the next size's tables
    return expand + decide, repeat, tables


def cached_offer(rank, n_ids=161):
    """One rank's offer for a cached ResNet-50 step, as the engine encodes it."""
    return _core._cached_offer(rank, True, True, 1, 2, 0, 0, n_ids, list(range(n_ids)), {})


def cached_by_formula(n, offer_bytes):
    """(transfers sent, bytes sent) by the busiest rank of a cached round, and its steps."""
    core = 1 << int(math.floor(math.log2(n)))
    steps = int(math.log2(core))
    sent = steps + (1 if n > core else 0)
    return sent, sent * (8 + offer_bytes), steps + (2 if n > core else 0)


def latency_cached(n, offer_bytes, alpha):
    sequence = cached_by_formula(n, offer_bytes)[2]
    return sequence * (alpha + (8 + offer_bytes) / BETA + PER_MESSAGE)


def latency_alltoall(n, slot, alpha):
    return alpha + (n - 1) * slot / BETA + (n - 1) * PER_MESSAGE


def latency_hypercube(n, length, alpha):
    core = 1 << int(math.floor(math.log2(n)))
    steps = int(math.log2(core))
    t = 0.0
    held = 1
    for k in range(steps):
        t += alpha + (12 + held * (8 + length)) / BETA + PER_MESSAGE
        held *= 2
    if n > core:  # fold in, and every message back out
        t += 2 * (alpha + PER_MESSAGE) + (12 + 8 + length + 12 + (n - 1) * (8 + length)) / BETA
    return t


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024,4096,16384")
    parser.add_argument("--measure-up-to", type=int, default=1024)
    args = parser.parse_args()
    first, length = cached_step_message()
    offer = len(cached_offer(0))
    print(f"a ResNet-50 step's message: {first} bytes the first time, {length} bytes cached (161 ids); "
          f"its cached-round offer: {offer} bytes")
    print(f"\n{'N':>6} {'alltoall: msgs':>15} {'bytes':>10} {'hypercube: msgs':>16} {'bytes':>10} "
          f"{'(measured)':>20} {'held per round':>15} {'cached: msgs':>13} {'bytes':>7} {'(measured)':>11} "
          f"{'latency 25us: a2a / cube / cached':>34} {'5us: a2a / cube / cached':>27} "
          f"{'CPU: full / cached':>20} {'tables':>8}")
    for n in (int(x) for x in args.sizes.split(",")):
        slot = _core._slot_sizes(n, [[length] * n])[-1]
        sent, sent_bytes, steps = hypercube_by_formula(n, length, slot)
        c_sent, c_bytes, _ = cached_by_formula(n, offer)
        measured = c_measured = ""
        if n <= args.measure_up_to:
            start = time.perf_counter()
            results = _core._hypercube([bytes(length)] * n, slot)
            assert all(r[1] is None for r in results)
            m_sent = max(r[2] for r in results)
            m_bytes = max(r[3] for r in results)
            measured = f"{m_sent} / {m_bytes} ({time.perf_counter() - start:.1f} s)"
            results = _core._hypercube([cached_offer(r) for r in range(n)], 0, reduce=True)
            assert all(r[1] is None for r in results)
            assert len({bytes(r[0][0]) for r in results}) == 1
            c_measured = f"{max(r[2] for r in results)} / {max(r[3] for r in results)}"
        held = n * length
        a2a = [latency_alltoall(n, slot, a) * 1e6 for a in (25e-6, 5e-6)]
        cube = [latency_hypercube(n, length, a) * 1e6 for a in (25e-6, 5e-6)]
        cached = [latency_cached(n, offer, a) * 1e6 for a in (25e-6, 5e-6)]
        cpu_full, cpu_cached, tables = round_cpu(n)
        print(f"{n:>6} {n - 1:>15} {(n - 1) * slot:>10} {sent:>16} {sent_bytes:>10} {measured:>20} "
              f"{held:>15} {c_sent:>13} {c_bytes:>7} {c_measured:>11} "
              f"{a2a[0]:>12.0f} / {cube[0]:.0f} / {cached[0]:<7.0f} {a2a[1]:>9.0f} / {cube[1]:.0f} / {cached[1]:<7.0f} "
              f"{cpu_full * 1e3:>9.1f} / {cpu_cached * 1e3:.3f} ms {tables / 2**20:>6.1f} MB")
    print("\nbytes: what the busiest rank sends per round (the hypercube's framing included); held: every "
          "rank's message, which every rank receives and decodes each round (a cached round: one combined "
          "offer per step instead); latency in microseconds, without the CPU column; tables: C heap the controller's tables hold after the step was decided once")

if __name__ == "__main__":
    main()
