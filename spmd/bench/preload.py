"""What ``spmd run --preload torch`` saves: a job's start against an empty script and mpirun.

``python -m spmd.bench.preload [-n 8] [--repeats 3] [--job jobs/scatter_gather.py]``
runs the scenarios empty, preload, kept, spawn and mpirun interleaved, each a
separate launch, and reports the median of each: the first collective (the
slowest rank's, from the launcher's start), the wall time and the CPU time.
The scenarios, the targets and how the kept server is warmed: docs/bench.md.
"""

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spmd.errors import BenchError
from spmd.launch.supervise import STRIPPED
from spmd.bench.startup import first_collective_wrapper

__all__ = ["measure", "report", "find_mpirun", "SCENARIOS"]

SCENARIOS = ("empty", "preload", "kept", "spawn", "mpirun")
_JOB = Path(__file__).resolve().parents[2] / "jobs" / "scatter_gather.py"

# Each rank stamps its start and the end of its first collective into files of its own.
_START = ('import os, time\n'
          'with open(os.path.join(os.environ["SPMD_BENCH_DIR"], "start.%d" % os.getpid()), "w") as out:\n'
          '    out.write(repr(time.time()))')
_STAMP = ('open(os.path.join(os.environ["SPMD_BENCH_DIR"], "stamp.%d" % os.getpid()), "w")'
          '.write(repr(time.time()))')


def _commands(nprocs, wrapper, empty, mpirun, modules):
    """Return {scenario: argv}."""
    spmd = [sys.executable, "-c", "from spmd.cli import main; main()"]
    n = str(nprocs)
    out = {
        "empty": [*spmd, "run", "-n", n, str(empty)],
        "preload": [*spmd, "run", "-n", n, "--preload", ",".join(modules), str(wrapper)],
        "kept": [*spmd, "run", "-n", n, "--preload", ",".join(modules), "--preload-keep", "60", str(wrapper)],
        "spawn": [*spmd, "run", "-n", n, str(wrapper)],
    }
    if mpirun is not None:
        out["mpirun"] = [mpirun, "-n", n, sys.executable, str(wrapper)]
    return out


def _once(argv, env, stamps, nprocs, timeout):
    """Run argv once; return (first collective, script start, wall, cpu) in seconds (None: no stamps)."""
    for old in [*stamps.glob("stamp.*"), *stamps.glob("start.*")]:
        old.unlink()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.time()
    t0 = time.monotonic()
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited with {done.returncode}:\n{done.stdout[-3000:]}")
    firsts = [float(p.read_text()) for p in stamps.glob("stamp.*")]
    starts = [float(p.read_text()) for p in stamps.glob("start.*")]
    first = max(firsts) - began if len(firsts) == nprocs else None
    start = max(starts) - began if len(starts) == nprocs else None
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return first, start, wall, cpu


def find_mpirun():
    """Return the mpirun beside this Python, else on PATH, else None."""
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def measure(nprocs=8, repeats=3, job=None, job_args=(), modules=("torch",), mpirun=None,
            scenarios=SCENARIOS, timeout=600, log=None):
    """Run the scenarios interleaved, repeats times; return {scenario: {"first", "start", "wall", "cpu": [seconds]}}.

    first: the slowest rank's first collective, start: the slowest rank's
    start of the script (both from the launcher's start; none for empty).

    job: the script (default jobs/scatter_gather.py) and job_args its
    arguments; mpirun: its path (default: find_mpirun(); the mpirun
    scenario is left out when there is none); log(text): called after each run.
    """
    job = Path(job or _JOB).resolve()
    mpirun = mpirun or find_mpirun()
    results = {}
    with tempfile.TemporaryDirectory(prefix="spmd-preload-bench-") as tmp:
        tmp = Path(tmp)
        wrapper, empty = tmp / "wrapper.py", tmp / "empty.py"
        wrapper.write_text(first_collective_wrapper(job, _STAMP, job_args, _START))
        empty.write_text("")
        env = {k: v for k, v in os.environ.items() if k not in STRIPPED}
        env["SPMD_BENCH_DIR"] = str(tmp)
        (tmp / "run").mkdir(mode=0o700)  # not tmp itself: its spmd/ would shadow spmd for the wrapper
        env["XDG_RUNTIME_DIR"] = str(tmp / "run")  # kept's server: the benchmark's own, stopped below
        commands = _commands(nprocs, wrapper, empty, mpirun, modules)
        chosen = [s for s in scenarios if s in commands]
        try:
            if "kept" in chosen:
                _once(commands["kept"], env, tmp, nprocs, timeout)  # starts the kept server, untimed
            _repeat(chosen, commands, repeats, env, tmp, nprocs, timeout, results, log)
        finally:
            for path in tmp.glob("run/spmd/*.sock"):  # the kept server exits within a second of this
                path.unlink()
            if "kept" in chosen:
                time.sleep(1.5)
    return results


def _repeat(chosen, commands, repeats, env, tmp, nprocs, timeout, results, log):
    """Run each chosen scenario once per repeat, interleaved, adding to results."""
    for i in range(repeats):
        for name in chosen:
            first, start, wall, cpu = _once(commands[name], env, tmp, nprocs, timeout)
            row = results.setdefault(name, {"first": [], "start": [], "wall": [], "cpu": []})
            row["wall"].append(wall)
            row["cpu"].append(cpu)
            if first is not None and start is not None:
                row["first"].append(first)
                row["start"].append(start)
            if log is not None:
                shown = "" if not row["first"] else f" last script start {start:.2f} s, first collective {first:.2f} s,"
                log(f"repeat {i + 1}/{repeats} {name}:{shown} wall {wall:.2f} s, cpu {cpu:.2f} s")


def _median(values):
    return statistics.median(values) if values else float("nan")


def report(results, nprocs=8):
    """Return a text table of the medians and where the two targets stand."""
    count = len(results["empty"]["wall"])
    lines = [f"medians of {count} runs, -n {nprocs}, seconds from the launcher's start:",
             "scenario   last script start   first collective   wall    cpu"]
    for name, row in results.items():
        start, first = (f"{_median(row[k]):6.2f}" if row[k] else "     -" for k in ("start", "first"))
        lines.append(f"{name:<10} {start:>17} {first:>18} {_median(row['wall']):6.2f} {_median(row['cpu']):6.2f}")
    empty = _median(results["empty"]["wall"])
    if "preload" in results:
        first = _median(results["preload"]["first"])
        lines.append(f"preload's first collective / empty script's wall: {first / empty:.2f} (target <= 2)")
        spent = _median([f - s for f, s in zip(results["preload"]["first"], results["preload"]["start"])])
        lines.append(f"preload's first collective after the last rank's start: {spent:.2f} s "
                     f"({spent / empty:.2f} x the empty script's wall)")
    if "kept" in results:
        first = _median(results["kept"]["first"])
        lines.append(f"kept's first collective / empty script's wall: {first / empty:.2f} (target <= 2)")
    if "preload" in results and "mpirun" in results:
        ratio = _median(results["preload"]["wall"]) / _median(results["mpirun"]["wall"])
        lines.append(f"preload's wall / mpirun's wall: {ratio:.2f} (target <= 0.5)")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m spmd.bench.preload", description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--nprocs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--job", default=None, help="the script to start [default: jobs/scatter_gather.py]")
    parser.add_argument("--preload", default="torch", help="modules to preload [default: torch]")
    parser.add_argument("--mpirun", default=None, help="mpirun to compare with [default: found]")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("args", nargs="*", help="the job's arguments")
    opts = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}",
          flush=True)
    results = measure(opts.nprocs, opts.repeats, opts.job, opts.args, opts.preload.split(","), opts.mpirun,
                      opts.scenarios.split(","), log=lambda text: print(text, flush=True))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(report(results, opts.nprocs))


if __name__ == "__main__":
    main()
