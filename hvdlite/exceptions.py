"""The exceptions hvdlite raises.

Every failure a user can cause, or that a peer causes, is an :class:`HvdliteError`. The native
engine reports failures as a status code plus a one-sentence message (naming the operation, the
tensor, the ranks and what differs); :func:`_from_status` turns them into these classes, so the
same exception is raised on every rank involved.
"""

__all__ = [
    "HvdliteError",
    "HorovodInternalError",
    "MismatchError",
    "RankFailureError",
    "StallError",
    "ShutdownError",
    "NotInitializedError",
]


class HvdliteError(RuntimeError):
    """Base class of every hvdlite failure.

    Attributes ``op`` and ``tensor_name`` are filled where the message names them.
    """

    def __init__(self, message, op=None, tensor_name=None, ranks=None):
        super().__init__(message)
        self.op = op
        self.tensor_name = tensor_name
        self.ranks = ranks


class MismatchError(HvdliteError):
    """Ranks disagreed about a collective (shape, dtype, op, root, ...): a programming error."""


class RankFailureError(HvdliteError):
    """A peer died or the transport failed: the job cannot continue without a restart."""


class StallError(HvdliteError):
    """Some ranks never submitted a tensor that the others waited on."""


class ShutdownError(HvdliteError):
    """hvdlite was shut down while the operation was pending, or before it was submitted."""


class NotInitializedError(HvdliteError, ValueError):
    """An operation was called before ``hvdlite.init()``."""


# Scripts written for Horovod catch this name.
HorovodInternalError = HvdliteError

# Status codes of csrc/status.h.
_INVALID_ARGUMENT, _MISMATCH, _RANK_FAILURE, _STALL, _SHUTDOWN, _INTERNAL = 1, 2, 3, 4, 5, 6


def _parse_subject(message):
    """Reads "<op> of '<name>': ..." from the front of an engine message."""
    head, sep, _ = message.partition("': ")
    if not sep or " of '" not in head:
        return None, None
    op, _, name = head.partition(" of '")
    return op, name


def _from_status(code, message):
    """Builds the exception for an engine status (called by the native module)."""
    if code == _INVALID_ARGUMENT:
        return ValueError(message)
    op, name = _parse_subject(message)
    cls = {
        _MISMATCH: MismatchError,
        _RANK_FAILURE: RankFailureError,
        _STALL: StallError,
        _SHUTDOWN: ShutdownError,
    }.get(code, HvdliteError)
    return cls(message, op=op, tensor_name=name)
