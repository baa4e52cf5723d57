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

torch's ``env://`` reads only torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, ...). The
rendezvous ``hvdlite://`` reads whatever launcher started the process, as ``hvd.init()`` does
(hvdliterun, torchrun, mpirun, SLURM's srun, or none: one process), so one script runs under
all of them with ``init_process_group("hvdlite", init_method="hvdlite://")``; it works with
any backend, "gloo" and "nccl" included.
"""

import atexit
import os
import socket
import sys
import urllib.parse

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
    from ._runtime import state as _state
    _state.process.backend_engines.clear()
    _state.process.backends.clear()


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
    own = {**_settings.own_record(rank), "place_host": socket.gethostname(), "local_rank": -1,
           "timeout_s": timeout.total_seconds()}
    _liveness.publish(store, "hvdlite/", rank, own)
    peers = _liveness.read(store, "hvdlite/", size)
    _settings.check_records(peers)
    # Note [Engine behind a process group]: DDP and FSDP already bucket their gradients, so
    # the engine does not hold small rounds back for more bytes (Note [Gathering by size]);
    # the same on every rank, so the job-wide digest agrees.
    settings = {**_settings.in_force(peers, rank), "HVDLITE_GATHER_BYTES": "0"}
    # The group's timeout is its engine's stall shutdown time, rank 0's like every job-wide
    # setting, unless HVDLITE_STALL_SHUTDOWN_TIME_SECONDS says otherwise.
    settings.setdefault("HVDLITE_STALL_SHUTDOWN_TIME_SECONDS", repr(peers[0]["timeout_s"]))
    one_host = len({p["host"] for p in peers}) == 1
    loopback = one_host and _is_loopback(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    # its timeline is "<path>.pg<n>": the n-th group of the backend this process made
    engine, groups = _groups.start_engine((store, "hvdlite/", loopback, settings), "engine", rank, size, peers,
                                          timeline_label=f"pg{len(_MADE)}")
    # Note [Point-to-point messages] (csrc/point_to_point.h): send and recv travel through the
    # group's segment when every rank shares this host (Note [Point-to-point through shared
    # memory]), else through its first CPU channel, pair by pair, beside the engine's collectives.
    # CUDA tensors' go through the engine's NCCL group (Note [CUDA point-to-point] in
    # csrc/torch_backend.h).
    backend = _core.torch_backend(engine, groups.cpu[0], timeout.total_seconds(), groups.messages, groups.cuda)
    from ._runtime import recorder as _recorder, state as _state
    # Note [Dump requests] (csrc/recorder.h): a dump signal reaches every rank through the
    # global engine; a job of torch.distributed groups only has the first group's engine do it.
    if not _MADE and _state.peek() is None:
        engine.set_label(f"pg{len(_MADE)}", True)
    _MADE.append(backend)
    _state.process.backend_engines.append((f"pg{len(_MADE) - 1}", engine))  # Note [Dump files]
    _state.process.backends.append((f"pg{len(_MADE) - 1}", backend))  # their pending point-to-point
    _recorder.start(rank)
    return backend


def _rendezvous(url, timeout=None, **kwargs):
    """torch.distributed's rendezvous handler for ``hvdlite://``: the store, rank and size of
    whatever launcher started this process (launchers.detect, as hvd.init() reads them)."""
    from .basics import _store_for
    from ._job import launchers
    from .exceptions import LaunchEnvironmentError
    topology, rendezvous = launchers.detect()
    # init_process_group(rank=..., world_size=...) arrive in the query; they must agree
    given = {k: int(v[0]) for k, v in urllib.parse.parse_qs(urllib.parse.urlparse(url).query).items()
             if k in ("rank", "world_size")}
    found = {"rank": topology.rank, "world_size": topology.size}
    for key, value in given.items():
        if value != found[key]:
            raise LaunchEnvironmentError(
                f"init_process_group(init_method='hvdlite://'): {key}={value} was passed, but the "
                f"launcher's environment ({topology.source}) says {key}={found[key]}")
    store = dist.HashStore() if topology.size == 1 else _store_for(rendezvous, topology)
    if timeout is not None:
        store.set_timeout(timeout)
    yield store, topology.rank, topology.size
    raise RuntimeError("the hvdlite:// rendezvous runs once per init_process_group")


def register():
    """Registers the backend and the ``hvdlite://`` rendezvous with torch.distributed (once;
    hvdlite's import calls it)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["cpu", "cuda"])
    handlers = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers  # the name is a function
    if NAME not in handlers:
        dist.register_rendezvous_handler(NAME, _rendezvous)
