"""Start-up cost: separate ``mpirun -n N`` launches, wall clock, several repeats.

Each scenario is a short Python program run on every rank.  It writes
the time to a file of its own when it is ready (its imports done, or its
first collective finished); "ready" is the slowest rank's stamp minus
the moment the launcher was started, "wall" is the launcher's exit, and
"cpu" the user+system seconds of the launcher and every rank.  Each
scenario also notes whether any rank had torch imported when ready.  The
scenarios run interleaved, repeat after repeat, and the median of each
is reported.
"""

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from spmd.errors import BenchError
from spmd.launch.supervise import STRIPPED

__all__ = ["scenarios", "measure", "startup_table", "find_mpirun", "first_collective_wrapper"]

# Each rank writes "<time> <torch imported>" to a file of its own: output lines could interleave.
_STAMP = ("open(__import__('os').path.join(__import__('os').environ['SPMD_BENCH_DIR'], "
          "'ready.%d' % __import__('os').getpid()), 'w').write("
          "'%r %s' % (__import__('time').time(), 'torch' in __import__('sys').modules))")

# Stamp the end of the first collective (re-entrant: scatter calls broadcast_object).
_FIRST = """
PRELUDE
import os, runpy, sys, time
import spmd.comms.comm as _b
_depth, _done = [0], [False]
def _wrap(name):
    f = getattr(_b.Comm, name)
    def w(self, *a, **k):
        _depth[0] += 1
        try:
            return f(self, *a, **k)
        finally:
            _depth[0] -= 1
            if not _depth[0] and not _done[0]:
                _done[0] = True
                STAMP
    setattr(_b.Comm, name, w)
for _n in ('broadcast', 'reduce', 'all_reduce', 'scatter', 'gather', 'all_gather', 'barrier',
           'broadcast_object', 'gather_object', 'all_gather_object', 'scatter_object'):
    _wrap(_n)
sys.argv = [SCRIPT, *ARGS]
sys.path.insert(0, os.path.dirname(SCRIPT))
runpy.run_path(SCRIPT, run_name='__main__')
"""


def first_collective_wrapper(script, stamp, args=(), prelude=""):
    """Return Python code that runs script as __main__ (with args) and stamp, one statement,
    once the process's first spmd collective has ended; prelude runs before anything."""
    return (_FIRST.replace("PRELUDE", prelude).replace("STAMP", stamp)
            .replace("SCRIPT", repr(str(script))).replace("ARGS", repr(list(args))))


def scenarios(script=None):
    """Return [(name, code, extra environment)] in the order of the breakdown."""
    out = [
        ("python -c pass", "pass", {}),
        ("import mpi4py.MPI", "import mpi4py.MPI", {}),
        ("import numpy, mpi4py.MPI", "import numpy, mpi4py.MPI", {}),
        ("spmd numpy all_reduce (mpi)",
         "import numpy as np\nfrom spmd import comm\ncomm.all_reduce(np.ones(1))", {}),
        ("import torch", "import torch", {}),
        ("import torch, mpi4py.MPI", "import torch, mpi4py.MPI", {}),
        ("spmd torch all_reduce (mpi)",
         "import torch\nfrom spmd import comm\ncomm.all_reduce(torch.ones(1))", {}),
        ("spmd torch all_reduce (gloo)",
         "import torch\nfrom spmd import comm\ncomm.all_reduce(torch.ones(1))", {"SPMD_BACKEND": "gloo"}),
    ]
    out = [(name, code + "\n" + _STAMP, env) for name, code, env in out]
    if script is not None:
        code = first_collective_wrapper(script, _STAMP)
        out.append((f"{Path(script).name}: first collective", code, {}))
    return out


def find_mpirun():
    """Return the mpirun next to this Python, else on PATH, else None."""
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def clean_env(extra):
    """This process's environment without any launcher's or spmd's settings, plus extra.

    PYTHONDONTWRITEBYTECODE goes too: without bytecode caches every launch
    compiles spmd from source (tens of ms per rank), which no installed
    package does.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in STRIPPED and k != "PYTHONDONTWRITEBYTECODE"
           and not k.startswith(("SPMD_", "PMI_", "OMPI_", "PMIX_", "MV2_"))}
    env.update(extra)
    return env


def launch_record(cmd, env, tag, timeout):
    """Run one benchmark launch; return the JSON record its one ``TAG {json}`` line carries.

    Raises BenchError with the command, its exit status and the tails of
    its output unless it exits 0 and prints exactly one such line.
    """
    import json
    import subprocess

    from spmd.errors import BenchError

    proc = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(tag + " ")]
    if proc.returncode != 0 or len(lines) != 1:
        raise BenchError(f"{' '.join(map(str, cmd))} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads(lines[0].split(" ", 1)[1])


def _launch(mpirun, ranks, code, env, timeout):
    with tempfile.TemporaryDirectory(prefix="spmd-bench-") as stamps:
        env = dict(env, SPMD_BENCH_DIR=stamps)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.time()
        proc = subprocess.run([mpirun, "-n", str(ranks), sys.executable, "-c", code], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        wall = time.time() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise BenchError(f"start-up launch failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}")
        marks = [Path(stamps, f).read_text().split() for f in os.listdir(stamps)]
    if len(marks) != ranks:
        raise BenchError(f"{len(marks)} of {ranks} ranks reported ready; output:\n{proc.stdout[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"ready_s": max(float(m[0]) for m in marks) - t0, "wall_s": wall, "cpu_s": cpu,
            "torch_imported": any(m[1] == "True" for m in marks)}


def measure(ranks=8, repeats=5, script=None, mpirun=None, timeout=300, progress=None):
    """Launch each scenario repeats times, interleaved; return one dict per scenario (medians)."""
    mpirun = mpirun or find_mpirun()
    if mpirun is None:
        raise BenchError("mpirun not found: pip install mpich (or put an mpirun on PATH)")
    cases = [(name, code, clean_env(extra)) for name, code, extra in scenarios(script)]
    runs = {name: [] for name, _, _ in cases}
    # A first launch of each at 2 ranks, untimed: imports compile and cache their
    # bytecode then (if the install is writable), as after any first run.
    for name, code, env in cases:
        _launch(mpirun, min(ranks, 2), code, env, timeout)
    for rep in range(repeats):
        for name, code, env in cases:
            result = _launch(mpirun, ranks, code, env, timeout)
            runs[name].append(result)
            if progress:
                progress(f"start-up {rep + 1}/{repeats} {name}: ready {result['ready_s']:.2f} s")
    out = []
    for name, _, _ in cases:
        rs = runs[name]
        row = {"scenario": name, "ranks": ranks, "repeats": repeats}
        for key in ("ready_s", "wall_s", "cpu_s"):
            vals = [r[key] for r in rs]
            row[key] = float(np.median(vals))
            row[key.replace("_s", "_all_s")] = [round(v, 3) for v in vals]
        row["torch_imported"] = any(r["torch_imported"] for r in rs)
        out.append(row)
    return out


def startup_table(rows):
    """Return the start-up breakdown as text, with the issue's two ratios."""
    if not rows:
        return ""
    by = {r["scenario"]: r for r in rows}
    lines = [f"== start-up, {rows[0]['ranks']} ranks, median of {rows[0]['repeats']} launches ==",
             f"{'scenario':<44}{'ready s':>9}{'wall s':>9}{'cpu s':>9}  torch imported"]
    for r in rows:
        lines.append(f"{r['scenario']:<44}{_s(r['ready_s'])}{_s(r['wall_s'])}{_s(r['cpu_s'])}  {r['torch_imported']}")
    for label, a, b in _ratios(by):
        lines.append(f"{label}: {a / b:.2f}x" if a and b else f"{label}: -")
    return "\n".join(lines)


def _ratios(by):
    def ready(name):
        return by[name]["ready_s"] if name in by else None

    out = [("spmd numpy script on mpi / import mpi4py.MPI (issue: <= 2x)",
            ready("spmd numpy all_reduce (mpi)"), ready("import mpi4py.MPI")),
           ("spmd numpy script on mpi / import numpy, mpi4py.MPI",
            ready("spmd numpy all_reduce (mpi)"), ready("import numpy, mpi4py.MPI"))]
    for name in by:
        if name.endswith(": first collective"):
            out.append((f"{name} / import torch (issue: <= 1.3x)", ready(name), ready("import torch")))
    return out


def _s(v):
    return f"{v:>9.2f}" if v is not None else f"{'-':>9}"
