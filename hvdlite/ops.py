"""Collective operations: synchronous, asynchronous, in-place and grouped forms.

Every function here enqueues work for the native engine and returns at once (the ``_async``
forms) or waits for it (the others). The engine's background thread negotiates with the other
ranks, fuses and runs the collective; waiting releases the GIL. Every collective synchronizes
with the other ranks that submit the same name: all of them must call it.

Names: operations with the same ``name`` on different ranks are matched together. Unnamed
operations get a generated name from a per-process counter, so they match by call order; when
several threads issue unnamed operations concurrently, give them names.
"""

import dataclasses
import numbers

import torch

from . import basics
from .compression import Compression

# Reduce ops, with horovod.torch's values.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

# Collective kinds of csrc/types.h.
_ALLREDUCE, _ALLGATHER, _BROADCAST = 0, 1, 2

# The dtypes the Gloo backend carries; NCCL carries the same for CUDA tensors.
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
                     torch.int8, torch.int32, torch.int64)


@dataclasses.dataclass
class _Pending:
    engine: object
    core_handles: list
    finish: object  # list of engine outputs -> the value synchronize() returns


def _check_tensor(fn, tensor, what="tensor"):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: expected a torch.Tensor for '{what}', got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{fn}: '{what}' is a {tensor.layout} tensor; only dense (strided) tensors "
                        "are supported (densify sparse tensors with .to_dense())")
    if tensor.dtype not in _SUPPORTED_DTYPES:
        supported = ", ".join(str(d).replace("torch.", "") for d in _SUPPORTED_DTYPES)
        raise TypeError(f"{fn}: '{what}' has dtype {str(tensor.dtype).replace('torch.', '')}, "
                        f"which hvdlite does not support; supported: {supported}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{fn}: '{what}' is on {tensor.device}; hvdlite supports cpu and cuda tensors")


def _check_name(fn, name):
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{fn}: name must be a str or None, got {type(name).__name__}")
    return name or ""


def _check_scale(fn, arg, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: {arg} must be a real number, got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{fn}: {arg} must be finite, got {value}")
    return value


def _resolve_op(fn, average, op):
    if average is not None:
        if op is not None:
            raise ValueError(f"{fn}: pass either op= or the deprecated average=, not both")
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, bool) or op not in _OP_NAMES:
        raise ValueError(f"{fn}: op must be one of hvdlite.Average, Sum, Min, Max, Product; got {op!r}")
    if op == Adasum:
        raise ValueError(f"{fn}: op=Adasum is not supported by hvdlite")
    return op


def _check_process_set(fn, process_set):
    from .process_sets import global_process_set
    if process_set is not None and process_set is not global_process_set:
        raise ValueError(f"{fn}: only the global process set is supported so far")


def _check_root(fn, root_rank, size):
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
        raise TypeError(f"{fn}: root_rank must be an int, got {type(root_rank).__name__}")
    if not 0 <= root_rank < size:
        raise ValueError(f"{fn}: root_rank {root_rank} is out of range for a job of {size} ranks")
    return int(root_rank)


def _check_devices(fn, state, tensors):
    devices = {t.device.type for t in tensors}
    if "cuda" in devices and state.groups[2] is None:
        raise ValueError(f"{fn}: CUDA tensors need an NCCL process group, and this job has none "
                         "(torch.cuda.is_available() was False at hvdlite.init())")
    if len(devices) > 1:
        raise ValueError(f"{fn}: a grouped call mixes devices {sorted(devices)}; group tensors per device")


def _submit(fn, kind, inputs, outputs, names, finish, op=Sum, root=0, prescale=1.0, postscale=1.0,
            group=""):
    state = basics._current()
    _check_devices(fn, state, inputs)
    core_handles = state.engine.enqueue(kind, inputs, outputs, names, op, root, prescale, postscale, group, [])
    handle = next(state.handle_ids)
    state.handles[handle] = _Pending(state.engine, core_handles, finish)
    return handle


def _group_names(state, name, count):
    group = name or f"hvdlite.group.{next(state.group_ids)}"
    return group, [f"{group}.{i}" for i in range(count)]


def _first(outputs):
    return outputs[0][0]


def _tensors(outputs):
    return [tensor for tensor, _ in outputs]


# ---- allreduce ---------------------------------------------------------------------------------

def _allreduce_submit(fn, tensor, output, average, name, op, prescale_factor, postscale_factor,
                      process_set, finish=_first):
    _check_tensor(fn, tensor)
    _check_process_set(fn, process_set)
    op = _resolve_op(fn, average, op)
    pre = _check_scale(fn, "prescale_factor", prescale_factor)
    post = _check_scale(fn, "postscale_factor", postscale_factor)
    if output is None:
        output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _submit(fn, _ALLREDUCE, [tensor], [output], [_check_name(fn, name)], finish, op=op,
                   prescale=pre, postscale=post)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None):
    """Starts reducing ``tensor`` over all ranks (``op``, default Average) into a new tensor.

    Returns a handle for ``poll()`` / ``synchronize()``; the input must not change until then.
    Synchronizes with every rank (each must submit the same name).
    """
    return _allreduce_submit("allreduce_async", tensor, None, average, name, op, prescale_factor,
                             postscale_factor, process_set)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Reduces ``tensor`` over all ranks and returns the result (a new tensor).

    ``op`` is Average (default), Sum, Min, Max or Product; ``prescale_factor`` multiplies the
    input before the reduction and ``postscale_factor`` the result after it. Integer averages
    truncate toward zero. ``compression`` casts on the wire (see ``Compression``).
    Synchronizes with every rank.
    """
    _check_tensor("allreduce", tensor)
    compressed, ctx = compression.compress(tensor)
    handle = _allreduce_submit("allreduce", compressed, None, average, name, op, prescale_factor,
                               postscale_factor, process_set)
    return compression.decompress(synchronize(handle), ctx)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None):
    """In-place ``allreduce_async``: the result is written into ``tensor``."""
    _check_tensor("allreduce_async_", tensor)
    return _allreduce_submit("allreduce_async_", tensor, tensor, average, name, op, prescale_factor,
                             postscale_factor, process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    """In-place ``allreduce``: reduces into ``tensor`` and returns it. Synchronizes."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def _grouped_allreduce_submit(fn, tensors, in_place, average, name, op, prescale_factor,
                              postscale_factor, process_set):
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(f"{fn}: expected a non-empty list of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        _check_tensor(fn, t, f"tensors[{i}]")
    _check_process_set(fn, process_set)
    op = _resolve_op(fn, average, op)
    pre = _check_scale(fn, "prescale_factor", prescale_factor)
    post = _check_scale(fn, "postscale_factor", postscale_factor)
    state = basics._current()
    group, names = _group_names(state, _check_name(fn, name), len(tensors))
    outputs = list(tensors) if in_place else [
        torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return _submit(fn, _ALLREDUCE, list(tensors), outputs, names, _tensors, op=op, prescale=pre,
                   postscale=post, group=group)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=None):
    """Starts one allreduce for a list of tensors, negotiated and fused as a unit.

    ``synchronize()`` on the handle returns the list of results. Synchronizes with every rank.
    """
    return _grouped_allreduce_submit("grouped_allreduce_async", tensors, False, average, name, op,
                                     prescale_factor, postscale_factor, process_set)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """Reduces a list of tensors as one fused operation and returns the list of results."""
    if isinstance(tensors, (list, tuple)):
        for i, t in enumerate(tensors):
            _check_tensor("grouped_allreduce", t, f"tensors[{i}]")
        pairs = [compression.compress(t) for t in tensors]
        sent = [p[0] for p in pairs]
    else:
        pairs, sent = None, tensors
    results = synchronize(_grouped_allreduce_submit(
        "grouped_allreduce", sent, False, average, name, op, prescale_factor, postscale_factor,
        process_set))
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, pairs)]


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None):
    """In-place ``grouped_allreduce_async``."""
    return _grouped_allreduce_submit("grouped_allreduce_async_", tensors, True, average, name, op,
                                     prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=None):
    """In-place ``grouped_allreduce``; returns the (same) tensors. Synchronizes."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# ---- allgather ---------------------------------------------------------------------------------

def allgather_async(tensor, name=None, process_set=None):
    """Starts concatenating every rank's ``tensor`` along dimension 0 (rank order).

    The first dimension may differ between ranks; the others must agree. A 0-d tensor counts
    as one row. Synchronizes with every rank.
    """
    _check_tensor("allgather_async", tensor)
    _check_process_set("allgather_async", process_set)
    return _submit("allgather_async", _ALLGATHER, [tensor], [None],
                   [_check_name("allgather_async", name)], _first)


def allgather(tensor, name=None, process_set=None):
    """Concatenation of every rank's ``tensor`` along dimension 0. Synchronizes."""
    _check_tensor("allgather", tensor)
    _check_process_set("allgather", process_set)
    return synchronize(_submit("allgather", _ALLGATHER, [tensor], [None],
                               [_check_name("allgather", name)], _first))


# ---- broadcast ---------------------------------------------------------------------------------

def _broadcast_submit(fn, tensor, root_rank, name, process_set, in_place):
    _check_tensor(fn, tensor)
    _check_process_set(fn, process_set)
    root = _check_root(fn, root_rank, basics.size())
    output = tensor if in_place else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return _submit(fn, _BROADCAST, [tensor], [output], [_check_name(fn, name)], _first, root=root)


def broadcast_async(tensor, root_rank, name=None, process_set=None):
    """Starts copying ``root_rank``'s ``tensor`` to every rank, into a new tensor."""
    return _broadcast_submit("broadcast_async", tensor, root_rank, name, process_set, False)


def broadcast(tensor, root_rank, name=None, process_set=None):
    """Returns ``root_rank``'s ``tensor`` on every rank (a new tensor). Synchronizes."""
    return synchronize(_broadcast_submit("broadcast", tensor, root_rank, name, process_set, False))


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    """In-place ``broadcast_async``: ``tensor`` is overwritten with the root's."""
    return _broadcast_submit("broadcast_async_", tensor, root_rank, name, process_set, True)


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """In-place ``broadcast``; returns ``tensor``. Synchronizes."""
    return synchronize(_broadcast_submit("broadcast_", tensor, root_rank, name, process_set, True))


# ---- handles -----------------------------------------------------------------------------------

def poll(handle):
    """True when the operation behind ``handle`` has finished (successfully or not)."""
    pending = basics._current().handles.get(handle)
    if pending is None:
        raise ValueError(f"poll: unknown handle {handle!r} (already synchronized?)")
    return all(pending.engine.poll(h) for h in pending.core_handles)


def synchronize(handle):
    """Waits for the operation behind ``handle`` and returns its result (GIL released).

    Raises the operation's ``HvdliteError`` (e.g. ``MismatchError`` on every rank involved) if
    it failed. A handle can be synchronized once.
    """
    pending = basics._current().handles.pop(handle, None)
    if pending is None:
        raise ValueError(f"synchronize: unknown handle {handle!r} (already synchronized?)")
    outputs, error = [], None
    for core_handle in pending.core_handles:
        try:
            outputs.append(pending.engine.wait(core_handle))
        except Exception as exc:  # wait for every member before raising the first failure
            error = error or exc
            outputs.append((None, None))
    if error is not None:
        raise error
    return pending.finish(outputs)
