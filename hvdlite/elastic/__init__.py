"""Elastic training, as horovod.torch.elastic: the job loses and gains ranks without stopping.

::

    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...          # commit with state.commit() every few batches

    train(state)

Run under ``hvdliterun --host-discovery-script ...`` (runner/elastic.py). When a rank fails,
every survivor rolls back to its last commit; when hosts come or go, every rank stops at the
same operation and keeps its state. Either way every rank then re-forms the job with the
launcher (Note [Elastic rendezvous] in hvdlite/_runtime/elastic_worker.py), the reset callbacks run,
the state is synced from rank 0, and the function is called again.
"""

import functools
import sys

from .. import basics
from .._runtime import elastic_worker as _elastic_worker
from .._runtime import state as _state
from ..exceptions import (HostsUpdatedInterrupt, HvdliteError, MismatchError, NotInitializedError,
                          ObjectPicklingError, WorkerRemoved)
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt"]

# Errors that a reset cures: a peer failed or the engine was stopped under the step. A mismatch,
# a bad call (HvdliteValueError, HvdliteTypeError, ...: ValueError or TypeError) or an object
# that cannot be pickled is a bug in the script and would come back after every reset, so it
# is raised. (The launcher's decision to stop, ElasticAbort, is no HvdliteError: it ends run().)
_RESETTABLE = (HvdliteError,)
_NOT_RESETTABLE = (MismatchError, NotInitializedError, ValueError, TypeError, ObjectPicklingError)


def _reset(state, reason, lost):
    """Leaves this generation and joins the next (Note [Elastic rendezvous])."""
    _state.process.elastic.resets += 1  # Note [Metrics]
    basics._shutdown("", bounded=True)  # Note [Leaving a failed generation] in basics.py
    if not _elastic_worker.enabled():
        raise RuntimeError("hvdlite.elastic.run: a reset needs the elastic launcher "
                           "(hvdliterun --host-discovery-script ...)")
    _elastic_worker.set_reason(reason, lost)
    try:
        basics.init()
    except WorkerRemoved as removed:
        sys.stderr.write(f"hvdlite elastic: this worker leaves the job ({removed.why})\n")
        sys.stderr.flush()
        raise
    if not _restore_durable(state):
        if _elastic_worker.assignment().get("restore"):
            state.restore()
    state.on_reset()


def _restore_durable(state):
    """Note [No survivor] (runner/elastic.py): the launcher formed this generation from new
    workers only and hands them the last durable copy; True if it did."""
    assignment = _elastic_worker.assignment() or {}
    durable = assignment.get("durable")
    if not durable:
        return False
    if not hasattr(state, "restore_durable_copy"):
        raise RuntimeError("hvdlite.elastic: the launcher asked to restore a durable copy, but this "
                           f"state ({type(state).__name__}) cannot load one")
    if basics.rank() == 0:
        sys.stderr.write(f"hvdlite elastic: no worker of the previous generation is left; restoring "
                         f"the durable copy of commit {durable['commit']} from {durable['path']}\n")
        sys.stderr.flush()
    state.restore_durable_copy(durable["path"])
    return True


def run(func):
    """Decorates ``func(state, *args, **kwargs)``: runs it until it returns, resetting the job
    and calling it again after a rank failure or a change of hosts. Returns what ``func``
    returns. A worker that is no longer wanted exits with status 0 (SystemExit)."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not basics.is_initialized():
            basics.init()
        _restore_durable(state)  # a worker that starts in a generation of newcomers only
        reset = None
        while True:
            try:
                if reset is not None:
                    _reset(state, *reset)
                state.sync()
                # Note [Commit after sync]: every rank now holds rank 0's state; saving it makes
                # it every rank's commit, so a rank that joined in this generation (or one that
                # received a durable copy) rolls back to it, not to what it was built with, if
                # rank 0 is lost before the next commit().
                state.save()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                reset = ("hosts", ())
            except _NOT_RESETTABLE:
                raise
            except _RESETTABLE as exc:
                if not _elastic_worker.enabled():
                    raise
                reset = ("failure", getattr(exc, "ranks", None) or ())
    return wrapper
