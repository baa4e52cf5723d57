"""SyncBatchNorm: batch normalization whose training statistics span every rank's batch.

A drop-in for ``torch.nn.BatchNorm1d/2d/3d`` (one class for inputs of rank 2 to 5), named and
constructed like ``horovod.torch.SyncBatchNorm``. In training, with more than one rank, the mean
and variance of each channel are those of the concatenation of all ranks' batches, so the
result matches plain BatchNorm run in one process on that concatenation. In eval mode, and on a
job of one rank, it is plain BatchNorm.

Note [SyncBatchNorm collectives]
Forward (training, size > 1) runs one allgather: each rank sends, per channel, its element
count, its local mean and its local sum of squared deviations (M2), in float64. Every rank
combines them with the parallel-variance formula
    mean = sum(n_r * mean_r) / N,    M2 = sum(M2_r + n_r * (mean_r - mean)^2)
which, unlike sum/sum-of-squares, does not cancel catastrophically when |mean| >> std, and
weights ranks with different (even zero) batch sizes correctly.
Backward runs one allreduce (Sum) of, per channel, sum(dy) and sum(dy * x_hat), because
    dx = weight * invstd * (dy - sum(dy) / N - x_hat * sum(dy * x_hat) / N)
needs those sums over the global batch. It is skipped when the input needs no gradient (the
same on every rank, as every rank builds the same model). The weight and bias gradients are the
local sums, like any other parameter's: the optimizer's allreduce combines them.
Both collectives are unnamed: layers run in the same order on every rank, in forward and in
backward, so the per-process call counter matches them without a name that would have to be
made identical across ranks.
"""

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from . import basics
from . import ops
from .exceptions import HvdliteValueError

# Half-precision inputs are normalized in float32, like torch's own batch_norm kernels.
_UPCAST = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype):
    return torch.float32 if dtype in _UPCAST else dtype


def _reduce_dims(x):
    """Every dimension but the channel dimension (1)."""
    return [0] + list(range(2, x.dim()))


def _per_channel(t, x):
    """Reshapes a (C,) tensor to broadcast against x of shape (N, C, *)."""
    return t.reshape([1, -1] + [1] * (x.dim() - 2))


def _process_set_size(process_set):
    ranks = getattr(process_set, "ranks", None)
    return basics.size() if ranks is None else len(ranks)


def _global_stats(x, process_set):
    """Global per-channel (mean, biased variance, element count) over all ranks' batches.

    One allgather (see Note [SyncBatchNorm collectives]); synchronizes with every rank.
    """
    channels = x.size(1)
    count = x.numel() // channels if channels else 0
    local = torch.zeros(1, 2 * channels + 1, dtype=torch.float64, device=x.device)
    local[0, 0] = count
    if count > 0:
        var, mean = torch.var_mean(x.to(_compute_dtype(x.dtype)), dim=_reduce_dims(x),
                                   correction=0)
        local[0, 1:channels + 1] = mean
        local[0, channels + 1:] = var.to(torch.float64) * count
    gathered = ops.synchronize(ops.allgather_async(local, process_set=process_set))
    counts = gathered[:, :1]
    means = gathered[:, 1:channels + 1]
    m2s = gathered[:, channels + 1:]
    total = float(counts.sum())
    if total <= 1:
        raise HvdliteValueError(
            f"SyncBatchNorm: expected more than 1 value per channel when training, got "
            f"{int(total)} over all ranks (this rank's input has size {list(x.shape)})")
    mean = (counts * means).sum(0) / total
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return mean, m2 / total, total


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalizes with given global statistics; backward sums gradient terms over ranks."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, total, process_set):
        dtype = _compute_dtype(x.dtype)
        xc = x.to(dtype)
        x_hat = (xc - _per_channel(mean, xc)) * _per_channel(invstd, xc)
        out = x_hat
        if weight is not None:
            out = out * _per_channel(weight.to(dtype), xc) + _per_channel(bias.to(dtype), xc)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = total
        ctx.process_set = process_set
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dtype = _compute_dtype(x.dtype)
        dims = _reduce_dims(x)
        dy = grad_out.to(dtype)
        x_hat = (x.to(dtype) - _per_channel(mean, dy)) * _per_channel(invstd, dy)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * x_hat).sum(dims)
        grad_x = grad_w = grad_b = None
        if need_x:
            local = torch.cat([sum_dy, sum_dy_xhat]).to(torch.float64)
            summed = ops.synchronize(ops.allreduce_async(local, op=ops.Sum, process_set=ctx.process_set))
            glob_dy, glob_dy_xhat = (summed / ctx.total).to(dtype).chunk(2)
            scale = invstd if weight is None else invstd * weight.to(dtype)
            grad_x = _per_channel(scale, dy) * (
                dy - _per_channel(glob_dy, dy) - x_hat * _per_channel(glob_dy_xhat, dy))
            grad_x = grad_x.to(x.dtype)
        if need_w:
            grad_w = sum_dy_xhat.to(weight.dtype)
        if need_b:
            grad_b = sum_dy.to(weight.dtype)  # a bias exists only with a weight (affine)
        return grad_x, grad_w, grad_b, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization with statistics computed over the batches of all ranks.

    Takes inputs of shape (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W), with the
    constructor arguments of ``torch.nn.BatchNorm*d``; ``process_set`` is accepted for
    horovod.torch compatibility. Ranks may hold different batch sizes (even zero): each rank's
    statistics are weighted by its element count.

    In training mode with more than one rank, every forward synchronizes with all ranks (one
    allgather), and so does every backward that computes the input's gradient (one allreduce);
    every rank must therefore run each SyncBatchNorm layer the same number of times, in the
    same order. running_mean / running_var are updated with the global mean and unbiased
    variance, identically on every rank. In eval mode, or on a job of one rank, nothing
    synchronizes and the layer behaves as plain BatchNorm.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if not 2 <= input.dim() <= 5:
            raise HvdliteValueError(f"SyncBatchNorm: expected a 2D to 5D input (N, C, ...), got "
                                    f"{input.dim()}D input of size {list(input.shape)}")
        if input.size(1) != self.num_features:
            raise HvdliteValueError(f"SyncBatchNorm: expected {self.num_features} channels in "
                                    f"dimension 1, got input of size {list(input.shape)}")

    def _momentum_factor(self):
        """The running-stats factor, counting this batch as torch's _BatchNorm does."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    def forward(self, input):
        self._check_input_dim(input)
        factor = self._momentum_factor()
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not (self.training and _process_set_size(self.process_set) > 1):
            track = not self.training or self.track_running_stats
            return F.batch_norm(input, self.running_mean if track else None,
                                self.running_var if track else None, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)

        mean, var, total = _global_stats(input.detach(), self.process_set)
        if self.running_mean is not None:
            with torch.no_grad():
                unbiased = var * (total / (total - 1))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype),
                                                        alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype),
                                                       alpha=factor)
        dtype = _compute_dtype(input.dtype)
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean.to(dtype),
                                            invstd.to(dtype), total, self.process_set)
