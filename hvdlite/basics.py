"""Starting and stopping hvdlite, and what a rank knows about the job.

``init()`` reads the launcher's environment (see ``_job/launchers.py``), rendezvouses, agrees on
the build and the job-wide settings with every other rank (``_runtime/settings.py``), creates the
process groups the native engine uses and starts the engine (``_runtime/groups.py``). The state lives
in ``_runtime/state.py``, created by ``init()`` and dropped by ``shutdown()``.

Note [Init numbers]
Every init() of a process is numbered (``State.init_number``, counted by
``_state.process.init_numbers``) and has its own keys in the store (``hvdlite/<n>/``), its own
engines and its own process sets. init() after shutdown() starts the next one in the same
process; nothing of the previous one (a registered ProcessSet, a handle) carries over. (An
elastic job's generations are the launcher's numbering of the job's membership, a different
count: ``_elastic_worker.generation()``; they name the keys there, ``hvdlite/e<g>/``.)
"""

import atexit
import dataclasses
import datetime
import functools
import ipaddress
import os
import socket
import sys
import threading

import torch
import torch.distributed as dist

from ._runtime import elastic_worker as _elastic_worker
from ._runtime import failure as _failure
from ._runtime import groups as _groups
from ._runtime import liveness as _liveness
from ._runtime import metrics as _metrics
from ._runtime import recorder as _recorder
from ._runtime import settings as _settings
from ._runtime import state as _state
from ._job import keys, launchers, place as _place
from .exceptions import HvdliteValueError


_RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=300)



def _is_loopback(addr):
    try:  # an address needs no lookup (a name's lookup imports the idna codec: 3 ms at init)
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def _store_for(rendezvous, topology):
    key = (rendezvous.addr, rendezvous.port)
    stores = _state.process.stores  # kept for init() after shutdown() in the same process
    if key in stores:
        return stores[key]
    if rendezvous.secret:
        from ._runtime.store import connect
        store = connect(rendezvous.addr, rendezvous.port, rendezvous.secret, topology.rank,
                        _RENDEZVOUS_TIMEOUT)
    else:
        store = dist.TCPStore(rendezvous.addr, rendezvous.port, topology.size,
                              is_master=rendezvous.host_store, timeout=_RENDEZVOUS_TIMEOUT,
                              wait_for_workers=False)
    stores[key] = store
    return store


def _rendezvous(topology, rendezvous, init_number):
    """Returns (store, key prefix, loopback) shared by every engine of this init()."""
    # torchrun --max-restarts: its store outlives the processes it restarts; under elastic
    # hvdliterun the launcher numbers the generations (Note [Elastic rendezvous])
    prefix = keys.init_prefix(init_number, os.environ.get("TORCHELASTIC_RESTART_COUNT"),
                              _elastic_worker.generation())
    if dist.is_initialized():
        # The user's own init_process_group: build ours beside it, from the same store.
        if dist.get_world_size() != topology.size:
            raise HvdliteValueError(
                f"hvdlite.init(): torch.distributed was initialized with world size "
                f"{dist.get_world_size()}, but the environment ({topology.source}) says {topology.size}")
        return dist.distributed_c10d._get_default_store(), prefix, False
    if topology.size == 1:
        return dist.HashStore(), prefix, True
    return _store_for(rendezvous, topology), prefix, _is_loopback(rendezvous.addr)


def _place_record(topology):
    """What every rank publishes about its place: its host as its launcher knows it (the
    machine's name where the launcher does not say) and its local rank."""
    return {"place_host": topology.node or socket.gethostname(), "local_rank": topology.local_rank}


def _topology_from_peers(topology, peers):
    """Local and cross ranks by the one rule (Note [Cross ranks] in _job/place.py), from every
    rank's published host and local rank; a launcher's environment can only guess the cross
    ranks of uneven hosts. Under a plain torch.distributed job local ranks are counted too."""
    hosts = [p["place_host"] for p in peers]
    counted = topology.source == "torch.distributed"
    place = _place.places(hosts, None if counted else [p["local_rank"] for p in peers])[topology.rank]
    return dataclasses.replace(topology, local_rank=place.local_rank, local_size=place.local_size,
                               cross_rank=place.cross_rank, cross_size=place.cross_size)


def init(comm=None, process_sets=None):
    """Starts hvdlite on this rank. Synchronizes with every other rank of the job.

    Reads the environment of ``hvdliterun``, ``torchrun``, ``mpirun`` or ``srun``; with none of
    them, runs as a job of one rank. If ``torch.distributed`` is already initialized, hvdlite
    builds its process groups beside the user's. Calling ``init()`` again while initialized does
    nothing; after ``shutdown()`` it starts a fresh engine.

    ``comm``: hvdlite has no MPI communicators; a list of ranks is accepted when it names the
    whole job (use process sets for subsets). ``process_sets``: a list of ProcessSets (or rank
    lists) to add, or "dynamic" (hvdlite's process sets can always be added later).
    """
    if comm is not None and not isinstance(comm, (list, tuple, range)):
        raise HvdliteValueError("hvdlite.init(): comm= (an MPI communicator) is not supported; "
                                "hvdlite reads the launcher's environment instead")
    if process_sets == "dynamic":
        process_sets = None
    _failure.install()  # Note [Failure reports]: from here on, an uncaught exception is reported
    with _state.process.lock:
        if _state.peek() is not None:
            return
        # Note [Elastic rendezvous]: an elastic worker asks its launcher for its place (this
        # may end the process); init() takes the answer as a value.
        place = _elastic_worker.request_place() if _elastic_worker.enabled() else None
        topology, rendezvous = launchers.detect(place=place)
        if dist.is_initialized() and topology.source == "single":
            # Local and cross ranks are derived from the hosts every rank publishes, below.
            topology = dataclasses.replace(topology, rank=dist.get_rank(), size=dist.get_world_size(),
                                           source="torch.distributed")
        init_number = next(_state.process.init_numbers)
        store, prefix, loopback = _rendezvous(topology, rendezvous, init_number)
        # Every rank's record (host, pid, build, settings); reading them all is a rendezvous,
        # and every rank checks the same records, so a refusal happens on every rank at once.
        _liveness.publish(store, prefix, topology.rank,
                          {**_settings.own_record(topology.rank), **_place_record(topology)})
        peers = _liveness.read(store, prefix, topology.size)
        _settings.check_records(peers)
        settings = _settings.in_force(peers, topology.rank)
        engine, groups = _groups.start_engine((store, prefix, loopback, settings), "global",
                                              topology.rank, topology.size, peers)
        sets = {0: _state.SetRuntime(list(range(topology.size)), engine, groups, topology.rank)}
        topology = _topology_from_peers(topology, peers)
        hosts = [p["host"] for p in peers]
        homogeneous = len({hosts.count(h) for h in hosts}) == 1
        state = _state.State(topology=topology, init_number=init_number, store=store, prefix=prefix,
                             loopback=loopback, settings=settings, sets=sets, peers=peers,
                             homogeneous=homogeneous)
        _state.install(state)
        if _elastic_worker.enabled():  # Note [Hosts updated]
            _elastic_worker.watch_hosts(_elastic_worker.generation(),
                                        functools.partial(_engines_of, init_number))
        if not _state.process.atexit_registered:
            # Exiting with work in flight and no shutdown aborted the process in 8 of 20 runs
            # ("terminate called without an active exception"); shutting down at exit fixed it.
            atexit.register(_shutdown_at_exit)
            _state.process.atexit_registered = True
    _recorder.start(rank())  # Note [Dump files]
    _metrics.start()   # Note [Metrics]: only with HVDLITE_METRICS_PORT
    if comm is not None and sorted(int(r) for r in comm) != list(range(size())):
        ranks, job = sorted(int(r) for r in comm), size()
        shutdown()
        raise HvdliteValueError(f"hvdlite.init(comm={ranks}): hvdlite runs on every rank of the job "
                                f"({job} ranks); for collectives among a subset, use "
                                "hvdlite.add_process_set(...)")
    if process_sets:
        from .process_sets import add_process_set
        for process_set in process_sets:
            add_process_set(process_set)


def _engines_of(init_number):
    """The engines of init() number `init_number` if it is still the current one. (Holding the
    state itself would keep its process groups, hence their connections, open after shutdown.)"""
    state = _state.peek()
    if state is None or state.init_number != init_number:
        return []
    return [s.engine for s in state.sets.values() if s.engine is not None]


def shutdown():
    """Stops hvdlite on this rank, and with it on every rank (shutdown is negotiated).

    Synchronizes loosely: the other ranks' engines stop at their next negotiation round, and
    their pending and later operations fail with ``ShutdownError`` naming this rank.

    Operations still pending fail with ``ShutdownError``. Safe to call more than once.
    """
    _shutdown("")


def _shutdown_at_exit():
    # Note [Failure reports]: the others' errors will say why this rank went.
    _shutdown(_failure.exit_reason())


# Note [Leaving a failed generation]: how long an elastic reset waits for the old engines'
# process groups to be destroyed before it goes on and leaves that to a thread.
TEARDOWN_WAIT = 1.0


def _shutdown(reason, bounded=False):
    with _state.process.lock:
        state = _state.take()
    if state is not None:
        # Process sets first: their engines negotiate shutdown among their members only.
        for set_id in sorted(state.sets, reverse=True):
            if state.sets[set_id].engine is not None:
                state.sets[set_id].engine.shutdown(reason)
        # Drop the engines and process groups now: destroying a group closes its connections,
        # which is how a peer still blocked in a collective with this rank learns that it left
        # (Gloo has no way to interrupt a collective from outside).
        if bounded:
            _drop_in_background(state)
        else:
            state.sets.clear()
            state.handles.clear()


def _drop_in_background(state):
    """Note [Leaving a failed generation]
    An elastic worker leaving a generation drops its engines and their Gloo groups before it
    asks the launcher for a place in the next one. Destroying a Gloo group waits for the
    group's worker thread to finish the operation it is in, and the chaos test caught a survivor
    of a lost rank waiting there past --elastic-timeout (its dump: the main thread in this
    function's `clear()`), so the launcher killed it as hung and the job lost every holder of
    its state. So a reset drops them on a thread of its own: it waits TEARDOWN_WAIT for them
    (they go in milliseconds when nothing is stuck, closing their connections as before) and
    then goes on; a stuck group goes when its operation ends, at the latest at the process
    group's timeout."""
    sets, handles = dict(state.sets), dict(state.handles)
    state.sets.clear()
    state.handles.clear()

    def drop():
        sets.clear()
        handles.clear()
    thread = threading.Thread(target=drop, name="hvdlite-teardown", daemon=True)
    thread.start()
    thread.join(TEARDOWN_WAIT)
    if thread.is_alive():
        sys.stderr.write(f"hvdlite elastic: the previous generation's process groups are still being destroyed "
                         f"after {TEARDOWN_WAIT:g} s; this worker goes on and leaves that to a thread\n")
        sys.stderr.flush()


def start_timeline(file_path, mark_cycles=False):
    """Starts writing this rank's timeline (a Chrome trace; see HVDLITE_TIMELINE) to
    ``file_path`` ("trace.json" becomes "trace.rank1.json" in a job of several ranks), closing
    one that was being written. Negotiation rounds are always marked, so ``mark_cycles`` only
    exists for horovod.torch's signature. Returns once the engine writes the new file."""
    if not _current().engine.set_timeline(str(file_path)):
        raise HvdliteValueError("start_timeline: hvdlite's engine has stopped")


def stop_timeline():
    """Stops writing the timeline and closes its file (a no-op when none is written)."""
    _current().engine.set_timeline("")


def is_initialized():
    """True between ``init()`` and ``shutdown()``."""
    return _state.peek() is not None


def _current():
    return _state.current()


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
    """True when every host runs the same number of ranks; one answer for the whole job,
    computed at init() from every rank's host."""
    return _current().homogeneous


def gloo_enabled():
    return dist.is_gloo_available()


def gloo_built():
    return dist.is_gloo_available()


def nccl_built():
    return dist.is_nccl_available()


def gpu_available(ext_base_name="torch", verbose=False):
    """horovod.common.util's helper, for scripts that call it: whether torch sees a GPU."""
    return torch.cuda.is_available()


def check_extension(ext_name=None, ext_env_var=None, pkg_path=None, *args):
    """horovod's check that its extension is built; hvdlite's is imported with the package
    (a missing build raises an ImportError that says how to build it)."""
    from ._runtime.native import _core  # noqa: F401


def split_list(values, n):
    """``values`` in ``n`` consecutive parts, as even as possible (horovod.common.util's)."""
    size, extra = divmod(len(values), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(values[start:end])
        start = end
    return out


def cuda_built():
    """True when the installed torch was built with CUDA (hvdlite then uses NCCL for CUDA tensors)."""
    return torch.version.cuda is not None


def rocm_built():
    return getattr(torch.version, "hip", None) is not None


def ccl_built():
    return False


def ddl_built():
    return False


def mpi_enabled():
    return False


def mpi_built():
    return False


def mpi_threads_supported():
    return False
