"""Exceptions raised by spmd.

Every error names the problem and, where there is one, the fix.
"""

__all__ = [
    "SpmdError",
    "PlacementError",
    "BackendError",
    "RendezvousError",
    "CollectiveError",
    "CollectiveTimeout",
    "PEER_LOST",
    "is_peer_lost",
]


class SpmdError(RuntimeError):
    """Base class of every error spmd raises on purpose."""


class PlacementError(SpmdError, ValueError):
    """The launcher's environment does not describe a consistent world."""


class BackendError(SpmdError, ValueError):
    """A backend was asked for that is unknown or unusable here."""


class RendezvousError(SpmdError):
    """The ranks could not meet: bad address, port in use, peer missing."""


class CollectiveError(SpmdError, ValueError):
    """A collective was called with arguments that cannot work."""


class CollectiveTimeout(SpmdError, TimeoutError):
    """A collective waited longer than the timeout for the other ranks."""


#: Words of backend errors that mean a peer vanished or closed its connection.
PEER_LOST = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused")


def is_peer_lost(exc):
    """Tell whether exc reads like a peer that died or hung up, not like this rank's own fault."""
    text = str(exc)
    return any(words in text for words in PEER_LOST)
