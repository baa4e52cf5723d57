"""Every exception hvdlite raises, on a rank and in the launcher, defined here and only here.

- On a rank, every failure a user can cause, or that a peer causes, is an
  :class:`HvdliteError` (a ``RuntimeError``). The native engine reports failures as a status
  code plus a one-sentence message (naming the operation, the tensor, the ranks and what
  differs); :func:`_from_status` turns them into these classes, so the same exception is
  raised on every rank involved. Bad calls are also ``ValueError``/``TypeError``s.
- Elastic training's signals are not failures: :class:`HostsUpdatedInterrupt` and
  :class:`WorkerRemoved` (the process leaves with status 0).
- The launcher's errors (hvdliterun, ``hvdlite.runner.run``) are :class:`LaunchError`s, and
  the rendezvous store's :class:`RendezvousError`s, which both sides see.

Torch-free: the launcher imports this module. Kept beside their code: ``_store.StoreTimeoutError``
(it must derive from torch's ``DistStoreError``) and runner/job.py's private ``_RankStartFailed``
(control flow inside run_job, never raised to a user).
"""

import pickle

__all__ = [
    "HvdliteError",
    "HorovodInternalError",
    "MismatchError",
    "RankFailureError",
    "StallError",
    "ShutdownError",
    "NotInitializedError",
    "HvdliteValueError",
    "HvdliteTypeError",
    "HvdliteNotImplementedError",
    "ObjectPicklingError",
    "HostsUpdatedInterrupt",
    "ElasticAbort",
    "SettingsError",
    "LaunchEnvironmentError",
    "RayWorkerError",
    "WorkerRemoved",
    "RendezvousError",
    "RendezvousTimeout",
    "LaunchError",
    "UsageError",
    "HostSpecError",
    "ConfigFileError",
    "NetworkError",
    "HostDiscoveryError",
    "DiscoveryOutputError",
    "NetworkDiscoveryError",
    "JobFailedError",
]


class HvdliteError(RuntimeError):
    """Base class of every hvdlite failure.

    Attributes, where they apply: ``op`` (the operation, e.g. "allreduce"), ``tensor_name``,
    ``ranks`` (the ranks the failure concerns: those that differ in a mismatch, those missing in
    a stall, those lost in a rank failure, those that shut down), and ``reason`` (the message
    without its subject).
    """

    def __init__(self, message, op=None, tensor_name=None, ranks=None, reason=None):
        super().__init__(message)
        self.op = op
        self.tensor_name = tensor_name
        self.ranks = ranks
        self.reason = reason if reason is not None else message


class MismatchError(HvdliteError):
    """Ranks disagreed about a collective (shape, dtype, op, root, ...): a programming error."""


class RankFailureError(HvdliteError):
    """A peer died or the transport failed: the job cannot continue without a restart.

    ``diagnosis``: what this rank found out about the lost peers (which exited, which did not
    answer; Note [Failure census] in _runtime/liveness.py), or None before the census. It is a field
    of its own, shown after the engine's message, so neither is ever rewritten."""

    diagnosis = None

    def __str__(self):
        message = super().__str__()
        return f"{message} ({self.diagnosis})" if self.diagnosis else message


class StallError(HvdliteError):
    """Some ranks never submitted a tensor that the others waited on."""


class ShutdownError(HvdliteError):
    """hvdlite was shut down while the operation was pending, or before it was submitted."""


class HvdliteValueError(HvdliteError, ValueError):
    """A bad argument or a call that cannot be made (op=Adasum on a reducescatter, a root rank
    out of range, ...), raised at the call before anything reaches the other ranks.

    Note [Argument errors are RuntimeErrors]: horovod.torch reports most bad calls from its
    native layer, so Horovod scripts catch them as ``RuntimeError``; scripts written for
    hvdlite (and for plain Python conventions) catch ``ValueError``. Both work.
    """


class HvdliteTypeError(HvdliteError, TypeError, ValueError):
    """An argument of the wrong type or dtype (a list where a tensor goes, a float root rank, a
    complex tensor to reduce, ...): a ``TypeError``, and also a ``ValueError`` and a
    ``RuntimeError``, since horovod.torch raises ValueError for unsupported dtypes (Note
    [Argument errors are RuntimeErrors])."""


class HvdliteNotImplementedError(HvdliteValueError, NotImplementedError):
    """A call that hvdlite cannot carry out in this configuration (op=Adasum on a set whose
    size is not a power of two, or on CUDA tensors): horovod.torch raises NotImplementedError
    there; it is a ``ValueError`` too."""


class ObjectPicklingError(HvdliteError, pickle.PicklingError):
    """``broadcast_object`` / ``allgather_object``: a rank could not pickle its object; raised on
    every rank of the collective, naming the ranks (``ranks``) and why."""


class NotInitializedError(HvdliteError, ValueError):
    """An operation was called before ``hvdlite.init()``."""


class HostsUpdatedInterrupt(RuntimeError):
    """Elastic training: the launcher found new or departed hosts, and every rank stops at the
    same operation to re-form the job (Note [Hosts updated] in _runtime/elastic_worker.py).
    ``hvdlite.elastic.run`` catches it. Not an HvdliteError: nothing failed, and the state is
    kept (``skip_sync`` is False: the new ranks still need it)."""

    def __init__(self, message="the job's hosts changed", skip_sync=False, op=None, tensor_name=None,
                 ranks=None):
        super().__init__(message)
        self.skip_sync = skip_sync
        self.op = op
        self.tensor_name = tensor_name
        self.ranks = ranks


class SettingsError(HvdliteValueError):
    """init(): a rank's HVDLITE_* settings are invalid; ``ranks`` names the ranks."""


# Not HvdliteErrors (a script that retries on HorovodInternalError must not retry them): the
# launcher's decision to stop, a broken launch environment, a Ray worker lost by the driver.
class LaunchEnvironmentError(ValueError):
    """init(): a launcher's environment that hvdlite cannot use; the message names the
    variable."""


class ElasticAbort(RuntimeError):
    """The elastic launcher stopped the job (reset limit, too few slots, no survivor); names
    why."""


class RayWorkerError(RuntimeError):
    """A worker of hvdlite.ray's executor failed or died; names its rank and node. ``errors``
    holds every rank's failure (rank -> text), the first cause first."""

    def __init__(self, message, rank=None, node=None, errors=None):
        super().__init__(message)
        self.rank, self.node, self.errors = rank, node, errors or {}


class WorkerRemoved(SystemExit):
    """This elastic worker is not part of the next generation; the process exits with status
    0 (not a failure)."""

    def __init__(self, why):
        super().__init__(0)
        self.why = why


# ---- the rendezvous store, seen by ranks and by the launcher -----------------------------------

class RendezvousError(RuntimeError):
    """The rendezvous store refused the client, lost the connection or reported an error."""


class RendezvousTimeout(RendezvousError):
    """A blocking get/wait did not see its keys within the timeout."""


# ---- the launcher ------------------------------------------------------------------------------

class LaunchError(Exception):
    """hvdliterun (or hvdlite.runner.run) cannot start or finish the job as asked; the message
    is the one line the user reads."""


class UsageError(LaunchError):
    """A bad command line; reported as one line and exit status 2."""


class HostSpecError(LaunchError, ValueError):
    """A host list or hostfile that cannot be parsed, or more ranks than slots."""


class ConfigFileError(LaunchError, ValueError):
    """A --config-file that cannot be read or names unknown keys."""


class NetworkError(LaunchError, ValueError):
    """A network interface that does not exist or has no IPv4 address."""


class NetworkDiscoveryError(LaunchError):
    """Network discovery (runner/discovery.py) found no network every host shares; the
    message says why."""


class HostDiscoveryError(LaunchError):
    """Elastic mode: the host discovery script (runner/elastic.py) failed or printed
    something that is not a host list."""


class DiscoveryOutputError(HostDiscoveryError, ValueError):
    """The host discovery script printed something that is not a host list."""


class JobFailedError(LaunchError, RuntimeError):
    """hvdlite.runner.run(): a rank of the job failed; ``rank`` names the first, ``result``
    holds every rank's exit."""

    def __init__(self, message, rank=None, result=None):
        super().__init__(message)
        self.rank = rank
        self.result = result


# Scripts written for Horovod catch this name.
HorovodInternalError = HvdliteError

def _from_status(code, message, op="", tensor="", ranks=(), reason=""):
    """Builds the exception for an engine status (called by the native module's translator).

    The status's fields (Note [Status subjects] in csrc/status.h) become the exception's
    ``op``, ``tensor_name``, ``ranks`` and ``reason``; nothing is parsed back from the message.
    """
    from ._runtime.native import _core
    codes = _core.STATUS_CODES
    if code == codes["invalid_argument"]:
        return HvdliteValueError(message, op=op or None, tensor_name=tensor or None,
                                 ranks=list(ranks) or None, reason=reason or None)
    if code == codes["reset"]:  # Note [Hosts updated] in _runtime/elastic_worker.py
        return HostsUpdatedInterrupt(message, op=op or None, tensor_name=tensor or None,
                                     ranks=list(ranks) or None)
    cls = {
        codes["mismatch"]: MismatchError,
        codes["rank_failure"]: RankFailureError,
        codes["stall"]: StallError,
        codes["shutdown"]: ShutdownError,
    }.get(code, HvdliteError)
    exc = cls(message, op=op or None, tensor_name=tensor or None, ranks=list(ranks) or None)
    exc.reason = reason
    return exc
