"""DistributedOptimizer: averages gradients over all ranks between backward() and step().

The wrapper holds the user's optimizer and shares its ``param_groups``, ``state`` and
``defaults`` (they are the same objects), so LR schedulers, checkpoints and hooks keep working.
A post-accumulate-grad hook on every parameter enqueues the parameter's allreduce as soon as
autograd has written its gradient, so communication overlaps the rest of backward; ``step()``
waits for all of them and then steps the wrapped optimizer.

Threads: hooks run on autograd's thread(s); ``self._lock`` guards the bookkeeping they share
with ``synchronize()``. Waiting happens in ``synchronize()`` on the caller's thread.

Note [Reduction lifecycle]: a parameter is *pending* from the moment its gradient is handed to
the engine (alone, or as part of a group once every member is ready) until ``synchronize()``
has waited for it and written the result back into ``p.grad``. While a parameter is pending its
gradient belongs to the engine: a second backward pass, or ``zero_grad()``, would race with the
reduction, so both raise. ``synchronize()`` first submits every parameter whose hook has not
fired this step (see Note [Unused parameters]), so every rank submits the same names.

Note [Unused parameters]: a parameter that got no gradient on this rank this step (an unused
branch, data-dependent control flow, or fewer backward passes than backward_passes_per_step)
still takes part in the reduction, or the ranks that did compute it would wait forever. Its
contribution is zeros (its existing ``.grad`` if it has one), and afterwards ``p.grad`` holds
the reduced value on every rank. A parameter that no rank used therefore ends the step with a
zero gradient rather than ``None``: plain SGD and SGD with momentum leave it unchanged, exactly
as a single process would, while optimizers that count steps per parameter (Adam) or apply
weight decay treat it as a zero-gradient step. Freeze parameters you never use
(``requires_grad_(False)``) to keep them out entirely.
"""

import contextlib
import dataclasses
import threading
import warnings
import weakref

import torch

from . import ops
from ._runtime import compiled_backward as _compiled_backward
from .basics import split_list
from .compression import Compression, StatefulCompressor, engine_wire_dtype
from .exceptions import HvdliteTypeError, HvdliteValueError, NotInitializedError
from .process_sets import global_process_set


@dataclasses.dataclass
class _Reduction:
    """One submitted collective for one parameter or one group; ``finish`` writes results back."""

    params: list
    handle: object  # engine handle, or None when finish waits for its own
    finish: object  # engine result -> None


def _forwarded(name):
    """A property that reads and writes the wrapped optimizer's own attribute."""
    return property(lambda self: getattr(self._optimizer, name),
                    lambda self, value: setattr(self._optimizer, name, value))


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that ``step()`` uses gradients reduced over all ranks.

    Arguments follow ``horovod.torch.DistributedOptimizer``:

    - ``named_parameters``: ``model.named_parameters()``; names the allreduce of each gradient
      ("grad.<name>") so errors and the timeline name the parameter. Without it, names are
      generated from the position in ``param_groups`` ("grad.group<g>.param<i>"), which is
      stable as long as every rank builds its optimizer the same way.
    - ``compression``: ``Compression.none`` / ``fp16`` / ``bf16`` (the wire type).
    - ``backward_passes_per_step``: gradients of that many backward passes accumulate locally
      before one allreduce.
    - ``op``: ``Average`` (default) or ``Sum``.
    - ``gradient_predivide_factor``: with ``Average``, scale by 1/f before the sum and by f/size
      after it (helps fp16 gradients stay in range).
    - ``groups`` (a list of lists of parameters) or ``num_groups`` (split the parameters into
      that many consecutive groups): each group is reduced as one fused collective, submitted
      once all of its members' gradients are ready.
    - ``sparse_as_dense``: densify sparse gradients and allreduce them; otherwise sparse
      gradients are allgathered and rebuilt as a coalesced sparse tensor.

    ``step()``, ``synchronize()`` and the hooks communicate: every rank must run the same
    number of backward passes and steps. With one rank nothing is communicated.
    """

    def __init__(self, optimizer, named_parameters=None, compression=Compression.none,
                 backward_passes_per_step=1, op=ops.Average, gradient_predivide_factor=1.0,
                 num_groups=0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set):
        # Note: torch.optim.Optimizer.__init__ is deliberately not called: the wrapped optimizer
        # owns param_groups and state, and the properties below hand out its objects.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise HvdliteTypeError("DistributedOptimizer: expected a torch.optim.Optimizer, got "
                                   f"{type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise HvdliteTypeError("DistributedOptimizer: the optimizer is already a DistributedOptimizer")
        if isinstance(groups, int) and not isinstance(groups, bool):
            groups, num_groups = None, groups  # horovod.torch passes num_groups this way too
        _check_options(op, gradient_predivide_factor, backward_passes_per_step, compression)
        process_set = global_process_set if process_set is None else process_set
        self._optimizer = optimizer
        self._compression = compression
        self._wire = engine_wire_dtype(compression) if op != ops.Adasum else None  # Note [Casting on the wire]
        self._op = op
        self._predivide = float(gradient_predivide_factor)
        self._passes_per_step = int(backward_passes_per_step)
        self._sparse_as_dense = bool(sparse_as_dense)
        self._process_set = process_set
        # Note [Adasum optimizer]: with op=Adasum nothing is reduced in backward; step() runs the
        # wrapped optimizer locally and combines the parameters' changes with Adasum, as
        # horovod.torch's Adasum optimizer does.
        self._adasum_op = op == ops.Adasum

        self._given_names = _named_parameter_map(named_parameters)
        self._names = {}            # parameter -> allreduce name
        self._passes = {}           # parameter -> backward passes since its last reduction
        self._sparse_dims = {}      # parameter -> sparse_dim of its last sparse gradient
        self._hook_handles = []
        for g, group in enumerate(optimizer.param_groups):
            self._adopt(g, group["params"], strict=named_parameters is not None)
        self._groups, self._group_of = _plan_groups(self._names, groups, num_groups)

        self._lock = threading.Lock()
        self._pending = {}          # parameter -> _Reduction (Note [Reduction lifecycle])
        self._reductions = []
        self._group_ready = [set() for _ in self._groups]
        self._synchronized = False
        self._should_synchronize = True
        self._no_sync = False
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        _compiled_backward.register(self)

    @property
    def _communicate(self):
        # Read at every use, not at construction: under elastic training the job's size changes
        # between generations while the optimizer lives on.
        size = self._process_set.size()
        return size is not None and size > 1

    @property
    def _adasum(self):
        return self._adasum_op and self._communicate

    @property
    def _reduces_in_backward(self):
        # Note [Compiled backward in buckets]: asked whenever dynamo compiles a frame.
        try:
            return self._communicate and not self._adasum_op
        except NotInitializedError:  # between shutdown() and the next init()
            return False

    def _forget_reductions(self):
        """Drops the reductions of a step that failed (elastic training resets here: their
        engine is gone), so the next step starts clean."""
        with self._lock:
            self._pending.clear()
            self._reductions = []
            self._group_ready = [set() for _ in self._groups]
            self._passes = {p: 0 for p in self._passes}
            self._synchronized = False
            if isinstance(self._compression, StatefulCompressor):
                self._compression.forget()  # Note [PowerSGD]: the held gradients of that step

    # ---- the wrapped optimizer's objects -------------------------------------------------------

    param_groups = _forwarded("param_groups")
    state = _forwarded("state")
    defaults = _forwarded("defaults")

    # horovod.torch's wrapper is a subclass of the wrapped optimizer's class, so user code and
    # libraries that check `isinstance(opt, torch.optim.SGD)` work; this wrapper keeps its own
    # type and reports the wrapped class as __class__, which isinstance() also consults.
    @property
    def __class__(self):
        return type(self._optimizer)

    # The public attributes horovod.torch scripts read.
    @property
    def backward_passes_per_step(self):
        return self._passes_per_step

    @property
    def op(self):
        return self._op

    @property
    def process_set(self):
        return self._process_set

    @property
    def sparse_as_dense(self):
        return self._sparse_as_dense

    @property
    def _parameter_names(self):
        """parameter -> its name (from ``named_parameters``, else "group<g>.param<i>"), unique
        and equal on every rank; horovod.torch's wrapper has this dict and scripts read it."""
        return {p: name[len("grad."):] for p, name in self._names.items()}

    def set_backward_passes_per_step(self, passes):
        """Changes how many backward passes accumulate locally per reduction (as horovod.torch);
        the passes counted so far start again."""
        _check_options(self._op, self._predivide, passes, self._compression)
        with self._lock:
            self._passes_per_step = int(passes)
            self._passes = {p: 0 for p in self._passes}

    def __getattr__(self, name):
        # Only reached when normal lookup fails: anything else belongs to the wrapped optimizer
        # (its hook dictionaries, extra attributes of custom optimizers, ...).
        if name == "_optimizer":
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def __repr__(self):
        return f"DistributedOptimizer({self._optimizer!r})"

    def state_dict(self):
        state = self._optimizer.state_dict()
        if isinstance(self._compression, StatefulCompressor):  # Note [PowerSGD]: error buffers and Qs
            state["powersgd"] = self._compression.state_dict()
        return state

    def load_state_dict(self, state_dict):
        if isinstance(self._compression, StatefulCompressor) and "powersgd" in state_dict:
            state_dict = dict(state_dict)
            self._compression.load_state_dict(state_dict.pop("powersgd"))
        return self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self._optimizer.add_param_group(param_group)
        g = len(self._optimizer.param_groups) - 1
        self._adopt(g, self._optimizer.param_groups[g]["params"], strict=False)

    # ---- the training-loop API -----------------------------------------------------------------

    def step(self, closure=None):
        """Waits for the gradient reductions (unless inside ``skip_synchronize()``), then steps.

        A ``closure`` is evaluated (forward and backward) before the reduction, and the
        wrapped optimizer then steps once without it. Synchronizes with every rank.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adasum:
            self._adasum_step()
            return loss
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after "
                    "optimizer.synchronize(): hvdlite does not reduce the gradients a second time, "
                    "but say what you mean with `with optimizer.skip_synchronize(): "
                    "optimizer.step()` after synchronize()", UserWarning, stacklevel=2)
            else:
                self.synchronize()
        elif self._pending or any(self._group_ready):
            raise RuntimeError(
                "DistributedOptimizer.step() inside skip_synchronize() while the gradients of "
                f"{_describe(self._names, self._busy_params())} are still being reduced: call "
                "optimizer.synchronize() before step() in that block")
        self._synchronized = False
        self._optimizer.step()
        return loss

    def _adasum_step(self):
        """Note [Adasum optimizer]: a local step, then every parameter's change is replaced by
        the Adasum of all ranks' changes. Synchronizes with every rank."""
        params = [p for p in self._names if p.requires_grad]
        starts = [p.detach().clone() for p in params]
        self._optimizer.step()
        deltas = [p.detach() - start for p, start in zip(params, starts)]
        if deltas:
            combined = ops.synchronize(ops.grouped_allreduce_async(deltas, name="hvdlite.adasum.deltas",
                                                                   op=ops.Adasum, process_set=self._process_set))
            with torch.no_grad():
                for p, start, delta in zip(params, starts, combined):
                    p.copy_(start + delta)
        self._synchronized = False

    def synchronize(self):
        """Submits the gradients whose hooks did not fire, waits for every reduction, and
        writes the results into ``p.grad``. Synchronizes with every rank.

        Call it before modifying gradients (e.g. clipping), then call ``step()`` inside
        ``with optimizer.skip_synchronize():``.
        """
        if not self._communicate or self._adasum:
            self._synchronized = True
            return
        with self._lock:
            for p in self._names:
                if p not in self._pending and not self._waiting_in_group(p):
                    if p.grad is None:
                        p.grad = self._zero_gradient(p)  # Note [Unused parameters]
                    self._passes[p] = 0
                    self._ready(p)
            reductions, self._reductions = self._reductions, []
            self._pending.clear()
        error = None
        for reduction in reductions:  # wait for every one before raising the first failure
            try:
                handle = reduction.handle
                reduction.finish(None if handle is None else ops.synchronize(handle))
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        if isinstance(self._compression, StatefulCompressor):
            self._compression.settle()  # Note [PowerSGD]: the step counts from here on
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not reduce: call ``synchronize()`` first yourself."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this block only accumulate gradients locally (as DDP's
        ``no_sync``); the first backward pass after it reduces the accumulated gradient.
        Passes inside the block do not count towards ``backward_passes_per_step``."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def zero_grad(self, set_to_none=True):
        busy = self._busy_params()
        if busy:
            raise RuntimeError(
                f"DistributedOptimizer.zero_grad() was called while the gradients of "
                f"{_describe(self._names, busy)} are being reduced across ranks; zeroing them "
                "now would race with the reduction. Call optimizer.step() (or synchronize()) "
                "after backward() and before zero_grad().")
        self._optimizer.zero_grad(set_to_none=set_to_none)

    # ---- hooks and submission ------------------------------------------------------------------

    def _adopt(self, g, params, strict):
        """Names the parameters of param_groups[g] and registers their hooks."""
        taken = set(self._names.values())
        unnamed = []
        for i, p in enumerate(params):
            if not p.requires_grad or p in self._names:
                continue
            name = self._given_names.get(p)
            if name is None:
                if strict:
                    unnamed.append(f"param_groups[{g}]['params'][{i}] (shape {list(p.shape)})")
                    continue
                name = f"group{g}.param{i}"
            name = "grad." + name
            if name in taken:
                raise HvdliteValueError(f"DistributedOptimizer: two parameters are both named '{name}'")
            taken.add(name)
            self._names[p] = name
            self._passes[p] = 0
            self._hook_handles.append(p.register_post_accumulate_grad_hook(
                _make_hook(weakref.ref(self))))
        if unnamed:
            raise HvdliteValueError(
                "DistributedOptimizer: named_parameters was given, but these parameters of the "
                f"optimizer are not in it: {', '.join(unnamed)}. Pass model.named_parameters() "
                "of the model that owns every parameter of the optimizer.")

    def _on_gradient(self, p):
        """Hook body (autograd's thread): count the pass, submit when it is the k-th."""
        if not self._communicate or self._adasum or p not in self._names:
            return
        if self._no_sync:
            self._synchronized = False  # this gradient changed after any earlier synchronize()
            return
        with self._lock:
            if p in self._pending or self._waiting_in_group(p):
                raise RuntimeError(
                    f"the gradient of '{self._names[p]}' was computed again before step() while "
                    "its reduction is in flight: more backward passes than "
                    f"backward_passes_per_step={self._passes_per_step} per step. Raise "
                    "backward_passes_per_step, wrap the extra passes in optimizer.no_sync(), or "
                    "call step() between them.")
            self._passes[p] += 1
            if self._passes[p] < self._passes_per_step:
                return
            self._passes[p] = 0
            self._ready(p)

    def _waiting_in_group(self, p):
        g = self._group_of.get(p)
        return g is not None and p in self._group_ready[g]

    def _busy_params(self):
        busy = list(self._pending)
        for ready in self._group_ready:
            busy.extend(ready)
        return busy

    def _ready(self, p):
        """p's gradient is final for this step (caller holds the lock): submit it, or its group."""
        self._synchronized = False
        g = self._group_of.get(p)
        if g is None:
            self._submit([p], self._names[p], grouped=False)
            return
        self._group_ready[g].add(p)
        if len(self._group_ready[g]) == len(self._groups[g]):
            self._group_ready[g] = set()
            self._submit(self._groups[g], f"grad.group{g}", grouped=True)

    def _submit(self, params, group_name, grouped):
        dense = []
        for p in params:
            if p.grad.is_sparse and not self._sparse_as_dense:
                self._record(self._submit_sparse(p))
            else:
                dense.append(p)
        if isinstance(self._compression, StatefulCompressor) and dense:  # Note [PowerSGD] in compression.py
            dense, finish, held = self._compression.hold(dense, self._names, self)
            if finish is not None:
                self._record(_Reduction(held, None, finish))
        if not dense:
            return
        sent, contexts = [], []
        for p in dense:
            # sparse_as_dense: reduced dense, handed back sparse (SparseAdam needs it so)
            sparse_dim = p.grad.sparse_dim() if p.grad.is_sparse else None
            if sparse_dim is not None:
                self._sparse_dims[p] = sparse_dim  # an unused step then contributes sparse zeros
            grad = p.grad.to_dense() if sparse_dim is not None else p.grad
            wire, ctx = (grad, None) if self._wire is not None and sparse_dim is None else self._compression.compress(grad)
            sent.append(wire)
            contexts.append((ctx, wire is not p.grad, sparse_dim))
        pre, post = self._scale_factors()
        if self._wire is not None:
            handle = ops.allreduce_on_wire_async_(sent, self._wire, group_name, self._op, pre, post,
                                                  self._process_set, grouped)
        elif not grouped:
            handle = ops.allreduce_async_(sent[0], name=group_name, op=self._op,
                                          prescale_factor=pre, postscale_factor=post,
                                          process_set=self._process_set)
        else:
            handle = ops.grouped_allreduce_async_(sent, name=group_name, op=self._op,
                                                  prescale_factor=pre, postscale_factor=post,
                                                  process_set=self._process_set)
        compression = self._compression

        def finish(_result):
            for p, wire, (ctx, copied, sparse_dim) in zip(dense, sent, contexts):
                if copied:
                    result = compression.decompress(wire, ctx)
                    if sparse_dim is not None:
                        p.grad = result.to_sparse(sparse_dim)
                    elif p.grad.is_sparse or p.grad.shape != result.shape:
                        p.grad = result
                    else:
                        p.grad.copy_(result)

        self._record(_Reduction(dense, handle, finish))

    def _submit_sparse(self, p):
        """A sparse gradient through sparse_allreduce_async (compressed values); the result is
        coalesced and stays sparse, so sparse optimizers (SparseAdam) get what they expect."""
        grad = p.grad.coalesce()
        self._sparse_dims[p] = grad.sparse_dim()
        values, ctx = self._compression.compress(grad.values().contiguous())
        wire = torch.sparse_coo_tensor(grad.indices(), values, grad.shape)
        handle = ops.sparse_allreduce_async(wire, name=self._names[p], op=self._op,
                                            process_set=self._process_set)
        compression = self._compression

        def finish(result):
            result = result.coalesce()
            p.grad = torch.sparse_coo_tensor(result.indices(), compression.decompress(result.values(), ctx),
                                             result.shape).coalesce()

        return _Reduction([p], handle, finish)

    def _zero_gradient(self, p):
        """What a rank contributes for a parameter it has no gradient for: zeros, sparse (no
        entries) when the parameter's gradients have been sparse, so the collective matches."""
        sparse_dim = self._sparse_dims.get(p)
        if sparse_dim is None:
            return torch.zeros_like(p)
        indices = torch.zeros(sparse_dim, 0, dtype=torch.int64, device=p.device)
        values = torch.zeros((0,) + tuple(p.shape[sparse_dim:]), dtype=p.dtype, device=p.device)
        return torch.sparse_coo_tensor(indices, values, p.shape)

    def _record(self, reduction):
        self._reductions.append(reduction)
        for p in reduction.params:
            self._pending[p] = reduction

    def _scale_factors(self):
        # Note: with Average the engine divides by size after the postscale, so 1/f before and f
        # after give f/size in all, as horovod.torch does.
        if self._op == ops.Average and self._predivide != 1.0:
            return 1.0 / self._predivide, self._predivide
        return 1.0, 1.0


def _make_hook(wrapper_ref):
    def hook(p):
        wrapper = wrapper_ref()
        if wrapper is not None:
            wrapper._on_gradient(p)
    return hook


def _remove_hooks(handles):
    for h in handles:
        h.remove()


def _check_options(op, predivide, passes, compression):
    if op not in (ops.Average, ops.Sum, ops.Adasum) or isinstance(op, bool):
        raise HvdliteValueError("DistributedOptimizer: op must be hvdlite.Average, hvdlite.Sum or "
                                f"hvdlite.Adasum, got {op!r}")
    if isinstance(predivide, bool) or not isinstance(predivide, (int, float)) or not predivide > 0:
        raise HvdliteValueError("DistributedOptimizer: gradient_predivide_factor must be a positive "
                                f"number, got {predivide!r}")
    if predivide != 1.0 and op != ops.Average:
        raise HvdliteValueError("DistributedOptimizer: gradient_predivide_factor applies only to "
                                "op=Average")
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise HvdliteValueError("DistributedOptimizer: backward_passes_per_step must be an int >= 1, "
                                f"got {passes!r}")
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise HvdliteTypeError("DistributedOptimizer: compression must be one of hvdlite.Compression.*")
    if isinstance(compression, StatefulCompressor) and op == ops.Adasum:
        raise HvdliteValueError("DistributedOptimizer: Compression.powersgd() works with op=Average or Sum")


def _named_parameter_map(named_parameters):
    """parameter -> name, from (name, parameter) pairs; duplicate names are an error."""
    if named_parameters is None:
        return {}
    pairs = list(named_parameters)
    names, result = set(), {}
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise HvdliteValueError("DistributedOptimizer: named_parameters must be (name, parameter) "
                                    f"pairs such as model.named_parameters(); got {item!r:.80}")
        name, p = item
        if name in names:
            raise HvdliteValueError(f"DistributedOptimizer: named_parameters names '{name}' twice; "
                                    "parameter names must be unique")
        names.add(name)
        result.setdefault(p, name)  # a tied parameter listed twice keeps its first name
    return result


def _plan_groups(names, groups, num_groups):
    """Returns (list of parameter lists, parameter -> group index)."""
    params = list(names)  # insertion order: the order of param_groups
    if groups is not None and num_groups:
        raise HvdliteValueError("DistributedOptimizer: pass groups or num_groups, not both")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise HvdliteValueError("DistributedOptimizer: num_groups must be an int >= 0, "
                                f"got {num_groups!r}")
    if groups is None:
        if not num_groups or not params:
            return [], {}
        planned = split_list(params, min(num_groups, len(params)))
    else:
        planned = []
        seen = set()
        for gi, group in enumerate(groups):
            members = []
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise HvdliteValueError(f"DistributedOptimizer: groups[{gi}] holds a "
                                            f"{type(p).__name__}, expected parameters")
                if p in seen:
                    raise HvdliteValueError(f"DistributedOptimizer: a parameter ('{names.get(p, '?')}') "
                                            "is in more than one group")
                if p not in names:
                    raise HvdliteValueError(f"DistributedOptimizer: groups[{gi}] holds a parameter "
                                            f"(shape {list(p.shape)}) that the optimizer does not train")
                seen.add(p)
                members.append(p)
            if members:
                planned.append(members)
    group_of = {p: g for g, members in enumerate(planned) for p in members}
    return planned, group_of


def _describe(names, params, limit=4):
    shown = [f"'{names.get(p, '?')}'" for p in params[:limit]]
    more = f" and {len(params) - limit} more" if len(params) > limit else ""
    return ", ".join(shown) + more
