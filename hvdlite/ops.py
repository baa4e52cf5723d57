"""Collective operations on handles: the asynchronous and in-place forms, barrier and join.

Every function here enqueues work for the native engine of the chosen process set and returns
at once (``_async`` forms, returning a handle for ``poll()`` / ``synchronize()``) or waits for
it. The engine's background thread negotiates with the other ranks, fuses and runs the
collective; waiting releases the GIL. Every collective synchronizes with the other ranks of its
process set, which must all submit it. The differentiable synchronous forms (``allreduce``,
``allgather``, ...) live in ``differentiable.py``.

Names: operations with the same ``name`` on different ranks are matched together. Unnamed
operations get a generated name from their process set's engine (Note [Generated names] in
csrc/engine.h), so they match by call order; when several threads issue unnamed operations
concurrently, give them names.
"""

import torch

from ._runtime import state as _state
from ._runtime.checks import (  # noqa: F401 (also used by other modules as ops.*)
    _ANY_DTYPE, _REDUCIBLE, _SUPPORTED_DTYPE_SET, _WIDENED, _check_name, _check_root, _check_scale,
    _check_splits, _check_tensor, _check_tensors)
from ._runtime.reduce_ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401 (ops.* too)
from ._runtime.reduce_ops import resolve as _resolve_op
from ._runtime.native import _core
from .adasum import adasum
from .exceptions import HvdliteTypeError, HvdliteValueError
from .process_sets import ProcessSet, global_process_set

# Collective kinds of csrc/types.h.
_ALLREDUCE, _ALLGATHER, _BROADCAST, _ALLTOALL, _REDUCESCATTER, _BARRIER, _JOIN = (
    _core.COLLECTIVE_KINDS[name] for name in
    ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join"))


# Note [One handle type]
# A handle is an int, the key of state.handles; its value is a _Pending, whose poll() and
# wait() are all that poll() and synchronize() call. Three kinds of work sit behind a handle,
# each a subclass that says how to wait for it: engine operations with a `finish` that turns
# the engine's outputs into the result (_Pending itself), allreduce_async_'s lean in-place case
# (_InPlace: one core handle, the tensor is the result), and handles made of other handles
# (_Combined: sparse_allreduce_async, Adasum). The classes are slotted and one is made per
# call; the engine's own HandleTable (csrc/tensor_queue.h) holds the core handles.

class _Pending:
    """Operations on one engine: synchronize() returns finish(the engine's outputs), a list of
    (tensor, aux) pairs."""

    __slots__ = ("engine", "core_handles", "finish")

    def __init__(self, engine, core_handles, finish):
        self.engine = engine
        self.core_handles = core_handles
        self.finish = finish

    def poll(self):
        return all(self.engine.poll(h) for h in self.core_handles)

    def wait(self, state):
        try:
            if len(self.core_handles) == 1:
                outputs = [self.engine.wait(self.core_handles[0])]
            else:  # one call, GIL released once, for a whole group
                outputs = self.engine.wait_all(self.core_handles)
        except Exception as exc:
            raise _state.explain(exc, state, self.engine)
        return self.finish(outputs)


class _InPlace(_Pending):
    """allreduce_async_'s common case: one core handle on the global engine, and the tensor,
    reduced in place, is the result."""

    __slots__ = ("tensor",)

    def __init__(self, engine, core, tensor):
        self.engine = engine
        self.core_handles = (core,)
        self.tensor = tensor

    def poll(self):
        return self.engine.poll(self.core_handles[0])

    def wait(self, state):
        try:
            self.engine.wait_done(self.core_handles[0])
        except Exception as exc:
            raise _state.explain(exc, state, self.engine)
        return self.tensor


class CallableHandle(int):
    """The handle of ``sparse_allreduce_async``: an int like every handle (``poll`` and
    ``synchronize`` take it), and, as in horovod.torch, callable: ``handle()`` waits and returns
    the result, like ``synchronize(handle)``."""

    __slots__ = ()

    def __call__(self):
        return synchronize(self)

    def __repr__(self):
        return f"CallableHandle({int(self)})"


class _Combined(_Pending):
    """A handle made of other handles (sparse_allreduce_async; Adasum's, made of none, holds
    results already computed): synchronize() waits for all of them, then returns
    finish(their results)."""

    __slots__ = ("handles",)

    def __init__(self, handles, finish):
        self.handles = handles
        self.finish = finish

    def poll(self):
        return all(poll(h) for h in self.handles)

    def wait(self, state):
        return self.finish(_synchronize_all(self.handles))


def _runtime(fn, process_set):
    """The engine of `process_set` on this rank, or a clear error."""
    state = _state.current()
    if process_set is None or process_set is global_process_set:
        return state, state.sets[0]
    if not isinstance(process_set, ProcessSet):
        raise HvdliteTypeError(f"{fn}: process_set must be a hvdlite.ProcessSet, got {type(process_set).__name__}")
    try:
        runtime = process_set._runtime()
    except ValueError as exc:
        raise HvdliteValueError(f"{fn}: {exc}") from None
    if runtime.engine is None:
        raise HvdliteValueError(f"{fn}: rank {state.topology.rank} is not in {process_set!r}")
    return state, runtime


def _submit(fn, process_set, kind, inputs, outputs, names, finish, op=Sum, root=0, prescale=1.0,
            postscale=1.0, group="", splits=(), wire=None):
    state, runtime = _runtime(fn, process_set)
    single = len(inputs) == 1
    if single:
        if inputs[0].is_cuda and runtime.groups.cuda is None:
            _no_nccl(fn)
    elif any(t.is_cuda for t in inputs):  # (building a torch.device per tensor costs more)
        devices = {t.device.type for t in inputs}
        if runtime.groups.cuda is None:
            _no_nccl(fn)
        if len(devices) > 1:
            raise HvdliteValueError(f"{fn}: a grouped call mixes devices {sorted(devices)}; group tensors per device")
    try:
        # (by position: pybind matches keywords by name on every call, 2 us of a 13 us call here)
        core_handles = runtime.engine.enqueue(kind, inputs, outputs, names, op, root, prescale, postscale, group,
                                              list(splits), wire)
    except Exception as exc:
        raise _state.explain(exc, state, runtime.engine)
    handle = next(state.handle_ids)
    state.handles[handle] = _Pending(runtime.engine, core_handles, finish)
    return handle


def _no_nccl(fn):
    raise HvdliteValueError(f"{fn}: CUDA tensors need an NCCL process group, and this job has none "
                            "(torch.cuda.is_available() was False at hvdlite.init())")


def _group_names(fn, process_set, name, count):
    _, runtime = _runtime(fn, process_set)
    group = name or runtime.engine.new_name("hvdlite.group")  # Note [Generated names]
    cache = _state.process.member_names  # (group, count) -> the members' names: the same every step
    names = cache.get((group, count)) if name else None
    if names is None:
        names = [f"{group}.{i}" for i in range(count)]
        if name and len(cache) < 4096:
            cache[(group, count)] = names
    return group, names


def _first(outputs):
    return outputs[0][0]


def _tensors(outputs):
    return [tensor for tensor, _ in outputs]


def _contiguous_like(tensor):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


# ---- allreduce ---------------------------------------------------------------------------------

def _allreduce(fn, tensors, in_place, average, name, op, prescale_factor, postscale_factor,
               process_set, grouped, wire=None):
    """``wire``: the dtype floating-point tensors travel as, cast by the engine (Note [Casting
    on the wire] in csrc/executor.h); the results keep the tensors' own dtypes."""
    op = _resolve_op(fn, average, op)
    pre = _check_scale(fn, "prescale_factor", prescale_factor)
    post = _check_scale(fn, "postscale_factor", postscale_factor)
    name = _check_name(fn, name)
    if op == Adasum:  # callers cast in Python for Adasum: it is computed at the call
        return _adasum(fn, tensors, in_place, name, pre, post, process_set, grouped)
    originals, tensors = tensors, _widen(tensors)
    outputs = list(tensors) if in_place else [_contiguous_like(t) for t in tensors]
    finish = _narrowing(originals, tensors, _tensors if grouped else _first, in_place)
    if grouped:
        group, names = _group_names(fn, process_set, name, len(tensors))
        return _submit(fn, process_set, _ALLREDUCE, tensors, outputs, names, finish, op=op,
                       prescale=pre, postscale=post, group=group, wire=wire)
    return _submit(fn, process_set, _ALLREDUCE, tensors, outputs, [name], finish, op=op,
                   prescale=pre, postscale=post, wire=wire)


def _adasum(fn, tensors, in_place, name, pre, post, process_set, grouped):
    """op=Adasum (hvdlite/adasum.py): computed at the call, per tensor; the handle then holds the
    results."""
    state, runtime = _runtime(fn, process_set)
    base = name or runtime.engine.new_name("hvdlite.adasum")

    def exchange(rows, splits, part):
        return synchronize(alltoall_async(rows, splits=splits, name=part, process_set=process_set))[0]

    def gather(tensor, part):
        return synchronize(allgather_async(tensor, name=part, process_set=process_set))

    results = []
    for i, t in enumerate(tensors):
        if not t.dtype.is_floating_point:
            raise HvdliteTypeError(f"{fn}: op=Adasum needs floating-point tensors, got {t.dtype}")
        out = adasum(t * pre if pre != 1.0 else t, f"{base}.{i}" if grouped else base, runtime.rank,
                     runtime.size, exchange, gather)
        if post != 1.0:
            out = out * post
        results.append(t.copy_(out) if in_place else out)
    handle = next(state.handle_ids)
    state.handles[handle] = _Combined([], lambda _: results if grouped else results[0])
    return handle


def _widen(tensors):
    """Tensors of a dtype the transport cannot reduce (int16), as the wider dtype (int32)."""
    if not any(t.dtype in _WIDENED for t in tensors):
        return tensors
    return [t.to(_WIDENED[t.dtype]) if t.dtype in _WIDENED else t for t in tensors]


def _narrowing(originals, tensors, finish, in_place):
    """`finish`, followed by casting widened results back (into the originals when in place)."""
    if tensors is originals:
        return finish

    def narrowed(outputs):
        results = finish(outputs)
        single = not isinstance(results, list)
        back = []
        for original, result in zip(originals, [results] if single else results):
            if result.dtype == original.dtype:
                back.append(result)
            elif in_place:
                back.append(original.copy_(result))  # the cast wraps around as int16 arithmetic would
            else:
                back.append(result.to(original.dtype))
        return back[0] if single else back
    return narrowed


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts reducing ``tensor`` over the process set (``op``, default Average) into a new tensor.

    Returns a handle; the input must not change until ``synchronize()``. Every rank of the set
    must submit it. Integer averages truncate toward zero.
    """
    _check_tensor("allreduce_async", tensor, dtypes=_REDUCIBLE)
    return _allreduce("allreduce_async", [tensor], False, average, name, op, prescale_factor,
                      postscale_factor, process_set, grouped=False)


# What a training loop submits per gradient, recognized in one test (see allreduce_async_).
_PLAIN_OPS = frozenset((Sum, Average, Min, Max, Product))


def _plain(tensor, average, name, op, prescale_factor, postscale_factor, process_set):
    """Whether an allreduce call is the common case that the engine's lean bindings take: a plain
    op, no scaling, the global set, a tensor (which the engine checks further)."""
    return (average is None and process_set is global_process_set and (op is None or type(op) is int and op in _PLAIN_OPS)
            and type(prescale_factor) is float and prescale_factor == 1.0 and type(postscale_factor) is float
            and postscale_factor == 1.0 and (name is None or type(name) is str) and isinstance(tensor, torch.Tensor))


def _allreduce_now(tensor, name, op, in_place):
    """A synchronous allreduce of the `_plain` case in one native call (for small tensors and
    repeated allreduces the caller runs the round: Note [A waiting caller runs the round] in
    csrc/round_driver.h): the result, or None when the engine does not take the tensor (the general
    path then does, and says what is wrong)."""
    state = _state.current()
    engine = state.sets[0].engine
    try:
        return engine.allreduce_now(tensor, name or "", Average if op is None else op, in_place)
    except Exception as exc:
        raise _state.explain(exc, state, engine)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """In-place ``allreduce_async``: the result is written into ``tensor``."""
    # The per-gradient call of a training loop, without the general path's checks and lists
    # (they cost about a microsecond per tensor): a plain op, no scaling, the global set; the
    # engine takes the tensor if it is strided, on the CPU and of a dtype the transport reduces
    # (it checks that in C++), else returns -1. Anything else takes the general path, which also
    # says what is wrong. The handle maps to an _InPlace (Note [One handle type]).
    if _plain(tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        state = _state.current()
        engine = state.sets[0].engine
        try:
            core = engine.allreduce_(tensor, name or "", Average if op is None else op)
        except Exception as exc:
            raise _state.explain(exc, state, engine)
        if core >= 0:
            handle = next(state.handle_ids)
            state.handles[handle] = _InPlace(engine, core, tensor)
            return handle
    _check_tensor("allreduce_async_", tensor, dtypes=_REDUCIBLE)
    return _allreduce("allreduce_async_", [tensor], True, average, name, op, prescale_factor,
                      postscale_factor, process_set, grouped=False)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """In-place allreduce: reduces into ``tensor`` and returns it. Synchronizes."""
    if _plain(tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        result = _allreduce_now(tensor, name, op, in_place=True)
        if result is not None:
            return result
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Starts one allreduce for a list of tensors, negotiated and fused as a unit: it runs when
    every member is ready on every rank, or fails as a whole. ``synchronize()`` returns the list.
    """
    tensors = _check_tensors("grouped_allreduce_async", tensors, dtypes=_REDUCIBLE)
    return _allreduce("grouped_allreduce_async", tensors, False, average, name, op,
                      prescale_factor, postscale_factor, process_set, grouped=True)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """In-place ``grouped_allreduce_async``."""
    tensors = _check_tensors("grouped_allreduce_async_", tensors, dtypes=_REDUCIBLE)
    return _allreduce("grouped_allreduce_async_", tensors, True, average, name, op,
                      prescale_factor, postscale_factor, process_set, grouped=True)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """In-place grouped allreduce; returns the (same) tensors. Synchronizes."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def allreduce_on_wire_async_(tensors, wire, name, op, prescale_factor, postscale_factor, process_set,
                             grouped):
    """In-place (grouped) allreduce whose floating-point tensors travel as dtype ``wire``, cast
    by the engine as it copies them (Note [Casting on the wire] in csrc/executor.h):
    DistributedOptimizer's gradients under Compression.fp16 / bf16."""
    fn = "grouped_allreduce_async_" if grouped else "allreduce_async_"
    tensors = _check_tensors(fn, tensors, dtypes=_REDUCIBLE)
    return _allreduce(fn, tensors, True, None, name, op, prescale_factor, postscale_factor, process_set,
                      grouped, wire=wire)


# ---- allgather ---------------------------------------------------------------------------------

def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts concatenating every rank's ``tensor`` along dimension 0, in rank order.

    The first dimension may differ between ranks; the others must agree. A 0-d tensor counts
    as one row. Every rank of the set must submit it.
    """
    _check_tensor("allgather_async", tensor, dtypes=_ANY_DTYPE)
    return _submit("allgather_async", process_set, _ALLGATHER, [tensor], [None],
                   [_check_name("allgather_async", name)], _first)


def _allgather_with_rows_async(tensor, name, process_set):
    """allgather_async whose synchronize() also returns every rank's row count."""
    return _submit("allgather", process_set, _ALLGATHER, [tensor], [None],
                   [_check_name("allgather", name)], lambda outputs: outputs[0])


def _grouped_allgather(fn, tensors, name, process_set, finish):
    tensors = _check_tensors(fn, tensors, dtypes=_ANY_DTYPE)
    group, names = _group_names(fn, process_set, _check_name(fn, name), len(tensors))
    return _submit(fn, process_set, _ALLGATHER, tensors, [None] * len(tensors), names, finish,
                   group=group)


def _grouped_allgather_with_rows_async(tensors, name, process_set):
    """grouped_allgather_async whose synchronize() returns (output, every rank's rows) pairs."""
    return _grouped_allgather("grouped_allgather", tensors, name, process_set, list)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Starts an allgather of each tensor in a list, negotiated as a unit."""
    return _grouped_allgather("grouped_allgather_async", tensors, name, process_set, _tensors)


# ---- sparse allreduce --------------------------------------------------------------------------

def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Starts reducing a sparse COO tensor over the set, as horovod.torch does: every rank's
    indices and values are allgathered, and the result is the sparse sum (divided by the set's
    size for Average), uncoalesced. Only Sum and Average. Returns a handle that is called to
    wait for the result (``handle()``, as in horovod.torch); ``synchronize(handle)`` works too."""
    fn = "sparse_allreduce_async"
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise HvdliteTypeError(f"{fn}: expected a sparse COO tensor, got "
                               f"{type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else tensor.layout}")
    op = _resolve_op(fn, None, op, allowed=(Average, Sum))
    name = _check_name(fn, name) or _runtime(fn, process_set)[1].engine.new_name("hvdlite.sparse")
    t = tensor.coalesce()
    # allgather concatenates along dimension 0: indices travel transposed, one row per entry
    h_indices = allgather_async(t.indices().t().contiguous(), name=f"{name}.indices", process_set=process_set)
    h_values = allgather_async(t.values().contiguous(), name=f"{name}.values", process_set=process_set)
    size = _runtime(fn, process_set)[1].size

    def finish(results):
        indices, values = results
        if op == Average:
            values = values / size
        return torch.sparse_coo_tensor(indices.t(), values, t.shape)

    state = _state.current()
    handle = CallableHandle(next(state.handle_ids))
    state.handles[handle] = _Combined([h_indices, h_values], finish)
    return handle


# ---- broadcast ---------------------------------------------------------------------------------

def _broadcast(fn, tensor, root_rank, name, process_set, in_place):
    _check_tensor(fn, tensor, dtypes=_ANY_DTYPE)
    _, runtime = _runtime(fn, process_set)
    root = _check_root(fn, root_rank, runtime)
    output = tensor if in_place else _contiguous_like(tensor)
    return _submit(fn, process_set, _BROADCAST, [tensor], [output], [_check_name(fn, name)], _first,
                   root=root)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Starts copying ``root_rank``'s ``tensor`` to every rank of the set, into a new tensor."""
    return _broadcast("broadcast_async", tensor, root_rank, name, process_set, False)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place ``broadcast_async``: ``tensor`` is overwritten with the root's."""
    return _broadcast("broadcast_async_", tensor, root_rank, name, process_set, True)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast; returns ``tensor``. Synchronizes."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---- alltoall ----------------------------------------------------------------------------------

def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Starts sending ``splits[r]`` rows of ``tensor`` (dimension 0, in order) to rank r and
    receiving every rank's rows for this rank, concatenated in rank order.

    Without ``splits`` dimension 0 is divided evenly. ``synchronize()`` returns
    ``(output, received_splits)``, as horovod.torch does, with ``received_splits`` of the
    splits tensor's dtype (int32 when ``splits`` is not a tensor).
    """
    fn = "alltoall_async"
    _check_tensor(fn, tensor, min_dim=1, dtypes=_ANY_DTYPE)
    _, runtime = _runtime(fn, process_set)
    values = _check_splits(fn, tensor, splits, runtime.size)
    dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32

    def finish(outputs):
        output, received = outputs[0]
        return output, torch.tensor(received, dtype=dtype)
    return _submit(fn, process_set, _ALLTOALL, [tensor], [None], [_check_name(fn, name)], finish,
                   splits=[values])


# ---- reducescatter -----------------------------------------------------------------------------

def _reducescatter(fn, tensors, name, op, prescale_factor, postscale_factor, process_set, grouped):
    op = _resolve_op(fn, None, op, allowed=(Average, Sum))
    pre = _check_scale(fn, "prescale_factor", prescale_factor)
    post = _check_scale(fn, "postscale_factor", postscale_factor)
    name = _check_name(fn, name)
    originals, tensors = tensors, _widen(tensors)
    finish = _narrowing(originals, tensors, _tensors if grouped else _first, in_place=False)
    if grouped:
        group, names = _group_names(fn, process_set, name, len(tensors))
        return _submit(fn, process_set, _REDUCESCATTER, tensors, [None] * len(tensors), names,
                       finish, op=op, prescale=pre, postscale=post, group=group)
    return _submit(fn, process_set, _REDUCESCATTER, tensors, [None], [name], finish, op=op,
                   prescale=pre, postscale=post)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    """Starts reducing ``tensor`` over the set (Average or Sum) and keeping this rank's rows.

    Dimension 0 is split as evenly as possible, the first ``rows % size`` ranks getting one row
    more. Every rank of the set must submit it with the same shape.
    """
    _check_tensor("reducescatter_async", tensor, min_dim=1, dtypes=_REDUCIBLE)
    return _reducescatter("reducescatter_async", [tensor], name, op, prescale_factor,
                          postscale_factor, process_set, grouped=False)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Starts a reducescatter of each tensor in a list, negotiated and fused as a unit."""
    tensors = _check_tensors("grouped_reducescatter_async", tensors, min_dim=1, dtypes=_REDUCIBLE)
    return _reducescatter("grouped_reducescatter_async", tensors, name, op, prescale_factor,
                          postscale_factor, process_set, grouped=True)


# ---- barrier and join --------------------------------------------------------------------------

def barrier(process_set=global_process_set):
    """Blocks until every rank of the process set has called ``barrier()``."""
    _, runtime = _runtime("barrier", process_set)
    name = runtime.engine.new_name("hvdlite.barrier")
    synchronize(_submit("barrier", process_set, _BARRIER, [torch.empty(0)], [None], [name], _first))


def join(device=-1):
    """Declares that this rank has no more data; returns the rank that joined last.

    Until every rank has joined, a joined rank keeps taking part in the other ranks'
    collectives: it contributes zeros to sums (the op's identity to Min, Max and Product) and no
    rows to alltoall. Averages divide by the size of the set, as horovod.torch and DDP's Join
    do (so with 2 ranks and one joined, the average is t / 2); HVDLITE_JOIN_AVERAGE=contributors
    divides by the ranks that contributed instead. An allgather or broadcast while a rank has
    joined raises MismatchError on the ranks that called it, as in horovod.torch (the job goes
    on). Blocks until all ranks have joined; every rank gets the same answer.
    ``device`` is accepted for horovod.torch compatibility and ignored.
    """
    handle = _submit("join", None, _JOIN, [torch.empty(0)], [None], ["hvdlite.join"],
                     lambda outputs: int(outputs[0][1][0]))
    return synchronize(handle)


# ---- handles -----------------------------------------------------------------------------------

def poll(handle):
    """True when the operation behind ``handle`` has finished (successfully or not)."""
    pending = _state.current().handles.get(handle)
    if pending is None:
        raise HvdliteValueError(f"poll: unknown handle {handle!r} (already synchronized?)")
    return pending.poll()


def _synchronize_all(handles):
    """Synchronizes every handle, then raises the first failure; returns the results in order."""
    results, error = [], None
    for handle in handles:
        try:
            results.append(synchronize(handle))
        except Exception as exc:  # every handle is consumed before raising
            error = error or exc
            results.append(None)
    if error is not None:
        raise error
    return results


def synchronize(handle):
    """Waits for the operation behind ``handle`` and returns its result (GIL released).

    Raises the operation's ``HvdliteError`` (e.g. ``MismatchError`` on every rank involved) if
    it failed. A handle can be synchronized once.
    """
    state = _state.current()
    pending = state.handles.pop(handle, None)
    if pending is None:
        raise HvdliteValueError(f"synchronize: unknown handle {handle!r} (already synchronized?)")
    return pending.wait(state)
