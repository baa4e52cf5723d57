"""The exceptions hvdlite raises.

Every failure a user can cause, or that a peer causes, is an :class:`HvdliteError`. The native
engine reports failures as a status code plus a one-sentence message (naming the operation, the
tensor, the ranks and what differs); :func:`_from_status` turns them into these classes, so the
same exception is raised on every rank involved.
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
    """A peer died or the transport failed: the job cannot continue without a restart."""


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
    same operation to re-form the job (Note [Hosts updated] in _elastic_worker.py).
    ``hvdlite.elastic.run`` catches it. Not an HvdliteError: nothing failed, and the state is
    kept (``skip_sync`` is False: the new ranks still need it)."""

    def __init__(self, message="the job's hosts changed", skip_sync=False, op=None, tensor_name=None,
                 ranks=None):
        super().__init__(message)
        self.skip_sync = skip_sync
        self.op = op
        self.tensor_name = tensor_name
        self.ranks = ranks


# Scripts written for Horovod catch this name.
HorovodInternalError = HvdliteError

# The reason an elastic worker's engines shut down with when the hosts change (Note [Hosts
# updated] in _elastic_worker.py); it travels to every rank in the engine's shutdown message.
HOSTS_UPDATED = "updating the job's hosts (elastic training; every rank resets)"


def _from_status(code, message, op="", tensor="", ranks=(), reason=""):
    """Builds the exception for an engine status (called by the native module's translator).

    The status's fields (Note [Status subjects] in csrc/status.h) become the exception's
    ``op``, ``tensor_name``, ``ranks`` and ``reason``; nothing is parsed back from the message.
    """
    from ._native import _core
    codes = _core.STATUS_CODES
    if code == codes["invalid_argument"]:
        return HvdliteValueError(message, op=op or None, tensor_name=tensor or None,
                                 ranks=list(ranks) or None, reason=reason or None)
    if code == codes["shutdown"] and HOSTS_UPDATED in message:
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
