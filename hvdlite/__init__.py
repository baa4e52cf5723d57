"""hvdlite: Horovod-style data-parallel training for PyTorch over torch.distributed.

``import hvdlite as hvd`` gives the names of ``horovod.torch``.

Note [Lazy exports]
Importing this package imports neither torch nor the native extension: each public name is
loaded from its submodule on first use (PEP 562 module ``__getattr__``), so the hvdliterun
launcher, which lives in hvdlite.runner and needs neither, starts in a fraction of a second
instead of the seconds torch takes. ``hvd.allreduce(...)``, ``from hvdlite import X`` and
``dir(hvdlite)`` behave as if everything were imported eagerly. A missing or broken extension
raises basics.py's ImportError, which says how to build it, at the first name that needs it.
"""
import importlib

__version__ = "0.1.0"

# Public name -> submodule that defines it. Add a name here to export it.
_EXPORTS = {
    # basics
    **dict.fromkeys(
        ["ccl_built", "check_extension", "cross_rank", "cross_size", "cuda_built", "ddl_built",
         "gloo_built", "gpu_available", "split_list",
         "gloo_enabled", "init", "is_homogeneous", "rocm_built", "start_timeline", "stop_timeline",
         "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
         "mpi_threads_supported", "nccl_built", "rank", "shutdown", "size"], "basics"),
    "Compression": "compression",
    **dict.fromkeys(["flight_record", "straggler_report"], "insight"),
    **dict.fromkeys(
        ["allgather", "allreduce", "alltoall", "broadcast", "grouped_allgather",
         "grouped_allreduce", "grouped_reducescatter", "reducescatter"], "differentiable"),
    **dict.fromkeys(
        ["HorovodInternalError", "HvdliteError", "HvdliteNotImplementedError", "HvdliteTypeError",
         "HvdliteValueError",
         "MismatchError", "NotInitializedError", "ObjectPicklingError",
         "RankFailureError", "ShutdownError", "StallError"], "exceptions"),
    **dict.fromkeys(
        ["allgather_object", "broadcast_object", "broadcast_optimizer_state",
         "broadcast_parameters"], "functions"),
    **dict.fromkeys(
        ["Adasum", "Average", "Max", "Min", "Product", "Sum", "allgather_async", "allreduce_",
         "allreduce_async", "allreduce_async_", "alltoall_async", "barrier", "broadcast_",
         "broadcast_async", "broadcast_async_", "grouped_allgather_async", "grouped_allreduce_",
         "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter_async",
         "join", "poll", "reducescatter_async", "sparse_allreduce_async", "synchronize"], "ops"),
    "DistributedOptimizer": "optimizer",
    **dict.fromkeys(
        ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"],
        "process_sets"),
    "SyncBatchNorm": "sync_batch_norm",
}

# The extension links against torch's libraries, so it must load after torch: _runtime/native
# imports torch, then _core, and turns a failure into the ImportError that says how to build it.
# (`from hvdlite import _core` goes through here; a bare `import hvdlite._core` does not.)
_PRIVATE = {"_core": "_runtime.native"}

__all__ = list(_EXPORTS)


def __getattr__(name):
    module_name = _EXPORTS.get(name) or _PRIVATE.get(name)
    if module_name is not None:
        value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    elif name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        # A submodule (hvd.ops, hvd.basics): they were all loaded eagerly before.
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


# Note [Registering the torch.distributed backend]
# init_process_group("hvdlite") works after `import hvdlite` (hvdlite/torch_backend.py). The
# registration needs torch.distributed, which Note [Lazy exports] keeps out of this import:
# when torch is already loaded (the common order: import torch, then hvdlite) the backend is
# registered now; otherwise a one-shot import hook registers it once torch has loaded, so the
# launcher, which never imports torch, pays nothing.
def _register_backend():
    from .torch_backend import register
    register()


def _register_after_torch():
    import importlib.abc
    import importlib.util
    import sys

    class _AfterTorch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name != "torch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.loader is not None:
                self._inner = spec.loader
                spec.loader = self
            return spec

        def create_module(self, spec):
            return self._inner.create_module(spec)

        def exec_module(self, module):
            module.__loader__ = self._inner
            self._inner.exec_module(module)
            _register_backend()

    if "torch" in sys.modules:
        _register_backend()
    else:
        sys.meta_path.insert(0, _AfterTorch())


_register_after_torch()
