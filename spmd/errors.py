"""Every error spmd raises, in one tree under :class:`SpmdError`.

Every error names the problem and, where there is one, the fix.  A
caller that wants to catch anything spmd raised on purpose catches
``spmd.SpmdError``; errors about a bad argument or setting also derive
from ``ValueError``, wrong types from ``TypeError``, a timeout from
``TimeoutError``, so code written against the builtins keeps working.
The tree, with what each error means: docs/reference.md ("Errors").
"""

__all__ = [
    "SpmdError",
    "SpmdTypeError",
    "SettingsError",
    "PlacementError",
    "BackendError",
    "RendezvousError",
    "CollectiveError",
    "CollectiveTimeout",
    "CommunicationError",
    "PeerLostError",
    "PipelineError",
    "PipelineValueError",
    "PipelineTypeError",
    "PipelineJournalError",
    "PipelinePreempted",
    "SourceError",
    "SourceTypeError",
    "MissingExtraError",
    "TaskError",
    "DataParallelError",
    "CheckpointError",
    "SubmitError",
    "LaunchError",
    "BenchError",
    "BenchArgumentError",
    "MarkerError",
    "SessionError",
    "RanksError",
    "PEER_LOST",
    "is_peer_lost",
]


class SpmdError(RuntimeError):
    """Base class of every error spmd raises on purpose."""


class SpmdTypeError(SpmdError, TypeError):
    """spmd was given a value of a type it cannot use (a callback that is not callable, ...)."""


class SettingsError(SpmdError, ValueError):
    """A setting (an ``SPMD_*`` variable or an argument of init) has a value that cannot work."""


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


class CommunicationError(SpmdError):
    """The backend failed a call for a reason other than its arguments or a timeout.

    The backend's own error is chained (``__cause__``); the message names
    the call and starts the backend's text.
    """


class PeerLostError(CommunicationError, ConnectionError):
    """A call failed because a peer died or closed its connection (often another rank's failure)."""


class PipelineError(SpmdError):
    """The pipeline failed; raised with the same message on every rank."""


class PipelineValueError(PipelineError, ValueError):
    """A value given to the pipeline, or returned by its fn or source, cannot work (chunk_rows, a shape)."""


class PipelineTypeError(PipelineError, TypeError):
    """An object given to the pipeline, or returned by its fn, has the wrong type."""


class PipelineJournalError(PipelineError):
    """A resume journal is in the way (a run without resume) or does not match this run."""


class PipelinePreempted(PipelineError):
    """A resumable pipeline stopped at the end of a round because the preemption signal came."""


class SourceError(SpmdError, ValueError):
    """A pipeline's input cannot be read, or its parts do not fit together."""


class SourceTypeError(SourceError, TypeError):
    """An object was given as a pipeline's input that is neither an array, a path nor a source."""


class MissingExtraError(SpmdError, ImportError):
    """A file format or tool was asked for whose optional package is not installed; names the extra."""


class TaskError(SpmdError, ValueError):
    """A task is unknown or registered twice, or was given rows it cannot compute on."""


class DataParallelError(SpmdError, ValueError):
    """DataParallel was given a model, option or call order that cannot work."""


class CheckpointError(SpmdError):
    """A checkpoint could not be saved or loaded."""


class SubmitError(SpmdError, ValueError):
    """A submission cannot be made as asked; the message says why and how to fix it."""


class LaunchError(SpmdError, ValueError):
    """A local launch (``spmd run``, ``spmd.launch.supervise``) was asked for something that cannot run."""


class BenchError(SpmdError):
    """spmd bench could not run a measurement (a launch failed, a tool or library is missing)."""


class BenchArgumentError(BenchError, ValueError):
    """spmd bench was asked for something it cannot measure (an unknown collective, bad sizes)."""


class MarkerError(SpmdError, ValueError):
    """A test's ``@pytest.mark.spmd`` asks for what cannot run (spmd's pytest plugin, docs/testing-your-code.md)."""


class SessionError(SpmdError):
    """An interactive session (``spmd repl``, the ``%spmd`` magic) could not do what was asked."""


class RanksError(SpmdError):
    """Ranks raised in a ``%%spmd`` cell (or ``%spmd`` failed): the cell's error, each distinct traceback once."""

    def __init__(self, lines: list[str], summary: str) -> None:
        super().__init__(summary)
        self.lines = lines

    def _render_traceback_(self) -> list[str]:  # IPython shows these lines instead of a local traceback
        return self.lines


#: Words of backend errors that mean a peer vanished or closed its connection.
PEER_LOST = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused")


def is_peer_lost(exc: BaseException) -> bool:
    """Tell whether exc reads like a peer that died or hung up, not like this rank's own fault."""
    if isinstance(exc, PeerLostError):
        return True
    text = str(exc)
    return any(words in text for words in PEER_LOST)
