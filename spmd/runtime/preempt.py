"""Checkpoint before the end: a hook for the signal a scheduler sends ahead of time.

    from spmd import comm, preempt

    preempt.on_preempt(lambda: print("time is nearly up", flush=True))
    for step in range(start, steps):
        train_step()
        if preempt.any_preempted(comm):     # every rank agrees on the same step
            save_checkpoint(step)
            break                           # exit 0: the batch file requeues the job

The signal is SIGUSR1 unless SPMD_PREEMPT_SIGNAL names another.  How the handler
runs (main thread, between bytecodes), its caveats and ``spmd submit
--signal-before``: docs/slurm.md ("Preemption").
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, TypeVar

from spmd.errors import SettingsError, SpmdTypeError
from spmd.config.settings import parse_preempt_signal

if TYPE_CHECKING:
    from spmd.comms.comm import Comm

__all__ = ["on_preempt", "preempted", "flagged", "any_preempted", "install", "signal_number", "reset"]

_lock = threading.RLock()
_callbacks: list[Callable[[], object]] = []
_state: dict[str, Any] = {"flag": False, "signum": None, "previous": None}
_F = TypeVar("_F", bound=Callable[[], object])


def signal_number(name: str | int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Return a signal's number from 'USR1', 'SIGUSR1' or '10' (default: SPMD_PREEMPT_SIGNAL, USR1).

    environ (default os.environ) is read only when name is None.
    """
    number = parse_preempt_signal(os.environ if environ is None else environ, name)
    return int(signal.SIGUSR1) if number is None else number


def _run_callbacks(callbacks: Iterable[Callable[[], object]]) -> None:
    for fn in callbacks:
        try:
            fn()
        except Exception:
            sys.stderr.write(f"### spmd.preempt: callback {fn!r} failed:\n{traceback.format_exc()}")
            sys.stderr.flush()


def _handler(signum: int, frame: FrameType | None) -> None:
    with _lock:
        if _state["flag"]:
            return
        _state["flag"] = True
        callbacks = list(_callbacks)
    _run_callbacks(callbacks)
    previous = _state["previous"]
    if callable(previous):
        previous(signum, frame)


def install(sig: str | int | None = None) -> int:
    """Install the handler (once) for sig (default SPMD_PREEMPT_SIGNAL or USR1); return its number.

    Without sig, an installed handler is kept, whatever its signal.  Raise
    SettingsError (a ValueError) when called outside the main thread, or with
    a sig other than the one already installed.
    """
    if sig is None and _state["signum"] is not None:
        return int(_state["signum"])  # already installed: whichever signal that was
    signum = signal_number(sig)
    with _lock:
        if _state["signum"] is not None:
            if _state["signum"] != signum:
                raise SettingsError(f"spmd.preempt already handles signal {_state['signum']}, "
                                    f"not {signum}; call reset() first")
            return signum
        if threading.current_thread() is not threading.main_thread():
            raise SettingsError("spmd.preempt.install must run in the main thread (Python "
                                "signal handlers can only be set there)")
        _state["previous"] = signal.signal(signum, _handler)
        _state["signum"] = signum
    return signum


def on_preempt(fn: _F) -> _F:
    """Run fn() once when the preemption signal comes (at once if it came); return fn."""
    if not callable(fn):
        raise SpmdTypeError(f"on_preempt needs a callable, got {fn!r}")
    install()
    with _lock:
        _callbacks.append(fn)
        came = _state["flag"]
    if came:
        _run_callbacks([fn])
    return fn


def flagged() -> bool:
    """Tell whether the signal has come, without installing the handler (False if none is installed)."""
    return bool(_state["flag"])


def preempted() -> bool:
    """Tell whether the preemption signal has come to this process (installs the handler)."""
    install()
    return bool(_state["flag"])


def any_preempted(comm: Comm | None = None) -> bool:
    """Tell whether the signal came to any rank of comm (default spmd.comm); a collective."""
    import numpy as np

    if comm is None:
        from spmd import comm as world

        comm = world
    flag = np.array([1 if preempted() else 0], dtype=np.int32)
    comm.all_reduce(flag, op="max")
    return bool(flag[0])


def reset() -> None:
    """Forget the callbacks and the flag, and restore the previous handler (for tests)."""
    with _lock:
        if _state["signum"] is not None and threading.current_thread() is threading.main_thread():
            previous = _state["previous"]
            signal.signal(_state["signum"], previous if previous is not None else signal.SIG_DFL)
        _callbacks.clear()
        _state.update(flag=False, signum=None, previous=None)
