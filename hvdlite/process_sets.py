"""Process sets: subsets of ranks that run collectives among themselves.

Every collective takes ``process_set=`` (default: the global set of all ranks). Each added set
gets its own engine, with its own negotiation and process groups, so sets progress
independently: a collective in one set never waits for another set's traffic.

``add_process_set`` and ``remove_process_set`` synchronize every rank of the job: call them on
all ranks, in the same order, with the same ranks, also on ranks outside the set.
"""

from ._runtime import groups as _groups
from ._runtime import state as _state
from .exceptions import HvdliteTypeError, HvdliteValueError


class ProcessSet:
    """A set of ranks. The global set's ``ranks`` lists every rank once hvdlite is initialized.

    As in horovod.torch, ``size()``, ``rank()`` and ``included()`` of a set that is not
    registered (not added, or added before a shutdown()) return None.
    """

    def __init__(self, ranks=None):
        self._global = ranks is None
        if ranks is None:
            self._ranks = None
        else:
            try:
                ranks = [int(r) for r in ranks]
            except (TypeError, ValueError):
                raise HvdliteTypeError(f"ProcessSet: ranks must be a sequence of ints, got {ranks!r}") from None
            if not ranks:
                raise HvdliteValueError("ProcessSet: a process set needs at least one rank")
            if len(set(ranks)) != len(ranks):
                raise HvdliteValueError(f"ProcessSet: ranks {ranks} contain duplicates")
            self._ranks = sorted(ranks)
        self.process_set_id = 0 if ranks is None else None
        self._init_number = None  # the init() it was added in (Note [Init numbers] in basics.py)

    @property
    def ranks(self):
        if self._global:
            state = _state.peek()
            return None if state is None else list(range(state.topology.size))
        return self._ranks

    def _registered(self):
        """This set's runtime in the current generation, or None."""
        state = _state.current()
        if self._global:
            return state.sets[0]
        if self.process_set_id is None or self._init_number != state.init_number:
            return None
        return state.sets.get(self.process_set_id)

    def _runtime(self):
        state = _state.current()
        if self._global:
            return state.sets[0]
        if self.process_set_id is None or self.process_set_id not in state.sets:
            raise HvdliteValueError(f"{self!r} has not been added: call hvdlite.add_process_set() on every rank")
        if self._init_number != state.init_number:
            # Set ids restart with every init(); this object's id would name another set.
            raise HvdliteValueError(f"{self!r} was added before hvdlite.shutdown(); process sets do not "
                                    "survive a restart: add it again after init()")
        return state.sets[self.process_set_id]

    def size(self):
        """Number of ranks in the set (None if it is not registered)."""
        runtime = self._registered()
        return None if runtime is None else runtime.size

    def rank(self):
        """This rank's index within the set, -1 if it is not a member, None if the set is not
        registered."""
        runtime = self._registered()
        return None if runtime is None else runtime.rank

    def included(self):
        """True if this rank belongs to the set (None if it is not registered)."""
        runtime = self._registered()
        return None if runtime is None else runtime.rank >= 0

    def __repr__(self):
        if self._global:
            return "ProcessSet(global)"
        return f"ProcessSet(ranks={self._ranks})"


global_process_set = ProcessSet()


def add_process_set(process_set):
    """Registers a process set (a ProcessSet or a list of ranks) and returns it.

    Synchronizes every rank of the job; members start the set's engine.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    state = _state.current()
    if process_set._global:
        raise HvdliteValueError("add_process_set: the global process set always exists")
    if (process_set.process_set_id is not None and process_set._init_number == state.init_number
            and process_set.process_set_id in state.sets):
        raise HvdliteValueError(f"add_process_set: {process_set!r} was already added")
    if any(runtime.ranks == process_set.ranks for sid, runtime in state.sets.items() if sid != 0):
        raise HvdliteValueError(f"add_process_set: a process set with ranks {process_set.ranks} is already "
                                "registered")
    size = state.topology.size
    bad = [r for r in process_set.ranks if not 0 <= r < size]
    if bad:
        raise HvdliteValueError(f"add_process_set: ranks {bad} are outside a job of {size} ranks")
    set_id = next(state.set_ids)
    me = state.topology.rank
    engine, groups, rank = None, None, -1
    if me in process_set.ranks:
        rank = process_set.ranks.index(me)
        engine, groups = _groups.start_engine(state.group_context(), f"set{set_id}", rank,
                                              len(process_set.ranks),
                                              [state.peers[r] for r in process_set.ranks],
                                              timeline_label=f"set{set_id}")
    state.sets[set_id] = _state.SetRuntime(list(process_set.ranks), engine, groups, rank)
    process_set.process_set_id = set_id
    process_set._init_number = state.init_number
    return process_set


def remove_process_set(process_set):
    """Stops a process set's engine (members' pending operations fail) and forgets the set.

    Returns True if the set was registered (False for the global set, which stays). Call it on
    every rank.
    """
    state = _state.current()
    if process_set._global:
        return False  # as in horovod.torch: the global set is never removed
    if process_set._init_number != state.init_number:
        return False
    runtime = state.sets.pop(process_set.process_set_id, None)
    if runtime is None:
        return False
    if runtime.engine is not None:
        runtime.engine.shutdown()
    process_set.process_set_id = None
    return True
