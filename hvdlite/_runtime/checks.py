"""Argument checks of the collective operations: a local mistake raises TypeError or ValueError
at the call, naming the function and the argument, before anything reaches the engine.

The common case of each check is one test (a call per tensor costs more than the test); the
slower branches only run to say what is wrong.
"""

import numbers

import torch

from . import state as _state
from .native import _core
from ..exceptions import HvdliteTypeError, HvdliteValueError

# The dtypes the transports carry (Gloo for CPU tensors, NCCL for CUDA ones); the native
# module owns the list, as its lean allreduce path tests it too.
_SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in _core.CARRIED_DTYPES)
_SUPPORTED_DTYPE_SET = frozenset(_SUPPORTED_DTYPES)
# Reduced through int32 and cast back (two's complement: sums wrap as they would in int16).
_WIDENED = {torch.int16: torch.int32}


class _AnyDtype:
    """For collectives that only move bytes (Note [Collectives that move bytes] in
    csrc/backend_c10d.cc): every dtype torch has."""

    def __contains__(self, dtype):
        return True


_ANY_DTYPE = _AnyDtype()
_REDUCIBLE = frozenset(_SUPPORTED_DTYPES) | frozenset(_WIDENED)


def _check_tensor(fn, tensor, what="tensor", min_dim=0, dtypes=_SUPPORTED_DTYPE_SET):
    if (isinstance(tensor, torch.Tensor) and tensor.dtype in dtypes
            and tensor.layout == torch.strided and (tensor.is_cpu or tensor.is_cuda)
            and (min_dim == 0 or tensor.dim() >= min_dim)):
        return  # the common case, in one test; the checks below say what is wrong
    if not isinstance(tensor, torch.Tensor):
        raise HvdliteTypeError(f"{fn}: expected a torch.Tensor for '{what}', got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise HvdliteTypeError(f"{fn}: '{what}' is a {tensor.layout} tensor; only dense (strided) tensors "
                               "are supported (densify sparse tensors with .to_dense())")
    if tensor.dtype not in dtypes:
        supported = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise HvdliteTypeError(f"{fn}: '{what}' has dtype {str(tensor.dtype).replace('torch.', '')}, "
                               f"which hvdlite does not support; supported: {supported}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise HvdliteValueError(f"{fn}: '{what}' is on {tensor.device}; hvdlite supports cpu and cuda tensors")
    if tensor.dim() < min_dim:
        raise HvdliteValueError(f"{fn}: '{what}' must have at least {min_dim} dimension(s), got a "
                                f"{tensor.dim()}-d tensor")


def _check_tensors(fn, tensors, min_dim=0, dtypes=_SUPPORTED_DTYPE_SET):
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise HvdliteTypeError(f"{fn}: expected a non-empty list of tensors, got {type(tensors).__name__}")
    strided, tensor_type = torch.strided, torch.Tensor
    for i, t in enumerate(tensors):
        # _check_tensor's common case inline (a call per tensor costs more than the test);
        # anything else goes through it for the message.
        if not (isinstance(t, tensor_type) and t.dtype in dtypes and t.layout == strided
                and (t.is_cpu or t.is_cuda) and (min_dim == 0 or t.dim() >= min_dim)):
            _check_tensor(fn, t, f"tensors[{i}]", min_dim, dtypes)
    return list(tensors)


def _check_name(fn, name):
    if name is not None and not isinstance(name, str):
        raise HvdliteTypeError(f"{fn}: name must be a str or None, got {type(name).__name__}")
    return name or ""


def _check_scale(fn, arg, value):
    if value == 1.0 and type(value) in (float, int):  # the common case, without ABC checks
        return 1.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HvdliteTypeError(f"{fn}: {arg} must be a real number, got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise HvdliteValueError(f"{fn}: {arg} must be finite, got {value}")
    return value


def _check_root(fn, root_rank, runtime):
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
        raise HvdliteTypeError(f"{fn}: root_rank must be an int, got {type(root_rank).__name__}")
    if runtime.size == _state.current().topology.size and runtime.ranks == list(range(runtime.size)):
        if not 0 <= root_rank < runtime.size:
            raise HvdliteValueError(f"{fn}: root_rank {root_rank} is out of range for a job of {runtime.size} ranks")
        return int(root_rank)
    if root_rank not in runtime.ranks:
        raise HvdliteValueError(f"{fn}: root_rank {root_rank} is not in the process set {runtime.ranks}")
    return runtime.ranks.index(root_rank)


def _check_splits(fn, tensor, splits, size):
    rows = tensor.shape[0]
    if splits is None:
        if rows % size:
            raise HvdliteValueError(f"{fn}: without splits, dimension 0 ({rows}) must divide evenly over "
                                    f"{size} ranks")
        return [rows // size] * size
    if isinstance(splits, torch.Tensor):
        if splits.is_floating_point() or splits.dim() != 1:
            raise HvdliteValueError(f"{fn}: splits must be a 1-d integer tensor or a list of ints")
        splits = splits.tolist()
    try:
        values = [int(s) for s in splits]
        if any(isinstance(s, bool) or int(s) != s for s in splits):
            raise ValueError
    except (TypeError, ValueError):
        raise HvdliteValueError(f"{fn}: splits must be a list of ints, got {splits!r}") from None
    if len(values) != size:
        raise HvdliteValueError(f"{fn}: splits has {len(values)} entries but the process set has {size} ranks")
    if any(v < 0 for v in values):
        raise HvdliteValueError(f"{fn}: splits must not be negative, got {values}")
    if sum(values) != rows:
        raise HvdliteValueError(f"{fn}: splits sum to {sum(values)} but dimension 0 of the tensor is {rows}")
    return values
