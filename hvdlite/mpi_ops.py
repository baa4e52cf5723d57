"""``hvdlite.mpi_ops``: the module path horovod.torch scripts import from
(``from horovod.torch.mpi_ops import Sum, allreduce_async_``). The same objects as the package's."""

from .basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,  # noqa: F401
                     gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size,
                     mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
                     shutdown, size, start_timeline, stop_timeline)
from .ops import (Adasum, Average, Max, Min, Product, Sum, allgather_async, allreduce_,  # noqa: F401
                  allreduce_async, allreduce_async_, alltoall_async, barrier, broadcast_,
                  broadcast_async, broadcast_async_, grouped_allgather_async, grouped_allreduce_,
                  grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter_async,
                  join, poll, reducescatter_async, sparse_allreduce_async, synchronize)
from .differentiable import (allgather, allreduce, alltoall, broadcast, grouped_allgather,  # noqa: F401
                             grouped_allreduce, grouped_reducescatter, reducescatter)
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set  # noqa: F401
