"""spmd: MPI-style SPMD scripting for PyTorch.

    from spmd import comm
    x = torch.ones(1) * (comm.rank + 1)
    comm.reduce(x, root=0)            # rank 0 now holds 1+2+...+size

The same script runs under mpirun, srun, torchrun, ``spmd run`` or plain
python.  ``import spmd`` is light: torch and mpi4py are imported only
when the communicator is first used.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "comm",
    "init",
    "finalize",
    "initialized",
    "run_command",
    "Comm",
    "Handle",
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
    "Session",
    "load_ipython_extension",
]

from spmd.runtime.proxy import comm
from spmd.errors import (  # every error spmd raises: the tree under SpmdError
    BackendError,
    BenchArgumentError,
    BenchError,
    CheckpointError,
    CollectiveError,
    CollectiveTimeout,
    CommunicationError,
    DataParallelError,
    LaunchError,
    MarkerError,
    MissingExtraError,
    PeerLostError,
    PipelineError,
    PipelineTypeError,
    PipelineJournalError,
    PipelinePreempted,
    PipelineValueError,
    PlacementError,
    RanksError,
    RendezvousError,
    SessionError,
    SettingsError,
    SourceError,
    SourceTypeError,
    SpmdError,
    SpmdTypeError,
    SubmitError,
    TaskError,
)
from spmd.runtime.start import finalize, init, initialized
from spmd.runtime.usage import run_command

#: The public modules loaded on first use as ``spmd.<name>`` (__getattr__), so `import spmd` stays light.
_LAZY_MODULES = ("checkpoint", "data_parallel", "pipeline", "preempt", "repl", "tasks")

if TYPE_CHECKING:  # the same, for type checkers
    from spmd import checkpoint, data_parallel, pipeline, preempt, repl, tasks
    from spmd.comms.comm import Comm
    from spmd.comms.handle import Handle
    from spmd.interactive.session import Session


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext spmd`` in IPython or Jupyter: the ``%spmd`` magics (docs/interactive.md)."""
    try:
        from spmd.interactive.magic import load
    except ImportError as exc:  # IPython itself is there: what is missing is the extra's
        raise MissingExtraError(f"the %spmd magic needs {exc.name or 'ipykernel'}: pip install 'spmd[interactive]' "
                                "(bin/setup installs it)") from None
    load(ipython)


def __getattr__(name: str) -> Any:
    if name == "Session":
        from spmd.interactive.session import Session

        return Session
    if name in ("Comm", "Handle"):
        from spmd.comms import comm as front

        return getattr(front, name)
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'spmd' has no attribute {name!r}")
