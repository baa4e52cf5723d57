"""Helpers built on the collectives: broadcast model and optimizer state, exchange objects.

Every function here is collective: each rank must call it, in the same order, with the same
root. Tensors move through the engine's broadcast/allgather (fused into few rounds); Python
objects are pickled into uint8 tensors.
"""

import collections.abc
import io
import numbers
import pickle

import torch

from . import basics, ops
from .compression import StatefulCompressor
from .process_sets import global_process_set
from .exceptions import HvdliteTypeError, HvdliteValueError, ObjectPicklingError



def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Overwrites, in place, every rank's tensors with ``root_rank``'s. Synchronizes.

    ``params`` is a ``state_dict()`` (a mapping name -> tensor, taken in sorted name order) or
    an iterable of (name, tensor) pairs such as ``model.named_parameters()``. All tensors are
    submitted at once, so the engine fuses them into as few broadcasts as it can.
    """
    if isinstance(params, collections.abc.Mapping):
        items = sorted(params.items())
    elif isinstance(params, collections.abc.Iterable):
        items = list(params)
    else:
        raise HvdliteValueError("broadcast_parameters: expected a state_dict or (name, tensor) pairs, "
                                f"got {type(params).__name__}")
    root = _check_root("broadcast_parameters", root_rank)
    seen, direct, pickled = set(), [], []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise HvdliteValueError("broadcast_parameters: expected (name, tensor) pairs, got "
                                    f"{item!r:.80}")
        name, tensor = item
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise HvdliteTypeError(f"broadcast_parameters: '{name}' is a {type(tensor).__name__}, "
                                   "expected a tensor")
        if name in seen:
            raise HvdliteValueError(f"broadcast_parameters: the name '{name}' appears twice")
        seen.add(name)
        (direct if _engine_carries(tensor) else pickled).append((name, tensor.detach()))
    handles = [ops.broadcast_async_(t, root, name=f"broadcast_parameters.{name}",
                                    process_set=process_set) for name, t in direct]
    ops._synchronize_all(handles)
    if pickled:  # dtypes the engine does not carry (bool, int16, complex, sparse): by value
        mine = {n: t.cpu() for n, t in pickled} if basics.rank() == root else None
        values = broadcast_object(mine, root, name="broadcast_parameters.pickled",
                                  process_set=process_set)
        with torch.no_grad():
            for name, t in pickled:
                t.copy_(values[name])


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set):
    """Makes every rank's optimizer state and hyperparameters equal to ``root_rank``'s, in
    place. Synchronizes.

    Works when only the root has state (for example after loading a checkpoint there): the
    other ranks build the same state entries from the root's description and receive their
    values; no optimizer step is taken, so step counts are exactly the root's. When no rank has
    state yet, nothing but the (equal) hyperparameters is exchanged. Hyperparameters of every
    param group (``lr``, ``momentum``, ``betas``, ...) are set to the root's; state entries the
    root does not have are removed. ``optimizer`` may be a ``DistributedOptimizer``. ``model``
    is accepted as horovod.torch accepts it; hvdlite needs no model (nor a dummy step) to build
    the state, so it is not used.
    """
    root = _check_root("broadcast_optimizer_state", root_rank)
    is_root = basics.rank() == root
    params = [p for group in optimizer.param_groups for p in group["params"]]
    layout = [len(group["params"]) for group in optimizer.param_groups]
    shapes = [tuple(p.shape) for p in params]
    description = _describe_state(optimizer, params) if is_root else None
    description = broadcast_object(description, root, name="broadcast_optimizer_state.layout",
                                   process_set=process_set)

    problem = None
    if description["layout"] != layout or description["shapes"] != shapes:
        problem = (f"its optimizer has param groups of sizes {layout} (shapes {shapes}) while "
                   f"root {root} has {description['layout']} (shapes {description['shapes']})")
    problems = allgather_object((basics.rank(), problem), name="broadcast_optimizer_state.check",
                                process_set=process_set)
    bad = [(r, msg) for r, msg in problems if msg]
    if bad:
        raise HvdliteValueError("broadcast_optimizer_state: rank " + "; rank ".join(
            f"{r}: {msg}" for r, msg in bad))

    if not description["state"]:
        # As horovod.torch leaves them (it builds the state with a step on zero gradients):
        # every trainable parameter without a gradient gets a zero one, frozen ones keep None.
        _zero_missing_gradients(optimizer, params)
    handles = []
    for index, entry in description["state"].items():
        p = params[index]
        if not is_root:
            optimizer.state[p] = _build_entry(optimizer.state.get(p, {}), entry, p)
        for key, spec in entry.items():
            if spec[0] == "tensor":
                handles.append(ops.broadcast_async_(
                    optimizer.state[p][key], root, name=f"broadcast_optimizer_state.{index}.{key}",
                    process_set=process_set))
    if not is_root:
        keep = {params[i] for i in description["state"]}
        for p in params:
            if p not in keep and p in optimizer.state:
                del optimizer.state[p]
        for group, hyper in zip(optimizer.param_groups, description["hyper"]):
            for key, value in hyper.items():
                _set_hyperparameter(group, key, value)
    ops._synchronize_all(handles)
    compression = getattr(optimizer, "_compression", None)
    if isinstance(compression, StatefulCompressor):  # Note [PowerSGD]: the root's counts and Qs
        shared = broadcast_object(compression.shared_state() if is_root else None, root,
                                  name="broadcast_optimizer_state.powersgd", process_set=process_set)
        compression.load_shared_state(shared)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Returns ``root_rank``'s ``obj`` on every rank (pickled; the root gets its own object
    back). Synchronizes: the size goes first, then the bytes.

    If the root cannot pickle ``obj``, every rank raises ``ObjectPicklingError`` naming the root
    and the reason (Note [Pickling failures travel])."""
    root = _check_root("broadcast_object", root_rank)
    name = name or "broadcast_object"
    if basics.rank() == root:
        payload, failed = _to_bytes_or_reason(obj)
        length = torch.tensor([-payload.numel() if failed else payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    ops.broadcast_(length, root, name=name + ".size", process_set=process_set)
    if basics.rank() != root:
        payload = torch.empty(abs(int(length.item())), dtype=torch.uint8)
    ops.broadcast_(payload, root, name=name + ".bytes", process_set=process_set)
    if int(length.item()) < 0:
        raise _pickling_error("broadcast_object", name, {root: _reason(payload)})
    return obj if basics.rank() == root else _from_bytes(payload)


def allgather_object(obj, name=None, process_set=global_process_set):
    """Returns the list of every rank's ``obj`` (of every rank in ``process_set``), in rank
    order (pickled). Synchronizes.

    If any rank cannot pickle its ``obj``, every rank raises ``ObjectPicklingError`` naming
    those ranks and the reasons (Note [Pickling failures travel])."""
    name = name or "allgather_object"
    payload, failed = _to_bytes_or_reason(obj)
    size = -payload.numel() if failed else payload.numel()
    h_sizes = ops.allgather_async(torch.tensor([size], dtype=torch.int64),
                                  name=name + ".sizes", process_set=process_set)
    h_bytes = ops.allgather_async(payload, name=name + ".bytes", process_set=process_set)
    sizes, data = ops._synchronize_all([h_sizes, h_bytes])
    pieces, start = [], 0
    for size in sizes.tolist():
        pieces.append((size < 0, data[start:start + abs(size)]))
        start += abs(size)
    ranks = ops._runtime("allgather_object", process_set)[1].ranks
    failures = {ranks[i]: _reason(piece) for i, (bad, piece) in enumerate(pieces) if bad}
    if failures:
        raise _pickling_error("allgather_object", name, failures)
    return [_from_bytes(piece) for _, piece in pieces]


# ---- helpers -----------------------------------------------------------------------------------

def _check_root(fn, root_rank):
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
        raise HvdliteTypeError(f"{fn}: root_rank must be an int, got {type(root_rank).__name__}")
    if not 0 <= root_rank < basics.size():
        raise HvdliteValueError(f"{fn}: root_rank {root_rank} is out of range for a job of "
                                f"{basics.size()} ranks")
    return int(root_rank)


def _engine_carries(tensor):
    """What broadcast_parameters and broadcast_optimizer_state send through the engine; other
    tensors (bool, int16, complex, sparse) are pickled."""
    return tensor.layout == torch.strided and tensor.dtype in ops._SUPPORTED_DTYPE_SET


# Note [Pickling failures travel]
# An object that cannot be pickled is a local error on one rank, but the other ranks are
# already waiting in the same collective: raising only there would leave them waiting until the
# stall check gives up. So the rank sends the reason in place of the bytes, marked by a
# negative length, and every rank raises the same error at once, naming the rank(s).


def _to_bytes_or_reason(obj):
    """(payload, False), or (the reason pickling failed as utf-8 bytes, True)."""
    try:
        return _to_bytes(obj), False
    except Exception as exc:  # pickle raises PicklingError, TypeError, AttributeError, ...
        reason = f"{type(exc).__name__}: {exc}"[:2000]
        return torch.frombuffer(bytearray(reason.encode(errors="replace")), dtype=torch.uint8), True


def _reason(payload):
    return payload.numpy().tobytes().decode(errors="replace")


def _pickling_error(fn, name, failures):
    described = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
    return ObjectPicklingError(f"{fn} '{name}': could not pickle the object on {described}",
                               op=fn, tensor_name=name, ranks=sorted(failures), reason=described)


def _zero_missing_gradients(optimizer, params):
    sparse = isinstance(getattr(optimizer, "_optimizer", optimizer), torch.optim.SparseAdam)
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p).to_sparse() if sparse else torch.zeros_like(p)


def _to_bytes(obj):
    # cloudpickle, when installed, carries lambdas and local classes, as horovod.torch does
    try:
        import cloudpickle
    except ImportError:
        cloudpickle = None
    buffer = io.BytesIO()
    (cloudpickle or pickle).dump(obj, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(tensor):
    return pickle.loads(tensor.numpy().tobytes())


def _describe_state(optimizer, params):
    """The root's state as a picklable description: tensors by shape/dtype/place (their values
    travel by broadcast), everything else by value."""
    state = {}
    for index, p in enumerate(params):
        entry = optimizer.state.get(p)
        if not entry:
            continue
        described = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and _engine_carries(value):
                described[key] = ("tensor", tuple(value.shape), value.dtype,
                                  value.device == p.device)
            elif isinstance(value, torch.Tensor):
                described[key] = ("value", value.detach().cpu(), value.device.type != "cpu")
            else:
                described[key] = ("value", value, False)
        state[index] = described
    hyper = [{k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
              for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"layout": [len(g["params"]) for g in optimizer.param_groups],
            "shapes": [tuple(p.shape) for p in params], "state": state, "hyper": hyper}


def _build_entry(existing, described, p):
    """A non-root rank's state entry for ``p`` in the root's layout; tensors that already have
    the right shape, dtype and place are reused (their values are overwritten by broadcast)."""
    entry = {}
    for key, spec in described.items():
        if spec[0] == "tensor":
            _, shape, dtype, on_param_device = spec
            device = p.device if on_param_device else torch.device("cpu")
            old = existing.get(key)
            if (isinstance(old, torch.Tensor) and tuple(old.shape) == shape and old.dtype == dtype
                    and old.device == device):
                entry[key] = old
            else:
                entry[key] = torch.empty(shape, dtype=dtype, device=device)
        else:
            _, value, on_param_device = spec
            entry[key] = value.to(p.device) if on_param_device else value
    return entry


def _set_hyperparameter(group, key, value):
    current = group.get(key)
    if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor) \
            and current.shape == value.shape:
        with torch.no_grad():
            current.copy_(value)  # keep tensor hyperparameters (capturable lr) in place
    else:
        group[key] = value
