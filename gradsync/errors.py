"""gradsync's exception hierarchy: one root, one class per kind of distributed failure.

Caller mistakes (a bad argument) raise ``ValueError``/``TypeError``; the classes here are for
what goes wrong *between* ranks.
"""

__all__ = [
    "GradsyncError",
    "ConfigError",
    "PeerLostError",
    "CollectiveMismatchError",
    "GradsyncTimeoutError",
    "AuthenticationError",
    "ProtocolError",
]


class GradsyncError(RuntimeError):
    """Root of every error gradsync raises for a distributed failure."""


class ConfigError(GradsyncError, ValueError):
    """A setting (keyword argument or ``GRADSYNC_*`` variable) is unknown or has a bad value."""


class PeerLostError(GradsyncError):
    """A peer rank died, closed its connection or stopped answering.

    Attributes:
        peer: the rank that was lost (``None`` when unknown).
        silent: the peer sent no heartbeats (stopped, stuck or cut off) rather than closing
            its connection: the launcher kills such a peer at once.
    """

    def __init__(self, message: str, peer: "int | None" = None, silent: bool = False):
        super().__init__(message)
        self.peer = peer
        self.silent = silent


class CollectiveMismatchError(GradsyncError):
    """Ranks issued different collectives (operation, shape, dtype, reduce op or name)."""


class GradsyncTimeoutError(GradsyncError, TimeoutError):
    """A blocking wait passed its deadline while its peers were still alive."""


class AuthenticationError(GradsyncError):
    """A connection did not prove it knows the job's secret."""


class ProtocolError(GradsyncError):
    """Bytes on a connection were not a valid gradsync frame."""
