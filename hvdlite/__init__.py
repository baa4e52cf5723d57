"""hvdlite: Horovod-style data-parallel training for PyTorch over torch.distributed.

``import hvdlite as hvd`` gives the names of ``horovod.torch``.
"""

import torch  # noqa: F401  (the extension links against torch: import it first)

from .basics import (cross_rank, cross_size, gloo_built, gloo_enabled, init, is_homogeneous,
                     is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                     mpi_threads_supported, nccl_built, rank, shutdown, size)
from .compression import Compression
from .exceptions import (HorovodInternalError, HvdliteError, MismatchError, NotInitializedError,
                         RankFailureError, ShutdownError, StallError)
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allreduce,
                  allreduce_, allreduce_async, allreduce_async_, broadcast, broadcast_,
                  broadcast_async, broadcast_async_, grouped_allreduce, grouped_allreduce_,
                  grouped_allreduce_async, grouped_allreduce_async_, poll, synchronize)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, global_process_set
from .sync_batch_norm import SyncBatchNorm

__version__ = "0.1.0"
