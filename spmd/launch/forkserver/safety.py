"""Whether a fork server may fork after its imports: threads, CUDA, MPI, and a forked probe.

``load`` imports the modules in order and returns why forking is unsafe
now (a ``LaunchError`` message naming the module and the fix), or None.
The refusals are listed in docs/preload.md ("When it refuses").
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from spmd.launch.forkserver.process import die_with, flush_std

__all__ = ["load", "unsafe", "probe", "PROBE_SECONDS"]

#: Seconds a forked probe child may take for its matrix products before the server is refused.
PROBE_SECONDS = 5.0


def load(modules: list[str]) -> str | None:
    """Import modules in order; return why forking is unsafe now, or None."""
    import importlib
    import traceback

    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as e:  # an import that exits or fails: name it
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            return (f"--preload: cannot import {name!r} ({last}): check the name, or run the same "
                    f"python (`{sys.executable} -c 'import {name}'`) to see why")
        why = unsafe(name)
        if why is not None:
            return why
    return probe(modules)


def unsafe(name: str) -> str | None:
    """Return why forking is unsafe after importing name, or None."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        names = ", ".join(f"{t.name!r}" + (" (daemon)" if t.daemon else "") for t in others)
        return (f"--preload: importing {name!r} started {len(others)} thread(s) ({names}); forking a "
                f"process with threads running is unsafe: remove {name!r} from --preload (let the "
                "script import it)")
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return (f"--preload: importing {name!r} initialised CUDA, which a forked process cannot use "
                f"(torch refuses it in a forked child): remove {name!r} from --preload, or run without "
                "--preload")
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        return (f"--preload: importing {name!r} initialised MPI, which a forked process cannot use: "
                "remove it from --preload (spmd starts MPI in each rank)")
    return None


def probe(modules: list[str]) -> str | None:
    """Fork a child that runs torch's and numpy's matrix products; return why it failed, or None.

    A forked child of a process whose OpenMP pool was started (by an import
    that computed something in parallel) hangs in its first parallel region.
    """
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is None and numpy is None:
        return None
    flush_std()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the probe
        code = 1
        try:
            die_with(parent)
            if torch is not None:
                a = torch.ones(256, 256)
                (a @ a).sum().item()
                torch.ones(1 << 17).add_(1)  # an elementwise parallel_for
            if numpy is not None:
                b = numpy.ones((256, 256))
                (b @ b).sum()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + PROBE_SECONDS
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.005)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return (f"--preload: after importing {','.join(modules)}, a forked child did not finish a matrix "
                f"product within {PROBE_SECONDS:g} s: an import most likely ran a parallel computation, "
                "whose OpenMP threads a forked child cannot use (it hangs); remove that module from "
                "--preload, or run without --preload")
    if os.waitstatus_to_exitcode(status) != 0:
        return (f"--preload: after importing {','.join(modules)}, a forked child could not run a matrix "
                f"product (exit status {os.waitstatus_to_exitcode(status)}): run without --preload")
    return None
