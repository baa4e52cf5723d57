"""hvdlite as a torch.distributed backend: ``init_process_group("hvdlite")`` (after
``import hvdlite``) runs every collective of the process group through hvdlite's engine.

Note [Engine behind a process group] in csrc/torch_backend.h says how a c10d call becomes an
engine operation. This module is the Python half: the creator torch calls for each process
group with the backend "hvdlite" (the default group, and each ``new_group``), which builds the
group's engine from the store, rank and size torch hands over, as ``hvd.init()`` builds its
own: every rank publishes its record (host, pid, build, settings), the records are checked
alike on every rank, rank 0's job-wide settings apply, and ``start_engine`` opens the Gloo
groups and, when every rank shares the host, the shared-memory channel. So a group created
under torchrun, hvdliterun, SLURM or mpirun, by env://, tcp://, file:// or a store passed in,
gets the same engine; it is independent of ``hvd.init()``'s engines in the same process.
"""

import atexit
import os
import socket

import torch.distributed as dist

NAME = "hvdlite"

# Every backend made, shut down at exit (Note [Engine behind a process group]): a script that
# never calls destroy_process_group() must not leave the engine's and the backend's threads
# running while the interpreter tears down, which aborted the process in about one exit in
# four. (A shut-down backend has let go of its engine, so keeping it costs nothing.)
_MADE = []


@atexit.register
def _shutdown_at_exit():
    while _MADE:
        _MADE.pop().shutdown()


def _create(store, rank, size, timeout):
    """torch.distributed's creator for one process group of the backend "hvdlite"."""
    # Imported here, not at registration: registering runs inside `import torch` when hvdlite
    # was imported first, and a missing or broken build must not break that import (the
    # ImportError that says how to build comes at init_process_group instead).
    from .basics import _is_loopback
    from ._runtime import groups as _groups
    from ._runtime import liveness as _liveness
    from ._runtime import settings as _settings
    from ._runtime.native import _core
    own = {**_settings.own_record(rank), "place_host": socket.gethostname(), "local_rank": -1}
    _liveness.publish(store, "hvdlite/", rank, own)
    peers = _liveness.read(store, "hvdlite/", size)
    _settings.check_records(peers)
    # Note [Engine behind a process group]: DDP and FSDP already bucket their gradients, so
    # the engine does not hold small rounds back for more bytes (Note [Gathering by size]);
    # the same on every rank, so the job-wide digest agrees.
    settings = {**_settings.in_force(peers, rank), "HVDLITE_GATHER_BYTES": "0"}
    one_host = len({p["host"] for p in peers}) == 1
    loopback = one_host and _is_loopback(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    engine, _ = _groups.start_engine((store, "hvdlite/", loopback, settings), "engine", rank, size, peers)
    backend = _core.torch_backend(engine)  # `timeout`: see Note [Engine behind a process group]
    _MADE.append(backend)
    return backend


def register():
    """Registers the backend with torch.distributed (once; hvdlite's import calls it)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["cpu", "cuda"])
