"""Hostile input: a seeded, bounded fuzz of the Python API on 2 ranks.

Both ranks draw the same random cases. Some cases are valid (the result is checked against a
reference), some make the ranks disagree (both must raise MismatchError), some pass invalid
arguments on every rank (both must raise TypeError/ValueError at the call). After every few
cases a checked allreduce shows that nothing was corrupted. HVDLITE_FUZZ_CASES sets the count.
"""

import os
import random

import torch

import hvdlite as hvd
from tests.harness import run_ranks

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
          torch.int32, torch.int64]
NAMES = [None, "", "plain", "ünïcødé-名前-🙂", "x" * 10000, "a/b:c.d", " spaced name "]
KINDS = ["allreduce", "allreduce_", "grouped_allreduce", "allgather", "broadcast", "alltoall",
         "reducescatter"]


def _tensor(rng, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 3, shape, generator=g).to(dtype)


def _case(rng, size, index):
    """One random case, identical on every rank: (kind, kwargs builder, flaw)."""
    kind = rng.choice(KINDS)
    dtype = rng.choice(DTYPES)
    ndim = rng.choice([0, 1, 1, 2, 3]) if kind not in ("alltoall", "reducescatter") else rng.choice([1, 2])
    shape = [rng.choice([0, 1, 2, 5]) for _ in range(ndim)]
    if kind in ("alltoall", "reducescatter") and shape[0] == 0:
        shape[0] = size
    flaw = rng.choice(["none"] * 5 + ["mismatch", "bad-arg"])
    # a complex tensor is a bad argument only to reductions: collectives that move bytes take it
    applicable = ["non-tensor", "name-type"] + {
        "allreduce": ["scale", "op", "dtype"], "allreduce_": ["scale", "op", "dtype"],
        "grouped_allreduce": ["scale", "op", "dtype"], "broadcast": ["root"], "alltoall": ["splits"],
        "reducescatter": ["scale", "dtype"]}.get(kind, [])
    name = rng.choice(NAMES)
    if name is not None and name != "":
        name = f"{name}#{index}"  # unique per case, so no name is in flight twice
    return dict(kind=kind, dtype=dtype, shape=shape, flaw=flaw, name=name, seed=index,
                op=rng.choice([hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product]),
                root=rng.randrange(size), pre=rng.choice([1.0, 0.5, 2.0]),
                bad=rng.choice(applicable))


def _run_case(c, rank, size):
    kind, shape, dtype, name = c["kind"], list(c["shape"]), c["dtype"], c["name"]
    if c["flaw"] == "mismatch" and rank == 1:
        # this rank disagrees: another shape (or trailing shape), dtype or op
        if kind in ("allgather", "alltoall") or not shape:
            shape = shape + [1] if kind != "alltoall" else shape
            dtype = torch.float64 if dtype != torch.float64 else torch.float32
        else:
            shape[-1] += 1
    x = _tensor(None, shape, dtype, c["seed"] * 10 + rank)
    bad = c["flaw"] == "bad-arg"
    op = c["op"] if kind in ("allreduce", "allreduce_", "grouped_allreduce") else hvd.Sum
    if bad and c["bad"] == "non-tensor":
        x = x.tolist()
    if bad and c["bad"] == "dtype":
        x = torch.zeros(2, dtype=torch.complex64)
    if bad and c["bad"] == "op":
        op = 42
    pre = float("inf") if bad and c["bad"] == "scale" else c["pre"]
    if bad and c["bad"] == "name-type":
        name = 12345
    root = size + 3 if bad and c["bad"] == "root" else c["root"]
    if kind == "allreduce":
        return hvd.allreduce(x, name=name, op=op, prescale_factor=pre)
    if kind == "allreduce_":
        return hvd.allreduce_(x, name=name, op=op, prescale_factor=pre)
    if kind == "grouped_allreduce":
        return hvd.grouped_allreduce([x, x], name=name, op=op, prescale_factor=pre)
    if kind == "allgather":
        return hvd.allgather(x, name=name)
    if kind == "broadcast":
        return hvd.broadcast(x, root, name=name)
    if kind == "alltoall":
        rows = len(x) if isinstance(x, list) else x.shape[0]
        splits = [rows] + [0] * (size - 1)
        if bad and c["bad"] == "splits":
            splits = [rows + 1] + [0] * (size - 1)
        return hvd.alltoall(x, splits=splits, name=name)
    return hvd.reducescatter(x, name=name, op=hvd.Sum, prescale_factor=pre)


def _fuzz(count):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    rng = random.Random(1234)
    outcomes = []
    for index in range(count):
        c = _case(rng, size, index)
        try:
            out = _run_case(c, rank, size)
            outcomes.append(("ok", out if not isinstance(out, tuple) else out[0]))
        except (TypeError, ValueError) as exc:  # a bad call (also an HvdliteError: a RuntimeError)
            outcomes.append(("local", str(exc)))
        except hvd.HvdliteError as exc:
            outcomes.append((type(exc).__name__, str(exc)))
        if index % 10 == 9:
            check = hvd.allreduce(torch.tensor([float(rank + index)]), op=hvd.Sum, name=f"check.{index}")
            assert check.item() == 2 * index + 1, f"corrupted after case {index}: {check}"
    hvd.shutdown()
    return outcomes


def test_fuzzed_calls_succeed_correctly_or_raise_on_every_rank():
    count = int(os.environ.get("HVDLITE_FUZZ_CASES", "150"))
    per_rank = run_ranks(2, __name__, "_fuzz", count, timeout=180)
    rng = random.Random(1234)
    for index in range(count):
        c = _case(rng, 2, index)
        (kind0, out0), (kind1, out1) = per_rank[0][index], per_rank[1][index]
        what = f"case {index} {c}"
        if c["flaw"] == "bad-arg":
            assert kind0 == kind1 == "local", (what, kind0, kind1, out0, out1)
        elif c["flaw"] == "mismatch":
            assert kind0 == kind1 == "MismatchError", (what, kind0, out0, kind1, out1)
            assert out0 == out1  # the same message on every rank
        else:
            assert kind0 == kind1 == "ok", (what, kind0, out0, kind1, out1)
            _check_value(c, out0, out1)


def _check_value(c, out0, out1):
    """Recomputes the valid case's result without hvdlite."""
    x = [_tensor(None, c["shape"], c["dtype"], c["seed"] * 10 + r) for r in range(2)]
    kind = c["kind"]
    if kind == "allgather":
        expected = [torch.cat([t.reshape(-1) if t.dim() == 0 else t for t in x])] * 2
    elif kind == "broadcast":
        expected = [x[c["root"]]] * 2
    elif kind == "alltoall":
        expected = [torch.cat([x[0], x[1]]), x[0][:0]]
    elif kind == "reducescatter":
        from tests.multirank._reference import reduce_reference
        full = reduce_reference(x, hvd.Sum, prescale=c["pre"])
        rows = full.shape[0]
        base, extra = divmod(rows, 2)
        n0 = base + (1 if extra else 0)
        expected = [full[:n0].to(c["dtype"]), full[n0:].to(c["dtype"])]
    else:
        from tests.multirank._reference import reduce_reference
        full = reduce_reference(x, c["op"], prescale=c["pre"]).to(c["dtype"])
        expected = [[full, full]] * 2 if kind == "grouped_allreduce" else [full] * 2
    from tests.multirank._reference import assert_close
    for rank, (got, want) in enumerate(zip((out0, out1), expected)):
        if isinstance(want, list):
            for g, w in zip(got, want):
                assert_close(g, w, c["dtype"], f"{c} rank {rank}")
        else:
            assert_close(got, want, c["dtype"], f"{c} rank {rank}")
