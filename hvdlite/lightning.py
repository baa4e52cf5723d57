"""hvdlite as a Lightning strategy: ``Trainer(strategy="hvdlite")`` and ``Fabric(strategy="hvdlite")``
after ``import hvdlite.lightning``.

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

Fabric's loop is the user's own: ``fabric.backward()`` starts the reductions, and
``optimizer.step()`` waits for them, unless ``fabric.clip_gradients()`` came first, which
waits for them before it clips. ``fabric.no_backward_sync(model)`` is the optimizers'
``no_sync()``, as for the Trainer's accumulation.
"""

import contextlib

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.fabric.strategies import ParallelStrategy as FabricParallelStrategy
from lightning.fabric.strategies import Strategy as FabricStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
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


class _OnHvdlite:
    """What both strategies share: the place from hvd.init(), the optimizer wrapping and the
    collectives. Options as in ``hvd.DistributedOptimizer``: ``compression``, ``op``
    (``hvd.Average``, ``hvd.Sum`` or ``hvd.Adasum``), ``process_set``, ``sparse_as_dense``,
    ``gradient_predivide_factor``."""

    strategy_name = "hvdlite"

    def _own_init(self, compression, op, process_set, sparse_as_dense, gradient_predivide_factor):
        self._options = {"compression": compression, "op": op, "process_set": process_set,
                         "sparse_as_dense": sparse_as_dense,
                         "gradient_predivide_factor": gradient_predivide_factor}
        self._we_initialized = False
        self._place = (0, 0, 0, 1)  # rank, local rank, cross rank, size
        self._wrapped = []          # the DistributedOptimizers this strategy made

    # ---- where this process is: hvd.init()'s answer, not the Trainer's devices -----------------

    def _init(self):
        if not hvd.is_initialized():
            hvd.init()
            self._we_initialized = True
        # kept after teardown's shutdown: trainer.global_rank still answers after fit()
        self._place = (hvd.rank(), hvd.local_rank(), hvd.cross_rank(), hvd.size())

    def _rejoin(self):
        # After teardown (the end of fit()), Lightning may still call a collective, e.g.
        # trainer.save_checkpoint()'s barrier on every rank: hvd.init() again, as the next
        # stage's setup would.
        if not hvd.is_initialized():
            self._init()

    def set_world_ranks(self):
        """Called by Lightning while the Trainer or Fabric is built: hvd.init() reads the launcher."""
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

    def _wrap(self, optimizer, named):
        """`optimizer` as a DistributedOptimizer named by `named` (module.named_parameters()),
        with rank 0's state."""
        if isinstance(optimizer, hvd.DistributedOptimizer):  # a later stage (test after fit)
            return optimizer
        own = {id(p) for group in optimizer.param_groups for p in group["params"]}
        options = {k: v for k, v in self._options.items() if v is not None}
        distributed = hvd.DistributedOptimizer(
            optimizer, named_parameters=[(n, p) for n, p in named if id(p) in own], **options)
        hvd.broadcast_optimizer_state(distributed, root_rank=0)
        self._wrapped.append(distributed)
        return distributed

    @contextlib.contextmanager
    def _no_sync(self):
        with contextlib.ExitStack() as stack:
            for optimizer in self._wrapped:
                stack.enter_context(optimizer.no_sync())
            yield None

    # ---- collectives ---------------------------------------------------------------------------

    def _reduce(self, tensor, reduce_op):
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

    def barrier(self, *args, **kwargs):
        self._rejoin()
        if hvd.size() > 1:
            hvd.barrier()

    def _shutdown(self):
        """Leaves nothing running: shuts hvdlite down if the strategy started it."""
        if self._we_initialized and hvd.is_initialized():
            hvd.shutdown()
            self._we_initialized = False

    @classmethod
    def register_strategies(cls, registry):
        registry.register(cls.strategy_name, cls, description="data-parallel training on hvdlite's engine")


class HvdliteStrategy(_OnHvdlite, ParallelStrategy):
    """Data-parallel training on hvdlite's engine, for ``lightning.pytorch.Trainer``.
    Note [Lightning strategy] says how a step runs."""

    def __init__(self, accelerator=None, parallel_devices=None, checkpoint_io=None, precision_plugin=None,
                 compression=None, op=None, process_set=None, sparse_as_dense=False,
                 gradient_predivide_factor=1.0):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._own_init(compression, op, process_set, sparse_as_dense, gradient_predivide_factor)

    def model_to_device(self):
        if self.model is not None:
            self.model.to(self.root_device)

    def setup(self, trainer):
        super().setup(trainer)
        module = self.lightning_module
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        named = list(module.named_parameters())
        # the LR schedulers keep working: the wrappers share the optimizers' param_groups
        self.optimizers = [self._wrap(optimizer, named) for optimizer in self.optimizers]

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Lightning's accumulation windows: backward passes only accumulate locally."""
        with self._no_sync():
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

    def reduce(self, tensor, group=None, reduce_op="mean"):
        return self._reduce(tensor, reduce_op)

    def teardown(self):
        Strategy.teardown(self)  # not the cluster environment's: hvd.init() did not use it
        self._shutdown()


class _NoSyncControl(_BackwardSyncControl):
    def __init__(self, strategy):
        self._strategy = strategy

    def no_backward_sync(self, module, enabled):
        return self._strategy._no_sync() if enabled else contextlib.nullcontext()


class HvdliteFabricStrategy(_OnHvdlite, FabricParallelStrategy):
    """Data-parallel training on hvdlite's engine, for ``lightning.fabric.Fabric``."""

    def __init__(self, accelerator=None, parallel_devices=None, checkpoint_io=None, precision=None,
                 compression=None, op=None, process_set=None, sparse_as_dense=False,
                 gradient_predivide_factor=1.0):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=None,
                         checkpoint_io=checkpoint_io, precision=precision)
        self._own_init(compression, op, process_set, sparse_as_dense, gradient_predivide_factor)
        self._backward_sync_control = _NoSyncControl(self)

    def module_to_device(self, module):
        module.to(self.root_device)

    def setup_module(self, module):
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        self._module = module
        return module

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        module = self.setup_module(module)
        named = list(module.named_parameters())
        return module, [self._wrap(optimizer, named) for optimizer in optimizers], scheduler

    def setup_optimizer(self, optimizer):
        module = getattr(self, "_module", None)
        return self._wrap(optimizer, list(module.named_parameters()) if module is not None else [])

    def _synchronized(self, optimizer):
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper around ours
        if isinstance(optimizer, hvd.DistributedOptimizer):
            optimizer.synchronize()

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        self._synchronized(optimizer)  # clip the averaged gradients
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module, optimizer, clip_val):
        self._synchronized(optimizer)
        return super().clip_gradients_value(module, optimizer, clip_val)

    def optimizer_step(self, optimizer, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, hvd.DistributedOptimizer) and inner._synchronized:
            with inner.skip_synchronize():  # clip_gradients() has waited for the reductions
                return super().optimizer_step(optimizer, **kwargs)
        return super().optimizer_step(optimizer, **kwargs)

    def all_reduce(self, tensor, group=None, reduce_op="mean"):
        return self._reduce(tensor, reduce_op)

    def teardown(self):
        FabricStrategy.teardown(self)
        self._shutdown()


if HvdliteStrategy.strategy_name not in StrategyRegistry:
    HvdliteStrategy.register_strategies(StrategyRegistry)
if HvdliteFabricStrategy.strategy_name not in FABRIC_REGISTRY:
    HvdliteFabricStrategy.register_strategies(FABRIC_REGISTRY)
