"""The errors a Work of the "gradsync" backend fails with.

``torch.distributed`` code catches ``torch.distributed.DistBackendError``; gradsync code catches
``gradsync.GradsyncError`` and its kinds. Each class here is both, so either ``except`` works:
``PeerLostBackendError`` is a ``DistBackendError`` and a ``gradsync.PeerLostError``.
"""

from __future__ import annotations

from torch.distributed import DistBackendError

from ...errors import (CollectiveMismatchError, GradsyncError, GradsyncTimeoutError,
                       PeerLostError)

__all__ = ["BackendError", "PeerLostBackendError", "MismatchBackendError",
           "TimeoutBackendError", "to_backend_error"]


class BackendError(DistBackendError, GradsyncError):
    """A collective of the gradsync backend failed; ``__cause__`` is the original error."""


class PeerLostBackendError(BackendError, PeerLostError):
    """A rank of the group died, closed its connections or stopped answering."""

    def __init__(self, message: str, peer: "int | None" = None):
        BackendError.__init__(self, message)
        self.peer = peer


class MismatchBackendError(BackendError, CollectiveMismatchError):
    """Ranks of the group issued different collectives (operation, shape, dtype, op, root)."""


class TimeoutBackendError(BackendError, GradsyncTimeoutError):
    """A collective waited longer than the group's timeout on live peers."""


def to_backend_error(exc: BaseException, where: str) -> BackendError:
    """The BackendError for ``exc`` (kept as its ``__cause__``); ``where`` prefixes the message."""
    if isinstance(exc, BackendError):
        return exc
    message = f"{where}: {type(exc).__name__}: {exc}"
    if isinstance(exc, PeerLostError):
        error: BackendError = PeerLostBackendError(message, peer=exc.peer)
    elif isinstance(exc, CollectiveMismatchError):
        error = MismatchBackendError(message)
    elif isinstance(exc, GradsyncTimeoutError):
        # Worded as torch's backends word theirs ("Timed out waiting ..."): torch's suite
        # and users' handlers match on it (test_barrier_timeout_*: " (Timed out|closed|timeout) ").
        error = TimeoutBackendError(f"{where}: Timed out waiting on live peers: "
                                    f"{type(exc).__name__}: {exc}")
    else:
        error = BackendError(message)
    error.__cause__ = exc
    return error
