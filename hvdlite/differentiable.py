"""The synchronous, out-of-place collectives, differentiable with torch.autograd.

Each forward runs the collective through ``ops`` and waits for it; each backward is itself a
collective, so every rank of the process set must run backward through the same collectives
in the same order (as data-parallel training does). The gradients:

- allreduce: the same allreduce (op and scale factors) of the incoming gradient;
- allgather: this rank's rows of the incoming gradient averaged over ranks (as horovod.torch);
- broadcast: the average of the incoming gradients on the root, zero elsewhere;
- alltoall: the incoming gradient sent back along the received splits;
- reducescatter (and grouped): the allgather of the incoming gradient, times the set's size
  for Sum, as horovod.torch defines it (Note [Reducescatter gradient]).
"""

import torch

from . import basics, ops
from .compression import Compression, engine_wire_dtype
from .process_sets import global_process_set


def _reduced(fn, tensors, name, args, grouped):
    """The allreduce of ``tensors`` (op, scale factors, process set and wire dtype in ``args``)."""
    op, pre, post, process_set, wire = args
    return ops.synchronize(ops._allreduce(fn, tensors, False, None, name, op, pre, post, process_set,
                                          grouped, wire=wire))


class _Allreduce(torch.autograd.Function):
    # The backward of a cast compressed in Python is the same cast, so the gradient travels as
    # the same wire dtype (Note [Casting on the wire] in csrc/executor.h).
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, process_set, wire):
        ctx.args = (op, pre, post, process_set, wire)
        return _reduced("allreduce", [tensor.detach()], name, ctx.args, grouped=False)

    @staticmethod
    def backward(ctx, grad):
        return (_reduced("allreduce", [grad.contiguous()], None, ctx.args, grouped=False),) + (None,) * 6


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, process_set, wire, *tensors):
        ctx.args = (op, pre, post, process_set, wire)
        return tuple(_reduced("grouped_allreduce", [t.detach() for t in tensors], name, ctx.args, grouped=True))

    @staticmethod
    def backward(ctx, *grads):
        reduced = _reduced("grouped_allreduce", [g.contiguous() for g in grads], None, ctx.args, grouped=True)
        return (None,) * 6 + tuple(reduced)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.process_set = process_set
        ctx.shape = tensor.shape
        # The engine reports the rows every rank sent: they locate this rank's gradient slice.
        output, ctx.rows = ops.synchronize(ops._allgather_with_rows_async(tensor.detach(), name,
                                                                          process_set))
        return output

    @staticmethod
    def backward(ctx, grad):
        averaged = ops.synchronize(ops.allreduce_async(grad.contiguous(), None, None, ops.Average,
                                                       1.0, 1.0, ctx.process_set))
        return _own_rows(averaged, ctx.rows, ctx.shape, ctx.process_set), None, None


def _own_rows(gathered, rows, shape, process_set):
    _, runtime = ops._runtime("allgather", process_set)
    start = sum(rows[:runtime.rank])
    return gathered.narrow(0, start, rows[runtime.rank]).reshape(shape)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.process_set = process_set
        ctx.shapes = [t.shape for t in tensors]
        results = ops.synchronize(ops._grouped_allgather_with_rows_async([t.detach() for t in tensors],
                                                                         name, process_set))
        ctx.rows = [rows for _, rows in results]
        return tuple(output for output, _ in results)

    @staticmethod
    def backward(ctx, *grads):
        averaged = ops.synchronize(ops.grouped_allreduce_async(
            [g.contiguous() for g in grads], None, None, ops.Average, 1.0, 1.0, ctx.process_set))
        return (None, None) + tuple(_own_rows(a, rows, shape, ctx.process_set)
                                    for a, rows, shape in zip(averaged, ctx.rows, ctx.shapes))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.args = (root_rank, process_set)
        return ops.synchronize(ops.broadcast_async(tensor.detach(), root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        root_rank, process_set = ctx.args
        averaged = ops.synchronize(ops.allreduce_async(grad.contiguous(), None, None, ops.Average,
                                                       1.0, 1.0, process_set))
        if basics.rank() != root_rank:
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.process_set = process_set
        output, received = ops.synchronize(ops.alltoall_async(tensor.detach(), splits, name, process_set))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        back, _ = ops.synchronize(ops.alltoall_async(grad.contiguous(), ctx.received, None,
                                                     ctx.process_set))
        return back, None, None, None


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, process_set):
        ctx.args = (op, pre, post, process_set)
        return ops.synchronize(ops.reducescatter_async(tensor.detach(), name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, process_set = ctx.args
        gathered = ops.synchronize(ops.allgather_async(grad.contiguous(), None, process_set))
        return _reducescatter_gradient(gathered, op, pre, post, process_set), None, None, None, None, None


def _reducescatter_gradient(gathered, op, pre, post, process_set):
    """Note [Reducescatter gradient]: horovod.torch's rule, so a ported script's gradients keep
    their scale: the allgather of the output gradients, times the set's size for Sum (for
    Average, the allgather itself), times the prescale and postscale factors. That is the set's
    size times the gradient of the sum of every rank's loss."""
    scale = pre * post
    if op == ops.Sum:
        scale *= ops._runtime("reducescatter", process_set)[1].size
    return gathered * scale if scale != 1.0 else gathered


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, process_set, *tensors):
        ctx.args = (op, pre, post, process_set)
        return tuple(ops.synchronize(ops.grouped_reducescatter_async(
            [t.detach() for t in tensors], name, op, process_set, pre, post)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        gathered = ops.synchronize(ops.grouped_allgather_async([g.contiguous() for g in grads], None,
                                                               process_set))
        return (None,) * 5 + tuple(_reducescatter_gradient(g, op, pre, post, process_set) for g in gathered)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduces ``tensor`` over the process set and returns the result (a new tensor).

    ``op`` is Average (default), Sum, Min, Max or Product; ``prescale_factor`` multiplies the
    input before the reduction and ``postscale_factor`` the result after it. Integer averages
    truncate toward zero. ``compression`` casts on the wire. Differentiable. Synchronizes.
    """
    # Nothing to differentiate, nothing compressed, the common case: one native call.
    if (compression is Compression.none and ops._plain(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
            and not (tensor.requires_grad and torch.is_grad_enabled())):
        result = ops._allreduce_now(tensor, name, op, in_place=False)
        if result is not None:
            return result
    ops._check_tensor("allreduce", tensor, dtypes=ops._REDUCIBLE)
    op = ops._resolve_op("allreduce", average, op)
    wire = engine_wire_dtype(compression) if op != ops.Adasum else None
    if wire is not None:  # the engine casts (Note [Casting on the wire] in csrc/executor.h)
        return _Allreduce.apply(tensor, name, op, prescale_factor, postscale_factor, process_set, wire)
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set, None)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduces a list of tensors as one fused operation; returns the list. Differentiable."""
    tensors = ops._check_tensors("grouped_allreduce", tensors, dtypes=ops._REDUCIBLE)
    op = ops._resolve_op("grouped_allreduce", average, op)
    wire = engine_wire_dtype(compression) if op != ops.Adasum else None
    if wire is not None:  # the engine casts (Note [Casting on the wire] in csrc/executor.h)
        return list(_GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set, wire, *tensors))
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set, None,
                                   *[p[0] for p in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenation of every rank's ``tensor`` along dimension 0 (dimension 0 may differ).

    Differentiable. Synchronizes.
    """
    ops._check_tensor("allgather", tensor, dtypes=ops._ANY_DTYPE)
    if not tensor.requires_grad:
        return ops.synchronize(ops.allgather_async(tensor, name, process_set))
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather of each tensor in a list, negotiated as a unit; returns the list.
    Differentiable (each gradient as allgather's). Synchronizes."""
    ops._check_tensors("grouped_allgather", tensors, dtypes=ops._ANY_DTYPE)
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Returns ``root_rank``'s ``tensor`` on every rank (a new tensor). Differentiable."""
    ops._check_tensor("broadcast", tensor, dtypes=ops._ANY_DTYPE)
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends ``splits[r]`` rows of ``tensor`` to rank r; returns the rows received, in rank
    order, and also the received splits (an int32 tensor) when ``splits`` is given.

    Without ``splits``, dimension 0 is divided evenly. Differentiable. Synchronizes.
    """
    ops._check_tensor("alltoall", tensor, min_dim=1, dtypes=ops._ANY_DTYPE)
    if splits is not None:
        return _Alltoall.apply(tensor, splits, name, process_set)
    _, runtime = ops._runtime("alltoall", process_set)
    even = ops._check_splits("alltoall", tensor, None, runtime.size)
    output, _ = _Alltoall.apply(tensor, even, name, process_set)
    return output


def reducescatter(tensor, name=None, compression=Compression.none, op=ops.Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``tensor`` over the set (Average or Sum) and returns this rank's rows of the
    result; dimension 0 is split as evenly as possible. Differentiable. Synchronizes.
    """
    ops._check_tensor("reducescatter", tensor, min_dim=1, dtypes=ops._REDUCIBLE)
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=ops.Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter of each tensor in a list, negotiated and fused as a unit; returns the list.
    Differentiable (each gradient as reducescatter's). Synchronizes."""
    tensors = ops._check_tensors("grouped_reducescatter", tensors, min_dim=1, dtypes=ops._REDUCIBLE)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor, process_set,
                                       *[p[0] for p in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]
