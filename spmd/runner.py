"""``python -m spmd script.py args``: run a script under the runtime.

The runtime starts when the script first uses it (so the script's own
``spmd.init(backend=..., timeout=...)`` applies).  An uncaught exception
on any rank, in the script or in the runtime's start, prints a
traceback tagged with the rank and host, then brings the whole job
down: MPI_Abort under MPI, otherwise an exit that the launcher (spmd
run, srun --kill-on-bad-exit, torchrun) turns into ending every rank.
"""

import os
import runpy
import socket
import sys
import time
import traceback

from .errors import is_peer_lost

__all__ = ["run_script", "abort", "report_failure"]

USAGE = "usage: python -m spmd [-m module | script.py] [args...]"
PEER_GRACE = 3.0  # seconds


def _who():
    """Name this process: rank, size, host and pid, as far as known."""
    from .runtime import init, initialized

    if initialized():
        comm = init()
        who = f"rank {comm.rank} of {comm.size}"
    else:
        try:
            from .placement import detect

            p = detect()
            who = f"rank {p.rank} of {p.size} (before init)"
        except Exception:
            who = "a rank (before init)"
    return f"{who} on {socket.gethostname()} (pid {os.getpid()})"


def report_failure(exc_type, exc, tb):
    """Write a traceback headed by the failing rank, host and pid to stderr."""
    if is_peer_lost(exc):
        # Most likely another rank died (or timed out) inside this collective: give
        # the hub a moment to say which, and to end this rank, before blaming this one.
        time.sleep(PEER_GRACE)
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(f"### spmd: {_who()} failed:\n{text}")
    sys.stderr.flush()


def abort(code=1):
    """End this process and, where the launcher allows, the whole job, now."""
    from .runtime import abort_job

    abort_job(code)


def _exit_code(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def run_script(argv):
    """Run argv ([script, args...] or ['-m', module, args...]) as __main__; never returns."""
    from .runtime import finalize

    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        sys.exit(2 if not argv else 0)
    if argv[0] == "-m":
        if len(argv) < 2:
            sys.exit(USAGE)
        module, sys.argv = argv[1], argv[1:]
        target = lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        path, sys.argv = argv[0], list(argv)
        if not os.path.exists(path):
            sys.exit(f"python -m spmd: cannot open {path!r}: no such file")
        sys.path[0] = os.path.dirname(os.path.abspath(path))
        target = lambda: runpy.run_path(path, run_name="__main__")
    if os.environ.get("SPMD_PREEMPT_SIGNAL"):
        # A batch file asked for a warning signal before the time limit:
        # catch it, so that it calls the job's hooks instead of ending it.
        from .preempt import install

        install()
    try:
        target()
    except SystemExit as exc:
        code = _exit_code(exc)
        if code:
            sys.stderr.write(f"### spmd: {_who()} exited with status {code}; ending the job\n")
            abort(code)
    except BaseException:
        report_failure(*sys.exc_info())
        abort(1)
    finalize()
    sys.exit(0)
