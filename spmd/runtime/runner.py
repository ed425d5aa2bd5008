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
import sys

from spmd.failfast.abort import abort_job, report_failure
from spmd.failfast.abort import who as _who
from spmd.runtime.output import whole_lines
from spmd.runtime.usage import UsageExit, say_once, speaks
from spmd.config.settings import parse_preempt_signal

__all__ = ["run_script", "abort", "report_failure"]

USAGE = "usage: python -m spmd [-m module | script.py] [args...]"


def abort(code=1, after=None):
    """End this process and, where the launcher allows, the whole job, now (after: see abort_job)."""
    abort_job(code, after)


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
    from spmd.runtime.start import finalize

    if not argv or argv[0] in ("-h", "--help"):
        if not argv:
            say_once(USAGE)
        if speaks():
            print(USAGE)
        sys.exit(0)
    if argv[0] == "-m":
        if len(argv) < 2:
            say_once(f"python -m spmd: -m needs a module name\n{USAGE}")
        module, sys.argv = argv[1], argv[1:]
        target = lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        path, sys.argv = argv[0], list(argv)
        if path.startswith("-"):
            say_once(f"python -m spmd: no option {path!r} (spmd's options go to spmd run or to "
                     f"SPMD_* variables)\n{USAGE}")
        if not os.path.exists(path):  # a file system may differ between hosts: said once per host
            say_once(f"python -m spmd: cannot open {path!r}: no such file", per_host=True)
        sys.path[0] = os.path.dirname(os.path.abspath(path))
        target = lambda: runpy.run_path(path, run_name="__main__")
    signum = parse_preempt_signal(os.environ)
    if signum is not None:
        # A batch file asked for a warning signal before the time limit:
        # catch it, so that it calls the job's hooks instead of ending it.
        from spmd.runtime.preempt import install

        install(signum)
    try:
        whole_lines(os.environ)  # before the script's first print, not at its first use of comm
        target()
    except UsageExit as exc:  # said once already, and every rank ends alike: no report, no abort
        sys.exit(exc.code)
    except SystemExit as exc:
        code = _exit_code(exc)
        if code:
            sys.stderr.write(f"### spmd: {_who()} exited with status {code}; ending the job\n")
            abort(code)
    except BaseException as exc:
        if getattr(exc, "said", False):  # an error of every rank at init, said once by rank 0
            sys.exit(1)
        abort(1, after=report_failure(*sys.exc_info()))
    finalize()
    sys.exit(0)
