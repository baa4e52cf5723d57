"""The one home of hvdlite's state: what ``init()`` built, until ``shutdown()``, and what
lives as long as the process.

``init()`` creates a ``State`` and installs it with ``install()``; ``shutdown()`` takes it back
with ``take()``. Every other module reads it through ``current()``, which raises
NotInitializedError outside init/shutdown. Each init() is numbered anew (Note
[Init numbers] in basics.py): objects that belong to one init(), such as a registered
ProcessSet, check it before use. ``process`` holds what outlives them (the stores kept
for the next init(), the failure hook, the elastic worker's conversation with its launcher);
no other module keeps mutable globals.
"""

import dataclasses
import itertools
import os
import threading

from . import liveness as _liveness
from .._job import launchers
from .._job.launchers import Topology
from ..exceptions import NotInitializedError, RankFailureError


@dataclasses.dataclass
class SetRuntime:
    """One process set's engine, as seen from this rank (engine None: not a member)."""
    ranks: list     # global ranks, sorted
    engine: object  # _core.Engine or None
    groups: object  # groups.EngineGroups (None: not a member), kept alive as long as the engine
    rank: int       # this rank's index in `ranks` (-1 when not a member)

    @property
    def size(self):
        return len(self.ranks)


@dataclasses.dataclass
class State:
    topology: Topology
    init_number: int  # Note [Init numbers] in basics.py
    store: object
    prefix: str
    loopback: bool
    settings: dict  # the HVDLITE_* variables every engine of this init() runs with
    sets: dict      # process set id -> SetRuntime; 0 is the global set
    peers: list     # every rank's record (host, pid, build; see _liveness and _settings)
    homogeneous: bool = True  # every host runs the same number of ranks (from `peers`)
    failure: tuple = None  # (text, ranks) once a rank failure has been diagnosed
    handles: dict = dataclasses.field(default_factory=dict)
    handle_ids: object = dataclasses.field(default_factory=lambda: itertools.count(1))
    set_ids: object = dataclasses.field(default_factory=lambda: itertools.count(1))

    @property
    def engine(self):
        runtime = self.sets.get(0)  # none after shutdown (basics._shutdown drops the engines)
        return None if runtime is None else runtime.engine

    def group_context(self):
        """What creating another engine's process groups needs (see _groups.start_engine)."""
        return self.store, self.prefix, self.loopback, self.settings


@dataclasses.dataclass
class ElasticWorker:
    """An elastic worker's side of its conversation with the launcher (Note [Elastic
    rendezvous] in _runtime/elastic_worker.py), for the life of the process."""
    lock: object = dataclasses.field(default_factory=threading.Lock)
    client: object = None     # the connection to the launcher's store, once made
    requests: int = 0         # requests for a place made so far
    reason: dict = dataclasses.field(default_factory=lambda: {"reason": "start", "lost": []})
    assignment: dict = None   # the launcher's latest answer
    generation: int = None    # the launcher's number of the generation last assigned
    notified: set = dataclasses.field(default_factory=set)  # generations told the hosts changed
    resets: int = 0           # resets this process went through (Note [Metrics])


@dataclasses.dataclass
class Process:
    """What lives as long as the process, across init()/shutdown() pairs."""
    lock: object = dataclasses.field(default_factory=threading.Lock)  # init() and shutdown()
    state: State = None       # the current init()'s, between init() and shutdown()
    init_numbers: object = dataclasses.field(default_factory=itertools.count)
    stores: dict = dataclasses.field(default_factory=dict)  # (addr, port) -> store, for init() after shutdown()
    open_stores: set = dataclasses.field(default_factory=set)  # Note [Keeping SecretStore alive]
    atexit_registered: bool = False
    failure_hook_installed: bool = False
    failure_report: dict = None  # this process's failure, once reported (Note [Failure reports])
    member_names: dict = dataclasses.field(default_factory=dict)  # ops: (group, count) -> names
    elastic: ElasticWorker = dataclasses.field(default_factory=ElasticWorker)
    recorder_thread: object = None  # Note [Dump files] in _runtime/recorder.py, once started
    recorder_pidfiles: set = dataclasses.field(default_factory=set)  # this process's registrations
    recorder_stopping: object = dataclasses.field(default_factory=threading.Event)  # set at exit
    backend_engines: list = dataclasses.field(default_factory=list)  # (label, engine) of hvdlite process groups
    backends: list = dataclasses.field(default_factory=list)  # (label, c10d backend) of the same groups
    metrics_server: object = None   # Note [Metrics] in _runtime/metrics.py, once serving
    compiled_buckets: object = None  # Note [Compiled backward in buckets], once an optimizer made it


process = Process()


def peek():
    """The state, or None when hvdlite is not initialized."""
    return process.state


def current():
    state = process.state
    if state is None:
        raise NotInitializedError("hvdlite is not initialized: call hvdlite.init() first")
    return state


def install(state):
    process.state = state


def take():
    """Removes and returns the state (None if there was none)."""
    state, process.state = process.state, None
    return state


def _elastic():
    return launchers.is_elastic_worker(os.environ)


def explain(exc, state=None, engine=None):
    """Fills a RankFailureError's ``diagnosis`` and ``ranks`` with what is known about the lost
    peers (found once per init). A failure of the global engine (`engine` None or the global
    one) runs the census of Note [Failure census]; a process set's cannot, as ranks outside
    the set would not answer. Other exceptions pass unchanged."""
    state = state or process.state
    if not isinstance(exc, RankFailureError) or state is None or exc.diagnosis is not None:
        return exc
    if state.failure is None:
        # Under elastic training the launcher names the lost workers, and the survivors reset
        # at once: no census (it waits for ranks that will never answer).
        everyone = (engine is None or engine is state.engine) and not _elastic()
        state.failure = _liveness.describe(state.peers, state.topology.rank, str(exc),
                                           state.store if everyone else None, state.prefix,
                                           0.3 if _elastic() else 1.0)
    text, ranks = state.failure
    exc.diagnosis = text  # "" when nothing more is known
    if text:
        exc.ranks = ranks
    return exc
