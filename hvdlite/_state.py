"""The one home of hvdlite's per-process state: what ``init()`` built, until ``shutdown()``.

``init()`` creates a ``_State`` and installs it with ``install()``; ``shutdown()`` takes it back
with ``take()``. Every other module reads it through ``current()``, which raises
NotInitializedError outside init/shutdown. Each init() is a new generation (Note
[Generations] in basics.py): objects that belong to one generation, such as a registered
ProcessSet, check it before use.
"""

import dataclasses
import itertools
import threading

from . import _elastic_worker, _liveness
from ._job.launchers import Topology
from .exceptions import NotInitializedError, RankFailureError


@dataclasses.dataclass
class SetRuntime:
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
class State:
    topology: Topology
    generation: int
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


lock = threading.Lock()  # held by init() and shutdown() while they build or take the state
_state = None


def peek():
    """The state, or None when hvdlite is not initialized."""
    return _state


def current():
    state = _state
    if state is None:
        raise NotInitializedError("hvdlite is not initialized: call hvdlite.init() first")
    return state


def install(state):
    global _state
    _state = state


def take():
    """Removes and returns the state (None if there was none)."""
    global _state
    state, _state = _state, None
    return state


def explain(exc, state=None, engine=None):
    """Adds what is known about a lost peer to a RankFailureError (once per init). A failure of
    the global engine (`engine` None or the global one) runs the census of Note [Failure
    census]; a process set's cannot, as ranks outside the set would not answer."""
    state = state or _state
    if not isinstance(exc, RankFailureError) or state is None or getattr(exc, "_explained", False):
        return exc
    if state.failure is None:
        # Under elastic training the launcher names the lost workers, and the survivors reset
        # at once: no census (it waits for ranks that will never answer).
        everyone = (engine is None or engine is state.engine) and not _elastic_worker.enabled()
        state.failure = _liveness.describe(state.peers, state.topology.rank, str(exc),
                                           state.store if everyone else None, state.prefix,
                                           0.3 if _elastic_worker.enabled() else 1.0)
    text, ranks = state.failure
    if text:
        exc.args = (f"{exc.args[0]} ({text})",) + exc.args[1:]
        exc.ranks = ranks
    exc._explained = True
    return exc
