"""Tests under pytest: spmd's plugin beside pytest_parallel, one mpirun per test and MultiProcessTestCase.

    python -m benchmarks.pytest_runners [--tests 200] [--ranks 4] [--repeats 3] [--per-test-sample 10]

Writes the same N tests of R ranks (an all_reduce, a broadcast and an all_gather,
each checked) in each tool's API into a temporary directory, and times each way
of running them, interleaved over repeats (the order rotated by one way per
repeat); the table gives medians.  One mpirun per test and MultiProcessTestCase
time a sample of the tests and are scaled to N.  pytest_parallel (not on PyPI)
and expecttest (torch's test helpers need it) come from --tools-path.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from spmd.errors import BenchError
from spmd.bench.startup import clean_env, find_mpirun

__all__ = ["WAYS", "LABELS", "FILES", "sources", "sample", "commands", "measure", "bench", "table", "targets",
           "report", "main"]

WAYS = ("spmd", "spmd-mpirun", "pytest_parallel", "mpirun-per-test", "torch")
SPMD_WAYS = ("spmd", "spmd-mpirun")  # a failure there is spmd's, and ends the benchmark
SCALED = ("mpirun-per-test", "torch")
LABELS = {
    "spmd": "spmd plugin, `pytest`",
    "spmd-mpirun": "spmd plugin, `mpirun -n {r} pytest`",
    "pytest_parallel": "pytest_parallel (static scheduler), `mpirun -n {r} pytest`",
    "mpirun-per-test": "one `mpirun -n {r} pytest FILE::test_k` per test (mpi4py), scaled from {k}",
    "torch": "torch MultiProcessTestCase (gloo, spawn), scaled from {k}",
}
#: The file each way runs (the kind of sources() it holds).
FILES = {"spmd": "test_spmd_plugin.py", "pytest_parallel": "test_pytest_parallel_mark.py",
         "mpi4py": "test_mpi4py_world.py", "torch": "test_torch_mptc.py"}
PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider")
MIRROR = "/work/.mirror/onera+pytest_parallel/repo"
INSTALL = {
    "pytest_parallel": ("ONERA's pytest_parallel is not on PyPI: mkdir /tmp/pytest_parallel_src && "
                        f"git --git-dir={MIRROR} archive HEAD | tar -x -C /tmp/pytest_parallel_src, then "
                        "--tools-path /tmp/pytest_parallel_src (not pip install into this venv: its plugin "
                        "would load in every pytest run, and its --timeout clashes with pytest-timeout's)"),
    "torch": "pip install --target /tmp/bench_tools expecttest, then --tools-path /tmp/bench_tools",
}

_SPMD = '''"""{n} tests of {r} ranks for spmd's pytest plugin."""
import numpy as np
import pytest

RANKS = {r}


def check(comm, k):
    n, r = comm.size, comm.rank
    assert n == RANKS
    total = comm.all_reduce(np.full(4, float(r + k)))
    assert total.tolist() == [n * k + n * (n - 1) / 2] * 4
    value = np.arange(4.0) + k if r == 0 else np.zeros(4)
    assert comm.broadcast(value, root=0).tolist() == (np.arange(4.0) + k).tolist()
    parts = comm.all_gather(np.array([10 * r + k]))
    assert [int(p[0]) for p in parts] == [10 * i + k for i in range(n)]
'''
_MPI4PY = '''"""{n} tests of {r} ranks on mpi4py communicators ({what})."""
import numpy as np
{imports}

RANKS = {r}


def check(comm, k):
    n, r = comm.size, comm.rank
    assert n == RANKS
    total = np.empty(4)
    comm.Allreduce(np.full(4, float(r + k)), total)
    assert total.tolist() == [n * k + n * (n - 1) / 2] * 4
    value = np.arange(4.0) + k if r == 0 else np.zeros(4)
    comm.Bcast(value, root=0)
    assert value.tolist() == (np.arange(4.0) + k).tolist()
    parts = np.empty(n, dtype=np.int64)
    comm.Allgather(np.array([10 * r + k], dtype=np.int64), parts)
    assert parts.tolist() == [10 * i + k for i in range(n)]
'''
_TORCH = '''"""{n} tests of {r} ranks as torch's MultiProcessTestCase (gloo)."""
import os

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class Collectives(MultiProcessTestCase):
    @property
    def world_size(self):
        return {r}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def tearDown(self):
        super().tearDown()
        try:
            os.remove(self.file_name)
        except OSError:
            pass

    def check(self, k):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        n, r = self.world_size, self.rank
        total = torch.full((4,), float(r + k), dtype=torch.float64)
        dist.all_reduce(total)
        assert total.tolist() == [n * k + n * (n - 1) / 2] * 4
        value = torch.arange(4.0, dtype=torch.float64) + k if r == 0 else torch.zeros(4, dtype=torch.float64)
        dist.broadcast(value, src=0)
        assert value.tolist() == (torch.arange(4.0) + k).tolist()
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(parts, torch.tensor([10 * r + k]))
        assert [int(p[0]) for p in parts] == [10 * i + k for i in range(n)]
        dist.destroy_process_group()
'''
_TESTS = {
    "spmd": "\n\n@pytest.mark.spmd(ranks={r})\ndef test_{k}(comm):\n    check(comm, {k})\n",
    "pytest_parallel": "\n\n@pytest_parallel.mark.parallel({r})\ndef test_{k}(comm):\n    check(comm, {k})\n",
    "mpi4py": "\n\ndef test_{k}():\n    check(MPI.COMM_WORLD, {k})\n",
    "torch": "\n    def test_{k}(self):\n        self.check({k})\n",
}


def sources(tests=200, ranks=4):
    """Return {kind: the source of a file of tests tests of ranks ranks} for each kind of FILES."""
    heads = {
        "spmd": _SPMD.format(n=tests, r=ranks),
        "pytest_parallel": _MPI4PY.format(n=tests, r=ranks, what="pytest_parallel's comm fixture",
                                          imports="import pytest_parallel"),
        "mpi4py": _MPI4PY.format(n=tests, r=ranks, what="MPI.COMM_WORLD: one mpirun per test",
                                 imports="from mpi4py import MPI"),
        "torch": _TORCH.format(n=tests, r=ranks),
    }
    return {kind: head + "".join(_TESTS[kind].format(r=ranks, k=k) for k in range(tests))
            for kind, head in heads.items()}


def sample(tests, count):
    """Return the indices of count tests spread evenly over tests (all of them when count >= tests)."""
    if count >= tests:
        return list(range(tests))
    return sorted({i * tests // count for i in range(count)})


def commands(paths, ranks, picked, mpirun, block_parallel=False, parallel_entry=False, junit="junit.xml"):
    """Return {way: [argv, ...]}: one argv per way, one per picked test for mpirun-per-test.

    paths: {kind: file}; block_parallel: pytest_parallel's entry point is
    installed where spmd's and mpi4py's ways run (they leave it out);
    parallel_entry: where pytest_parallel's and torch's run (else -p loads it).
    """
    py = [sys.executable, *PYTEST]
    block = ["-p", "no:parallel"] if block_parallel else []
    load = [] if parallel_entry else ["-p", "pytest_parallel.plugin"]
    block_tools = ["-p", "no:parallel"] if parallel_entry else []  # torch runs in pytest_parallel's env
    torch_ids = [f"{paths['torch']}::Collectives::test_{k}" for k in picked]
    out = {"spmd": [[*py, *block, str(paths["spmd"])]],
           "torch": [[*py, *block_tools, "-p", "no:spmd", "--junitxml", str(junit), *torch_ids]]}
    if mpirun is not None:
        launch = [mpirun, "-n", str(ranks)]
        out["spmd-mpirun"] = [[*launch, *py, *block, str(paths["spmd"])]]
        out["pytest_parallel"] = [[*launch, *py, "-p", "no:spmd", "-p", "no:timeout", *load, "--scheduler=static",
                                   str(paths["pytest_parallel"])]]
        out["mpirun-per-test"] = [[*launch, *py, *block, "-p", "no:spmd", f"{paths['mpi4py']}::test_{k}"]
                                  for k in picked]
    return {way: out[way] for way in WAYS if way in out}


def _env(tools_path):
    env = clean_env({})
    if tools_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tools_path, env.get("PYTHONPATH")) if p)
    return env


def _missing(module, env):
    """Return why python cannot import module in env, or None when it can."""
    done = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    return None if done.returncode == 0 else (done.stdout.strip().splitlines() or ["?"])[-1]


def _parallel_entry(env):
    """Whether pytest would load pytest_parallel's entry point (pytest11: parallel) in env."""
    code = ("import importlib.metadata as m\n"
            "print(any(e.name == 'parallel' for e in m.entry_points(group='pytest11')))")
    done = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, timeout=300)
    return done.stdout.strip() == "True"


def _run(argv, env, cwd, timeout):
    """Run argv; return its wall time in seconds, or raise BenchError when it fails."""
    t0 = time.monotonic()
    done = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited with {done.returncode}:\n{done.stdout[-3000:]}")
    return wall


def _junit_times(path):
    return [float(case.get("time", 0)) for case in ET.parse(path).getroot().iter("testcase")]


def _time_way(way, argvs, env, cwd, tests, picked, junit, timeout):
    """Return one repeat's seconds for all tests tests (scaled from the picked ones where sampled)."""
    walls = [_run(argv, env, cwd, timeout) for argv in argvs]
    if way == "mpirun-per-test":
        return sum(walls) * tests / len(picked)
    if way == "torch" and len(picked) < tests:
        times = _junit_times(junit)  # the start of pytest once, each test's own time for the rest
        return walls[0] + (tests - len(picked)) * statistics.mean(times)
    return walls[0]


def measure(tests=200, ranks=4, repeats=3, per_test=10, ways=WAYS, tools_path=None, mpirun=None,
            timeout=1800, progress=None):
    """Time each way repeats times, interleaved; return ({way: [seconds]}, {way: why skipped}, {way: command})."""
    mpirun = mpirun or find_mpirun()
    picked = sample(tests, per_test)
    times, skipped = {}, {}
    base, tools = _env(None), _env(tools_path)
    with tempfile.TemporaryDirectory(prefix="spmd-pytest-bench-") as tmp:
        tmp = Path(tmp)
        (tmp / "pytest.ini").write_text("[pytest]\n")  # the rootdir: no ini file above it counts
        paths = {kind: tmp / FILES[kind] for kind in FILES}
        for kind, text in sources(tests, ranks).items():
            paths[kind].write_text(text)
        junit = tmp / "junit.xml"
        argvs = commands(paths, ranks, picked, mpirun, _parallel_entry(base), _parallel_entry(tools), junit)
        for way in ways:
            if way not in argvs:
                skipped[way] = "no mpirun: pip install mpich"
        envs = {way: tools if way in ("pytest_parallel", "torch") else base for way in argvs}
        checks = {"pytest_parallel": "pytest_parallel.plugin", "torch": "torch.testing._internal.common_distributed"}
        for way, module in checks.items():
            why = way in ways and way in argvs and _missing(module, envs[way])
            if why:
                skipped[way] = f"cannot import {module} ({why}); {INSTALL[way]}"
        chosen = [w for w in ways if w in argvs and w not in skipped]
        for rep in range(repeats):
            k = rep % len(chosen) if chosen else 0
            for way in chosen[k:] + chosen[:k]:
                if way in skipped:
                    continue
                try:
                    seconds = _time_way(way, argvs[way], envs[way], tmp, tests, picked, junit, timeout)
                except (BenchError, subprocess.TimeoutExpired) as exc:
                    if way in SPMD_WAYS:
                        raise
                    skipped[way] = f"failed: {str(exc)[-600:]}"
                    times.pop(way, None)
                    continue
                times.setdefault(way, []).append(seconds)
                if progress:
                    progress(f"repeat {rep + 1}/{repeats} {way}: {seconds:.2f} s for {tests} tests"
                             f"{' (scaled)' if way in SCALED and len(picked) < tests else ''}, "
                             f"load {os.getloadavg()[0]:.2f}")
        shown = {way: " ".join(a.replace(str(tmp) + os.sep, "") for a in argv[0])
                 for way, argv in argvs.items() if way in ways}
    return times, skipped, shown


def bench(tests=200, ranks=4, repeats=3, per_test=10, ways=WAYS, tools_path=None, progress=None):
    """Measure; return the JSON document (``report(doc)`` makes the text)."""
    doc = {"schema": "spmd-bench-pytest/1", "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "uptime": _uptime(), "load_average_start": list(os.getloadavg()), "cpus": os.cpu_count(),
           "tests": tests, "ranks": ranks, "repeats": repeats, "sampled": len(sample(tests, per_test))}
    doc["times"], doc["skipped"], doc["commands"] = measure(tests, ranks, repeats, per_test, ways, tools_path,
                                                            progress=progress)
    doc["load_average_end"] = list(os.getloadavg())
    doc["targets"] = [{"target": t, "met": ok, "how": how} for t, ok, how in targets(doc)]
    return doc


def _uptime():
    if shutil.which("uptime"):
        done = subprocess.run(["uptime"], stdout=subprocess.PIPE, text=True)
        if done.returncode == 0:
            return done.stdout.strip()
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _medians(doc):
    return {way: statistics.median(v) for way, v in doc["times"].items() if v}


def table(doc):
    """Return the markdown table: way, median seconds for the tests, spread, ms per test, time / plain pytest's."""
    n, meds = doc["tests"], _medians(doc)
    plain = meds.get("spmd")
    lines = [f"| way | seconds for {n} tests | spread (min-max) | ms per test | time / plain pytest's |",
             "|---|---:|---:|---:|---:|"]
    for way in WAYS:
        if way not in meds:
            continue
        label = LABELS[way].format(r=doc["ranks"], k=doc["sampled"])
        if doc["sampled"] >= n:
            label = label.split(", scaled")[0]
        v = doc["times"][way]
        ratio = "-" if not plain else f"{meds[way] / plain:.2f}"
        lines.append(f"| {label} | {meds[way]:.2f} | {min(v):.2f}-{max(v):.2f} | {meds[way] / n * 1e3:.1f} "
                     f"| {ratio} |")
    return "\n".join(lines)


def targets(doc):
    """Return [(target, met, how)] for the targets whose ways were measured."""
    meds, n = _medians(doc), doc["tests"]
    plain = meds.get("spmd")
    if plain is None:
        return []
    limit = 20.0 * n / 200
    scale = "" if n == 200 else f" (20 s for 200: {limit:.1f} s for {n})"
    out = [(f"{n} {doc['ranks']}-rank tests under plain pytest in under {limit:.1f} s{scale}", plain < limit,
            f"{plain:.2f} s")]
    if "mpirun-per-test" in meds:
        r = meds["mpirun-per-test"] / plain
        out.append(("plain pytest at least 5x faster than one mpirun per test", r >= 5,
                    f"{r:.2f}x ({plain:.2f} s against {meds['mpirun-per-test']:.2f} s, scaled)"))
    if "pytest_parallel" in meds:
        r = meds["pytest_parallel"] / plain
        out.append(("plain pytest no slower than pytest_parallel under mpirun", r >= 1,
                    f"{r:.2f}x pytest_parallel's speed ({plain:.2f} s against {meds['pytest_parallel']:.2f} s)"))
    return out


def report(doc):
    """Return the text for people: the date, the load, the table, the targets, the rows left out."""
    start, end = doc["load_average_start"], doc["load_average_end"]
    lines = [f"{doc['started']}; {doc['cpus']} CPUs; uptime: {doc['uptime']}",
             f"load average: start {start[0]:.2f} {start[1]:.2f} {start[2]:.2f}, end {end[0]:.2f} {end[1]:.2f} "
             f"{end[2]:.2f}",
             f"{doc['tests']} tests of {doc['ranks']} ranks, medians of {doc['repeats']} interleaved repeats"
             + (f"; scaled rows time {doc['sampled']} tests" if doc["sampled"] < doc["tests"] else ""), "",
             table(doc), "", "targets:"]
    for label, ok, how in targets(doc):
        lines.append(f"  {'met    ' if ok else 'NOT met'}  {label}: {how}")
    if doc["skipped"]:
        lines += ["", "left out:"] + [f"  {way}: {why}" for way, why in doc["skipped"].items()]
    lines += ["", "commands (in the temporary directory):"] + [f"  {w}: {c}" for w, c in doc["commands"].items()]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.pytest_runners", description=__doc__.split("\n")[0])
    p.add_argument("--tests", type=int, default=200, help="tests in each file [default: 200]")
    p.add_argument("--ranks", type=int, default=4, help="ranks of each test [default: 4]")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--per-test-sample", type=int, default=10,
                   help="tests timed by the sampled ways (one mpirun per test, torch), scaled to --tests [default: 10]")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated [default: {','.join(WAYS)}]")
    p.add_argument("--tools-path", default=None,
                   help="directories (os.pathsep between) on PYTHONPATH for pytest_parallel and torch's ways")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--quiet", action="store_true")
    o = p.parse_args(argv)
    ways = [w.strip() for w in o.ways.split(",") if w.strip()]
    if sorted(set(ways) - set(WAYS)) or min(o.tests, o.ranks, o.repeats, o.per_test_sample) < 1:
        p.error(f"--ways: choose from {', '.join(WAYS)}; --tests, --ranks, --repeats, --per-test-sample: >= 1")
    progress = None if o.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        doc = bench(o.tests, o.ranks, o.repeats, o.per_test_sample, ways, o.tools_path, progress)
    except (BenchError, subprocess.TimeoutExpired) as exc:
        sys.exit(f"python -m benchmarks.pytest_runners: {exc}")
    print(report(doc))
    if o.json_path:
        from spmd.bench.report import write_json

        write_json(o.json_path, doc)
        print(f"wrote {o.json_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
