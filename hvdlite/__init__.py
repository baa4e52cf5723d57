"""hvdlite: Horovod-style data-parallel training for PyTorch over torch.distributed.

``import hvdlite as hvd`` gives the names of ``horovod.torch``.
"""

import torch  # noqa: F401  (the extension links against torch: import it first)

from .basics import (cross_rank, cross_size, gloo_built, gloo_enabled, init, is_homogeneous,
                     is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                     mpi_threads_supported, nccl_built, rank, shutdown, size)
from .compression import Compression
from .differentiable import (allgather, allreduce, alltoall, broadcast, grouped_allgather,
                             grouped_allreduce, grouped_reducescatter, reducescatter)
from .exceptions import (HorovodInternalError, HvdliteError, MismatchError, NotInitializedError,
                         RankFailureError, ShutdownError, StallError)
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather_async, allreduce_,
                  allreduce_async, allreduce_async_, alltoall_async, barrier, broadcast_,
                  broadcast_async, broadcast_async_, grouped_allgather_async, grouped_allreduce_,
                  grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter_async,
                  join, poll, reducescatter_async, synchronize)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm

__version__ = "0.1.0"
