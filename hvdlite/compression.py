"""Gradient compression for allreduce: cast to a narrower float type on the wire.

``Compression.none`` sends tensors as they are; ``Compression.fp16`` and ``Compression.bf16``
cast floating-point tensors to float16 / bfloat16 before the collective and back after it.
Non-floating tensors are never cast. ``Compression.powersgd(rank=...)`` (hvdlite's addition)
sends low-rank factors of each large gradient, with error feedback (Note [PowerSGD] below).
"""

import zlib

import torch

from .exceptions import HvdliteValueError


class Compressor:
    """The compression contract, as in ``horovod.torch``.

    ``compress(tensor)`` returns (the tensor to send, a context); ``decompress(tensor, ctx)``
    turns the reduced tensor back into the gradient's form. Both run on the thread that
    submits or synchronizes the gradient, once per tensor and step, and must give every rank
    the same dtype and shape for the same tensor (the engine checks that the ranks agree).
    Classes with these two static methods work without subclassing (Horovod's custom
    compressors do); ``DistributedOptimizer`` checks only that both exist. A compressor that
    keeps state across steps or takes over the reduction of some gradients subclasses
    ``StatefulCompressor``.
    """

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class StatefulCompressor(Compressor):
    """A compressor with state of its own, held by one ``DistributedOptimizer`` (PowerSGD).

    Besides ``compress`` and ``decompress`` (used for the gradients it does not hold), the
    optimizer calls:

    - ``hold(params, names, optimizer)`` when gradients are submitted (the optimizer's lock
      held): returns (parameters to allreduce as usual, a callback that ``synchronize`` runs to
      reduce the held ones or None, the parameters held);
    - ``settle()`` once every reduction of a step completed; ``forget()`` after a step that
      failed (an elastic reset), so the next one starts clean;
    - ``state_dict()`` / ``load_state_dict(state)`` with the optimizer's own (under the
      ``"powersgd"`` key), and ``shared_state()`` / ``load_shared_state(state)`` from
      ``broadcast_optimizer_state``, for what every rank must hold alike.

    It is not used with ``op=Adasum``.
    """

    def hold(self, params, names, optimizer):
        raise NotImplementedError

    def settle(self):
        pass

    def forget(self):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def shared_state(self):
        return {}

    def load_shared_state(self, state):
        pass


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _CastCompressor(Compressor):
    wire_dtype = None

    @classmethod
    def compress(cls, tensor):
        if tensor.is_floating_point() and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


def engine_wire_dtype(compression):
    """The dtype the engine casts floating-point tensors to itself, for ``Compression.fp16`` and
    ``bf16`` (Note [Casting on the wire] in csrc/executor.h); None for every other compressor,
    a subclass that changes ``compress`` or ``decompress`` included: those cast in Python."""
    cls = compression if isinstance(compression, type) else type(compression)
    if (issubclass(cls, _CastCompressor) and cls.wire_dtype is not None
            and cls.compress.__func__ is _CastCompressor.compress.__func__
            and cls.decompress is _CastCompressor.decompress):
        return cls.wire_dtype
    return None


class FP16Compressor(_CastCompressor):
    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    wire_dtype = torch.bfloat16


class Compression:
    """The compression algorithms, as in ``horovod.torch.Compression``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def powersgd(rank=1, warmup_steps=0, min_compression_rate=2.0, seed=0, error_feedback=True, warm_start=True):
        """Low-rank compression with error feedback (hvdlite's addition; Note [PowerSGD]). One
        instance per DistributedOptimizer: it keeps per-parameter state."""
        return PowerSGD(rank, warmup_steps, min_compression_rate, seed, error_feedback, warm_start)


# Note [PowerSGD]
# A gradient with two or more dimensions is viewed as an n x m matrix M (its first dimension by
# the rest) and sent as two thin factors instead of n * m numbers (Vogels et al., 2019):
#
#     M += error                  error feedback: what earlier steps' approximations left out
#     P = M Q                     n x r; Q (m x r) is kept from the last step (warm start)
#     allreduce P (sum)           one fused allreduce for every compressed gradient
#     P = orthonormal(P)          the same on every rank: every rank holds the same P
#     Q = M^T P                   m x r
#     allreduce Q (sum)           the second fused allreduce, which depends on the first
#     M_hat = P Q^T / size        the average of every rank's M, projected onto span(P)
#     error = M - M_hat           kept per parameter, on this rank
#     grad = M_hat (Average) or M_hat * size (Sum)
#
# So a step makes two dependent fused allreduces of (n + m) * r numbers per matrix. At r =
# min(n, m) span(P) holds every column of the summed M, so M_hat is the exact average (and the
# errors of all ranks sum to zero, so the feedback adds nothing on average).
#
# Which gradients: floating point, two or more dimensions, and a compression rate n * m /
# ((n + m) * r) of at least ``min_compression_rate``; the others (biases, norms, small layers)
# go through the ordinary allreduce as their hooks fire, overlapping backward. Each parameter's
# first ``warmup_steps`` reductions are exact allreduces too. The compressed ones wait until
# ``synchronize()``, where their two rounds run. Every decision depends only on shapes, dtypes
# and how many times the parameter has been reduced, which every rank agrees on.
#
# Q starts from a generator seeded by ``seed`` and the parameter's name, so every rank starts
# from the same Q without communicating. With ``backward_passes_per_step`` > 1 compression runs
# only on the passes that reduce (the accumulated gradient), as the ordinary allreduce does. A
# step whose M_hat is not finite (an fp16 overflow that AMP's scaler will skip) hands the
# non-finite gradient on, so the scaler sees it, but keeps the error and Q of the last finite
# step: an inf is never folded into the error buffer. The error buffers, Qs and counts travel in
# ``DistributedOptimizer.state_dict()`` (key "powersgd"), so checkpoints and elastic resets carry
# them; broadcast_optimizer_state sends the root's counts and Qs (shared_state), so a rank that
# did not load the checkpoint makes the root's warm-up decisions. A step that a change of hosts
# interrupts is run again on state kept as it was, so its counts are undone (forget) unless
# synchronize() completed it (settle): counted twice, warm-up would end a step early. The held
# gradients are listed by name before the two rounds: hooks fire in different orders on ranks
# that used different parameters, and a grouped allreduce pairs its members by position.


class PowerSGD(StatefulCompressor, NoneCompressor):
    """A PowerSGD compressor for one DistributedOptimizer (it keeps per-parameter state). The
    gradients it does not compress go through the ordinary allreduce as they are.

    ``rank``: columns of P and Q; ``warmup_steps``: exact allreduces before compressing a
    parameter; ``min_compression_rate``: gradients that would shrink less go uncompressed;
    ``seed``: where every rank's Q starts; ``error_feedback`` and ``warm_start`` as in the paper
    (both on by default, as in torch's powerSGD_hook).
    """

    def __init__(self, rank=1, warmup_steps=0, min_compression_rate=2.0, seed=0, error_feedback=True,
                 warm_start=True):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise HvdliteValueError(f"Compression.powersgd: rank must be an int >= 1, got {rank!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise HvdliteValueError(f"Compression.powersgd: warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)):
            raise HvdliteValueError("Compression.powersgd: min_compression_rate must be a number, "
                                    f"got {min_compression_rate!r}")
        self.rank = rank
        self.warmup_steps = warmup_steps
        self.min_compression_rate = float(min_compression_rate)
        self.seed = int(seed)
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self._steps = {}   # name -> reductions so far
        self._error = {}   # name -> n x m error buffer (float32, or the gradient's dtype if wider)
        self._q = {}       # name -> m x r
        self._held = []    # (parameter, name) waiting for this step's two rounds
        self._counted = {}  # name -> its count before this step (until the step completes)
        self._owner = None

    def __repr__(self):
        return (f"Compression.powersgd(rank={self.rank}, warmup_steps={self.warmup_steps}, "
                f"min_compression_rate={self.min_compression_rate:g}, seed={self.seed})")

    def compressible(self, param):
        """From the parameter, not its gradient, whose layout (sparse on a rank that used an
        embedding, dense zeros on one that did not) may differ between ranks."""
        if not param.is_floating_point() or param.dim() < 2:
            return False
        n, m = param.shape[0], param.numel() // max(1, param.shape[0])
        r = min(self.rank, n, m)
        return r > 0 and n * m >= self.min_compression_rate * (n + m) * r

    def hold(self, params, names, optimizer):
        """DistributedOptimizer._submit (its lock held): counts one reduction of each parameter
        and keeps the ones to compress. Returns (parameters to send now, finish callback or None,
        the parameters held)."""
        if self._owner is None:
            self._owner = optimizer
        elif self._owner is not optimizer:
            raise RuntimeError("Compression.powersgd(): one instance keeps one optimizer's state; "
                               "create one per DistributedOptimizer")
        send, held = [], []
        for p in params:
            name = names[p]
            done = self._steps.get(name, 0)
            self._counted.setdefault(name, done)
            self._steps[name] = done + 1
            (held if done >= self.warmup_steps and self.compressible(p) else send).append(p)
        if not held:
            return send, None, held
        self._held.extend((p, names[p]) for p in held)
        return send, self._flush, held

    def forget(self):
        """A step that did not complete (elastic reset): its held gradients are dropped and its
        counts undone. After a rank failure the state is restored anyway; after a change of
        hosts it is kept as it was and the step runs again, which must count once."""
        self._held = []
        self._steps.update(self._counted)
        self._counted = {}

    def settle(self):
        """DistributedOptimizer.synchronize(): the step's reductions all completed."""
        self._counted = {}

    def _flush(self, _result=None):
        """The two rounds for every held gradient of this step (from synchronize())."""
        held, self._held = self._held, []
        if not held:
            return
        # Hooks fire in an order that can differ between ranks (a parameter unused on one rank
        # is submitted there only at synchronize()): the grouped allreduces pair members by
        # position, so every rank lists them by name.
        held.sort(key=lambda entry: entry[1])
        optimizer = self._owner
        process_set = optimizer._process_set
        size = process_set.size()
        work = []
        for p, name in held:
            grad = p.grad.to_dense() if p.grad.is_sparse else p.grad  # sparse_as_dense
            n = grad.shape[0]
            wide = torch.promote_types(grad.dtype, torch.float32)
            # M lives in the gradient itself where it is dense and float32 or wider, so a step
            # allocates nothing of the gradient's size (fresh 64 MB tensors cost 20 ms of page
            # faults here); else in a widened copy
            in_place = grad is p.grad and grad.dtype == wide and grad.is_contiguous()
            # (a copy otherwise: a strided float32 gradient's reshape can be a view of it)
            matrix = grad.view(n, -1) if in_place else grad.reshape(n, -1).to(wide, copy=True).contiguous()
            r = min(self.rank, n, matrix.shape[1])
            error = self._error.get(name)
            if self.error_feedback and error is not None:
                matrix.add_(error.to(device=matrix.device, dtype=wide))  # the error itself stays as it was
            q = self._q.get(name) if self.warm_start else None
            if q is None or q.shape != (matrix.shape[1], r):
                q = self._initial_q(name, matrix.shape[1], r, matrix)
            else:
                q = q.to(device=matrix.device, dtype=wide)
            # (Q^T M^T)^T rather than M Q, and (P^T M)^T rather than M^T P below: the same
            # products, 2.7x and 15x faster through this torch's CPU BLAS for a 4096 x 4096 M
            work.append([p, name, matrix, in_place, (q.t() @ matrix.t()).t().contiguous()])
        from . import ops  # not at import: ops' own imports reach the runtime
        ps = ops.grouped_allreduce_([w[4] for w in work], op=ops.Sum, name="hvdlite.powersgd.p",
                                   process_set=process_set)
        for w, p_sum in zip(work, ps):
            w[4] = _orthonormal(p_sum)
        qs = ops.grouped_allreduce_([(w[4].t() @ w[2]).t().contiguous() for w in work], op=ops.Sum,
                                   name="hvdlite.powersgd.q", process_set=process_set)
        average = optimizer._op == ops.Average
        with torch.no_grad():
            for (p, name, matrix, in_place, p_orth), q_sum in zip(work, qs):
                self._finish(p, name, matrix, in_place, p_orth / size, q_sum, 1.0 if average else float(size))

    def _finish(self, p, name, matrix, in_place, factor, q_sum, scale):
        """grad = scale * mean, mean = factor @ q_sum^T (the same on every rank); error = M - mean."""
        finite = bool(torch.isfinite(factor).all()) and bool(torch.isfinite(q_sum).all())
        if not finite or not self.error_feedback:
            # no new error to keep: the result goes straight into M's memory (a non-finite one is
            # handed on for AMP's scaler to see; the error and Q stay those of the last finite step)
            torch.mm(factor * scale, q_sum.t(), out=matrix)
            if finite and _surely_finite(factor, q_sum, matrix):
                self._q[name] = q_sum
            if not in_place:
                _hand_back(p, matrix)
            return
        buffer = self._error.get(name)  # the last error, already added into M
        if buffer is None or buffer.shape != matrix.shape or buffer.dtype != matrix.dtype \
                or buffer.device != matrix.device:
            buffer = torch.empty_like(matrix)
        torch.mm(factor, q_sum.t(), out=buffer)  # the mean
        if not _surely_finite(factor, q_sum, buffer):
            # finite factors whose product overflowed: the non-finite mean is handed on, and the
            # parameter's error (just overwritten in `buffer`) and Q start afresh next step, the
            # same on every rank (they all hold the same mean)
            self._error.pop(name, None)
            self._q.pop(name, None)
            _hand_back(p, buffer)
            return
        self._q[name] = q_sum
        matrix.sub_(buffer)                      # M - mean: the new error, in M's memory
        self._error[name] = matrix
        if scale != 1.0:
            buffer.mul_(scale)
        if in_place:
            p.grad = buffer.view_as(p.grad)       # the two swap roles: no copy
        else:
            _hand_back(p, buffer)

    def _initial_q(self, name, m, r, like):
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))
        return torch.randn(m, r, generator=generator, dtype=torch.float64).to(device=like.device, dtype=like.dtype)

    def state_dict(self):
        return {"steps": dict(self._steps), "error": dict(self._error), "q": dict(self._q)}

    def shared_state(self):
        """What every rank must hold alike (the counts decide warm-up, the Qs are the same on
        every rank); the error buffers are each rank's own. broadcast_optimizer_state sends it."""
        return {"steps": dict(self._steps), "q": {k: v.cpu() for k, v in self._q.items()}}

    def load_shared_state(self, state):
        self._steps = dict(state["steps"])
        self._counted = {}
        self._q = {k: v.clone() for k, v in state["q"].items()}

    def load_state_dict(self, state):
        # copies: the buffers are updated in place from here on
        self._steps = dict(state.get("steps", {}))
        self._error = {k: v.clone() for k, v in state.get("error", {}).items()}
        self._q = {k: v.clone() for k, v in state.get("q", {}).items()}
        self._held = []
        self._counted = {}


def _surely_finite(factor, q_sum, product):
    """Whether factor @ q_sum^T (already in `product`) is finite: a bound from the factors'
    largest entries where that settles it, else a look at the product."""
    bound = float(factor.abs().max()) * float(q_sum.abs().max()) * factor.shape[1]
    return bound < torch.finfo(product.dtype).max or bool(torch.isfinite(product).all())


def _hand_back(p, result):
    """The reduced gradient into p.grad (dense: a sparse_as_dense gradient comes back dense)."""
    if p.grad.is_sparse or p.grad.shape != p.shape:
        p.grad = result.reshape(p.shape).to(p.dtype)
    else:
        p.grad.copy_(result.view_as(p.grad))


def _orthonormal(p):
    """An orthonormal basis of p's columns (n x r), the same on every rank for the same p."""
    if not bool(torch.isfinite(p).all()):
        return p  # the step's result is not finite anyway (Note [PowerSGD])
    return torch.linalg.qr(p, mode="reduced").Q
