"""The process groups behind one engine, and starting the engine on them.

Each engine (the global one, and one per process set) gets a Gloo group for negotiation,
HVDLITE_CPU_CHANNELS Gloo groups for CPU data (large allreduces are striped over them, Note
[CPU channels] in csrc/executor.h) and an NCCL group where CUDA is available. The settings
mapping is the same on every rank for the job-wide variables (Note [Job-wide settings] in
csrc/config.h), so every rank creates the same groups.
"""

import datetime

import torch
import torch.distributed as dist

from ._native import _core

# Note [Process group timeout]: the engine only starts a data collective once negotiation has
# shown every rank is ready, and an idle engine still joins a negotiation round every heartbeat,
# so a collective waiting this long means a peer process is frozen, not slow.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=300)


def _gloo_group(store, rank, size, loopback):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = PROCESS_GROUP_TIMEOUT
    if loopback:
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    else:
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, options)


def _nccl_group(store, rank, size):
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = PROCESS_GROUP_TIMEOUT
    return dist.ProcessGroupNCCL(store, rank, size, options)


def start_engine(context, tag, rank, size):
    """Creates the process groups of one engine over `size` ranks and starts it.

    `context` is (store, key prefix, loopback, settings); returns (engine, groups).
    """
    store, prefix, loopback, settings = context
    base = f"{prefix}{tag}/"
    channels = _core._parse_config(settings)["cpu_channels"]
    control = _gloo_group(dist.PrefixStore(base + "control", store), rank, size, loopback)
    cpu = [_gloo_group(dist.PrefixStore(f"{base}cpu{i}", store), rank, size, loopback)
           for i in range(channels)]
    cuda = _nccl_group(dist.PrefixStore(base + "cuda", store), rank, size)
    engine = _core.Engine(control, cpu, cuda, rank, size, settings)
    return engine, (control, cpu, cuda)
