"""Note [Compiled backward in buckets]: torch.compile'd models reduce during backward.

Eagerly, autograd writes each parameter's gradient as soon as its layer's backward has run, and
DistributedOptimizer's post-accumulate-grad hook hands it to the engine at once, so the
reductions overlap the rest of backward. A model compiled by torch.compile has one backward
node for the whole graph: every gradient comes out at the end, and nothing overlaps (measured
on the MLP of bench/_common.py: every hook fired in the last 30 ms of a 283 ms backward).

torch already solves this for DDP: while a DDP module runs its forward, dynamo splits the graph
it compiles into buckets of about ``bucket_bytes_cap`` bytes of parameters (the first one 1 MB),
each compiled on its own, so backward runs bucket by bucket and the gradients of the last layers
are written before the first layers' backward starts. Dynamo decides by asking
``DistributedDataParallel._get_active_ddp_module()``, and reads only ``bucket_bytes_cap`` of
what it returns. hvdlite answers that question too: while a DistributedOptimizer that reduces
in backward is alive (more than one rank, not Adasum), ``DistributedDataParallel``'s active
module, when DDP has not set one, is a stand-in (``_state.process.compiled_buckets``) that is
true and has DDP's default cap (25 MB). A real DDP forward still sets and restores its own, so
DDP's buckets apply inside it. With the split, the same MLP's hooks fired at 57, 273 and 315 ms
of its backward.

What it changes: only how graphs compiled while such an optimizer is alive are partitioned, as
for DDP (the same limits apply). torch._dynamo.explain lists the bucket boundaries as
"DDPOptimizer intentional graph-break", as it does for a compiled DDP model; hvdlite's hooks
add no break of their own. ``torch._dynamo.config.optimize_ddp = False`` turns it off, for DDP
and hvdlite alike. A graph compiled before the optimizer existed keeps its single
backward until dynamo recompiles it.
"""

import weakref

from . import state as _state

# DDP's default bucket_cap_mb (25 MiB), which dynamo's split was tuned with.
BUCKET_BYTES = 25 * 1024 * 1024


class _Buckets:
    """What dynamo reads as DDP's active module while a reducing DistributedOptimizer lives."""

    bucket_bytes_cap = BUCKET_BYTES

    def __init__(self):
        self.optimizers = weakref.WeakSet()

    def __bool__(self):
        return any(o._reduces_in_backward for o in list(self.optimizers))


def register(optimizer):
    """Called by every DistributedOptimizer: graphs compiled while one that reduces in
    backward is alive are split into buckets (Note [Compiled backward in buckets])."""
    from torch.nn.parallel import DistributedDataParallel
    process = _state.process
    if process.compiled_buckets is None:
        process.compiled_buckets = _Buckets()
    process.compiled_buckets.optimizers.add(optimizer)
    if DistributedDataParallel._active_ddp_module is None:
        DistributedDataParallel._active_ddp_module = process.compiled_buckets
