"""hvdlite as a Lightning strategy: ``Trainer(strategy="hvdlite")`` after ``import hvdlite.lightning``.

An optional extra (``pip install hvdlite[lightning]``); nothing else in hvdlite imports it.

Note [Lightning strategy]
The strategy launches nothing: the ranks come from whatever started the processes
(hvdliterun, torchrun, mpirun, srun), which ``hvd.init()`` reads, so the Trainer's ``devices``
and ``num_nodes`` do not decide the world size. At setup every optimizer is wrapped in
``hvd.DistributedOptimizer`` (named parameters, the options given to the strategy) and rank 0's
parameters and optimizer state are broadcast. The learning rate is left as the user set it.

The order inside an optimizer step is what makes the gradients right. Lightning runs the
forward and backward pass inside ``optimizer.step(closure)``, and clips gradients (and, under
a GradScaler, unscales them) right after the closure, before the update. The gradient hooks
start the reductions during backward, so the strategy's closure waits for them
(``synchronize()``) before Lightning touches the gradients, and the update itself then runs
in ``skip_synchronize()``. Gradient accumulation uses Lightning's own ``block_backward_sync``:
its backward passes run in the optimizers' ``no_sync()``, and the pass that steps reduces the
sum, so a last short accumulation window at the end of an epoch is still right.
"""

import contextlib

import torch
from lightning.pytorch.strategies import ParallelStrategy, Strategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import hvdlite as hvd

_OPS = {"mean": "Average", "avg": "Average", "average": "Average", "sum": "Sum", "max": "Max", "min": "Min"}


def _outside_inference(collective, tensor):
    """`collective(tensor)` where inference_mode is on (Lightning's validate, test and
    predict): the engine writes its results from its own thread, outside inference mode, where
    an inference tensor may not be written, so the call runs with inference mode off, on a
    normal copy of the tensor."""
    if not torch.is_inference_mode_enabled():
        return collective(tensor)
    with torch.inference_mode(False):
        return collective(tensor.clone())


def _op(reduce_op):
    """Lightning's reduce op (a string or torch's ReduceOp) as hvdlite's."""
    name = getattr(reduce_op, "name", reduce_op)  # torch.distributed.ReduceOp.SUM -> "SUM"
    key = str(name).lower().rsplit(".", 1)[-1]
    if key not in _OPS:
        raise hvd.HvdliteValueError(f"HvdliteStrategy.reduce: unsupported reduce_op {reduce_op!r} "
                                    f"(one of {', '.join(sorted(_OPS))})", op="reduce")
    return getattr(hvd, _OPS[key])


class _GatherSummingGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        ctx.rank = hvd.rank()
        return hvd.allgather(tensor.detach().unsqueeze(0))

    @staticmethod
    def backward(ctx, grad):
        return hvd.allreduce(grad.contiguous(), op=hvd.Sum)[ctx.rank]


class HvdliteStrategy(ParallelStrategy):
    """Data-parallel training on hvdlite's engine, for ``lightning.pytorch.Trainer``.

    Options as in ``hvd.DistributedOptimizer``: ``compression``, ``op`` (``hvd.Average``,
    ``hvd.Sum`` or ``hvd.Adasum``), ``process_set``, ``sparse_as_dense``,
    ``gradient_predivide_factor``. Note [Lightning strategy] says how a step runs.
    """

    strategy_name = "hvdlite"

    def __init__(self, accelerator=None, parallel_devices=None, checkpoint_io=None, precision_plugin=None,
                 compression=None, op=None, process_set=None, sparse_as_dense=False,
                 gradient_predivide_factor=1.0):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._options = {"compression": compression, "op": op, "process_set": process_set,
                         "sparse_as_dense": sparse_as_dense,
                         "gradient_predivide_factor": gradient_predivide_factor}
        self._we_initialized = False
        self._place = (0, 0, 0, 1)  # rank, local rank, cross rank, size

    # ---- where this process is: hvd.init()'s answer, not the Trainer's devices -----------------

    def _init(self):
        if not hvd.is_initialized():
            hvd.init()
            self._we_initialized = True
        # kept after teardown's shutdown: trainer.global_rank still answers after fit()
        self._place = (hvd.rank(), hvd.local_rank(), hvd.cross_rank(), hvd.size())

    def set_world_ranks(self):
        """Called by Lightning while the Trainer is built: hvd.init() reads the launcher."""
        self._init()
        rank_zero_only.rank = hvd.rank()

    @property
    def global_rank(self):
        return self._place[0]

    @property
    def local_rank(self):
        return self._place[1]

    @property
    def node_rank(self):
        return self._place[2]

    @property
    def world_size(self):
        return self._place[3]

    @property
    def root_device(self):
        if self.parallel_devices and self.parallel_devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def is_distributed(self):
        """Lightning's cue to give each rank its share of the data (a DistributedSampler)."""
        return True

    @property
    def distributed_sampler_kwargs(self):
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self):
        self._init()
        super().setup_environment()

    def model_to_device(self):
        if self.model is not None:
            self.model.to(self.root_device)

    # ---- setup: wrap the optimizers, agree on rank 0's state ----------------------------------

    def setup(self, trainer):
        super().setup(trainer)
        module = self.lightning_module
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        if not self.optimizers:
            return
        named = list(module.named_parameters())
        options = {k: v for k, v in self._options.items() if v is not None}
        wrapped = []
        for optimizer in self.optimizers:
            if isinstance(optimizer, hvd.DistributedOptimizer):  # a later stage (test after fit)
                wrapped.append(optimizer)
                continue
            own = {id(p) for group in optimizer.param_groups for p in group["params"]}
            distributed = hvd.DistributedOptimizer(
                optimizer, named_parameters=[(n, p) for n, p in named if id(p) in own], **options)
            hvd.broadcast_optimizer_state(distributed, root_rank=0)
            wrapped.append(distributed)
        self.optimizers = wrapped  # the LR schedulers keep working: the wrappers share param_groups

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Lightning's accumulation windows: backward passes only accumulate locally."""
        with contextlib.ExitStack() as stack:
            for optimizer in self.optimizers:
                if isinstance(optimizer, hvd.DistributedOptimizer):
                    stack.enter_context(optimizer.no_sync())
            yield None

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        if not isinstance(optimizer, hvd.DistributedOptimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def reduced_closure():
            result = closure()        # forward and backward: the hooks start the reductions
            optimizer.synchronize()   # averaged gradients before clipping or unscaling
            return result

        with optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, reduced_closure, model, **kwargs)

    # ---- collectives Lightning calls ----------------------------------------------------------

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        self._rejoin()
        op = _op(reduce_op)
        return _outside_inference(lambda t: hvd.allreduce(t, op=op), tensor)

    def all_gather(self, tensor, group=None, sync_grads=False):
        """Every rank's ``tensor``, stacked along a new first dimension. With ``sync_grads``
        the gradient of a rank's part is the sum of every rank's gradient of it, as under
        Lightning's DDPStrategy (hvd.allgather's own backward averages, as Horovod's does)."""
        self._rejoin()
        if sync_grads and tensor.requires_grad:
            return _GatherSummingGradients.apply(tensor)
        with torch.no_grad():
            return _outside_inference(lambda t: hvd.allgather(t.unsqueeze(0)), tensor.detach())

    def broadcast(self, obj, src=0):
        self._rejoin()
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name=None):
        self._rejoin()
        if hvd.size() > 1:
            hvd.barrier()

    def _rejoin(self):
        # After teardown (the end of fit()), Lightning may still call a collective, e.g.
        # trainer.save_checkpoint()'s barrier on every rank: hvd.init() again, as the next
        # stage's setup would.
        if not hvd.is_initialized():
            self._init()

    def teardown(self):
        """Leaves nothing running: shuts hvdlite down if the strategy started it."""
        Strategy.teardown(self)
        if self._we_initialized and hvd.is_initialized():
            hvd.shutdown()
            self._we_initialized = False

    @classmethod
    def register_strategies(cls, registry):
        registry.register(cls.strategy_name, cls, description="data-parallel training on hvdlite's engine")


if HvdliteStrategy.strategy_name not in StrategyRegistry:
    HvdliteStrategy.register_strategies(StrategyRegistry)
