"""Starting and stopping hvdlite, and what a rank knows about the job.

``init()`` reads the launcher's environment (see ``_environment.py``), rendezvouses, creates
the process groups the native engine uses (a Gloo group for negotiation, Gloo groups for CPU
data, an NCCL group for CUDA data where CUDA is available) and starts the engine. All state
lives in one ``_State`` object, created by ``init()`` and dropped by ``shutdown()``.
"""

import atexit
import dataclasses
import datetime
import ipaddress
import itertools
import os
import socket
import threading

import torch
import torch.distributed as dist

from . import _environment, _liveness
from .exceptions import NotInitializedError, RankFailureError

try:
    from . import _core
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "hvdlite's native extension hvdlite._core could not be imported "
        f"({exc}). Build it against the installed torch with "
        "'pip install --no-build-isolation .' (or '-e .' in a checkout), with torch installed first."
    ) from exc

# Note [Process group timeout]: the engine only starts a data collective once negotiation has
# shown every rank is ready, and an idle engine still joins a negotiation round every heartbeat,
# so a collective waiting this long means a peer process is frozen, not slow.
_PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=300)
_RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=300)


@dataclasses.dataclass
class _SetRuntime:
    """One process set's engine, as seen from this rank (engine None: not a member)."""
    ranks: list     # global ranks, sorted
    engine: object  # _core.Engine or None
    groups: tuple   # keeps the process groups alive as long as the engine
    rank: int       # this rank's index in `ranks` (-1 when not a member)
    name_ids: object = dataclasses.field(default_factory=lambda: itertools.count(1))

    @property
    def size(self):
        return len(self.ranks)


@dataclasses.dataclass
class _State:
    topology: _environment.Topology
    store: object
    prefix: str
    loopback: bool
    sets: dict      # process set id -> _SetRuntime; 0 is the global set
    peers: list     # every rank's host and pid (see _liveness)
    failure: tuple = None  # (text, ranks) once a rank failure has been diagnosed
    handles: dict = dataclasses.field(default_factory=dict)
    handle_ids: object = dataclasses.field(default_factory=lambda: itertools.count(1))
    set_ids: object = dataclasses.field(default_factory=lambda: itertools.count(1))

    @property
    def engine(self):
        return self.sets[0].engine


_state = None
_lock = threading.Lock()
_generation = itertools.count()
_stores = {}  # (addr, port) -> store, kept for init() after shutdown() in the same process
_atexit_registered = False


def _is_loopback(addr):
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def _store_for(rendezvous, topology):
    key = (rendezvous.addr, rendezvous.port)
    if key in _stores:
        return _stores[key]
    if rendezvous.secret:
        from .runner.rendezvous import connect
        store = connect(rendezvous.addr, rendezvous.port, rendezvous.secret, topology.rank,
                        _RENDEZVOUS_TIMEOUT)
    else:
        store = dist.TCPStore(rendezvous.addr, rendezvous.port, topology.size,
                              is_master=rendezvous.host_store, timeout=_RENDEZVOUS_TIMEOUT,
                              wait_for_workers=False)
    _stores[key] = store
    return store


def _gloo_group(store, rank, size, loopback):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = _PROCESS_GROUP_TIMEOUT
    if loopback:
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    else:
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, options)


def _nccl_group(store, rank, size):
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = _PROCESS_GROUP_TIMEOUT
    return dist.ProcessGroupNCCL(store, rank, size, options)


def _rendezvous(topology, rendezvous):
    """Returns (store, key prefix, loopback) shared by every engine of this init()."""
    prefix = f"hvdlite/{next(_generation)}/"
    if dist.is_initialized():
        # The user's own init_process_group: build ours beside it, from the same store.
        if dist.get_world_size() != topology.size:
            raise ValueError(
                f"hvdlite.init(): torch.distributed was initialized with world size "
                f"{dist.get_world_size()}, but the environment ({topology.source}) says {topology.size}")
        return dist.distributed_c10d._get_default_store(), prefix, False
    if topology.size == 1:
        return dist.HashStore(), prefix, True
    return _store_for(rendezvous, topology), prefix, _is_loopback(rendezvous.addr)


def _start_engine(state_like, tag, rank, size):
    """Creates the process groups of one engine (over `size` ranks) and starts it.

    Groups: one for negotiation, HVDLITE_CPU_CHANNELS for CPU data (large allreduces are striped
    over them, Note [CPU channels] in csrc/executor.h) and one NCCL group where CUDA is available.
    """
    store, prefix, loopback = state_like
    base = f"{prefix}{tag}/"
    control = _gloo_group(dist.PrefixStore(base + "control", store), rank, size, loopback)
    cpu = [_gloo_group(dist.PrefixStore(f"{base}cpu{i}", store), rank, size, loopback)
           for i in range(_cpu_channels(store, base, rank))]
    cuda = _nccl_group(dist.PrefixStore(base + "cuda", store), rank, size)
    return _core.Engine(control, cpu, cuda, rank, size), (control, cpu, cuda)


def _cpu_channels(store, base, rank):
    """Rank 0's HVDLITE_CPU_CHANNELS, so that every rank creates the same process groups."""
    key = base + "cpu_channels"
    if rank == 0:
        store.set(key, str(_core._parse_config(dict(os.environ))["cpu_channels"]))
    return int(store.get(key))


def _topology_from_hosts(topology, hosts):
    """Local and cross ranks from the host each rank runs on (hosts in order of first rank)."""
    order = list(dict.fromkeys(hosts))
    mine = hosts[topology.rank]
    return dataclasses.replace(
        topology, local_rank=hosts[:topology.rank].count(mine), local_size=hosts.count(mine),
        cross_rank=order.index(mine), cross_size=len(order))


def init(comm=None, process_sets=None):
    """Starts hvdlite on this rank. Synchronizes with every other rank of the job.

    Reads the environment of ``hvdliterun``, ``torchrun``, ``mpirun`` or ``srun``; with none of
    them, runs as a job of one rank. If ``torch.distributed`` is already initialized, hvdlite
    builds its process groups beside the user's. Calling ``init()`` again while initialized does
    nothing; after ``shutdown()`` it starts a fresh engine.

    ``comm`` (an MPI communicator in Horovod) is not supported and must be None.
    """
    global _state, _atexit_registered
    if comm is not None:
        raise ValueError("hvdlite.init(): comm= (an MPI communicator) is not supported; "
                         "hvdlite reads the launcher's environment instead")
    with _lock:
        if _state is not None:
            return
        topology, rendezvous = _environment.detect()
        if dist.is_initialized() and topology.source == "single":
            # Local and cross ranks are derived from the hosts every rank publishes, below.
            topology = dataclasses.replace(topology, rank=dist.get_rank(), size=dist.get_world_size(),
                                           source="torch.distributed")
        store, prefix, loopback = _rendezvous(topology, rendezvous)
        _liveness.publish(store, prefix, topology.rank)
        engine, groups = _start_engine((store, prefix, loopback), "global", topology.rank, topology.size)
        sets = {0: _SetRuntime(list(range(topology.size)), engine, groups, topology.rank)}
        peers = _liveness.read(store, prefix, topology.size)
        if topology.source == "torch.distributed":
            topology = _topology_from_hosts(topology, [p["host"] for p in peers])
        _state = _State(topology=topology, store=store, prefix=prefix, loopback=loopback, sets=sets,
                        peers=peers)
        if not _atexit_registered:
            # Exiting with work in flight and no shutdown can abort the process; see
            # Note [Interpreter exit] in docs/design.md.
            atexit.register(shutdown)
            _atexit_registered = True
    if process_sets:
        from .process_sets import add_process_set
        for process_set in process_sets:
            add_process_set(process_set)


def shutdown():
    """Stops hvdlite on this rank, and with it on every rank (shutdown is negotiated).

    Synchronizes loosely: the other ranks' engines stop at their next negotiation round, and
    their pending and later operations fail with ``ShutdownError`` naming this rank.

    Operations still pending fail with ``ShutdownError``. Safe to call more than once.
    """
    global _state
    with _lock:
        state, _state = _state, None
    if state is not None:
        # Process sets first: their engines negotiate shutdown among their members only.
        for set_id in sorted(state.sets, reverse=True):
            if state.sets[set_id].engine is not None:
                state.sets[set_id].engine.shutdown()


def _explain(exc, state=None):
    """Adds what is known about a lost peer to a RankFailureError (once per init)."""
    state = state or _state
    if not isinstance(exc, RankFailureError) or state is None or getattr(exc, "_explained", False):
        return exc
    if state.failure is None:
        state.failure = _liveness.describe(state.peers, state.topology.rank, str(exc))
    text, ranks = state.failure
    if text:
        exc.args = (f"{exc.args[0]} ({text})",) + exc.args[1:]
        exc.ranks = ranks
    exc._explained = True
    return exc


def is_initialized():
    """True between ``init()`` and ``shutdown()``."""
    return _state is not None


def _current():
    state = _state
    if state is None:
        raise NotInitializedError("hvdlite is not initialized: call hvdlite.init() first")
    return state


def size():
    """Number of ranks in the job."""
    return _current().topology.size


def rank():
    """This process's rank, 0 <= rank < size()."""
    return _current().topology.rank


def local_rank():
    """This process's rank among the ranks on its host."""
    return _current().topology.local_rank


def local_size():
    """Number of ranks on this host."""
    return _current().topology.local_size


def cross_rank():
    """This host's index among the job's hosts."""
    return _current().topology.cross_rank


def cross_size():
    """Number of hosts in the job."""
    return _current().topology.cross_size


def is_homogeneous():
    """True when every host runs the same number of ranks."""
    topology = _current().topology
    return topology.local_size * topology.cross_size == topology.size


def gloo_enabled():
    return dist.is_gloo_available()


def gloo_built():
    return dist.is_gloo_available()


def nccl_built():
    return dist.is_nccl_available()


def mpi_enabled():
    return False


def mpi_built():
    return False


def mpi_threads_supported():
    return False
