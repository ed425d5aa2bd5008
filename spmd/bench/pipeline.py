"""``spmd bench pipeline``: spmd.pipeline beside the tools a user would pick instead.

The main job's work (1,000,000 x 16 synthetic rows, the mlp task) through
spmd.pipeline in its modes, a hand-written mpi4py Scatterv/Gatherv loop,
multiprocessing.Pool.imap and mpi4py.futures.MPIPoolExecutor.map, each launched
on its own (:mod:`spmd.bench.pipeline_worker`) at 1, 2, 4 and 8 ranks,
interleaved; plus the ``busy`` and ``memory`` scenarios.  Method: docs/bench.md.
"""

import json
import os
import statistics
import subprocess
import sys
import time

from spmd.errors import BenchError
from spmd.bench.startup import clean_env, find_mpirun, launch_record
from spmd.util.paths import PIPELINE_WORKER

__all__ = ["CASES", "measure", "table", "busy", "busy_table", "memory", "memory_table"]

ROWS, CHUNK, FEATURES, OUT_WIDTH = 1_000_000, 131072, 16, 8

#: (label, implementation, options): what each launch runs.
CASES = (
    ("spmd (auto: parallel read)", "spmd", {}),
    ("spmd, no overlap", "spmd", {"overlap": False}),
    ("spmd scatter (read=root)", "spmd", {"read": "root"}),
    ("spmd scatter, no overlap", "spmd", {"read": "root", "overlap": False}),
    ("mpi4py Scatterv/Gatherv loop", "mpi4py", {}),
    ("multiprocessing Pool.imap", "pool", {}),
    ("MPIPoolExecutor.map", "mpipool", {}),
)


def _command(impl, ranks, rows, chunk, options):
    worker = [sys.executable, "-m", PIPELINE_WORKER]
    args = [impl, str(rows), str(chunk), json.dumps(options)]
    if impl in ("serial", "pool"):
        return worker + args
    mpirun = find_mpirun()
    if mpirun is None:
        raise BenchError("the pipeline benchmark needs mpirun: pip install mpich")
    if impl == "mpipool":
        return [mpirun, "-n", str(ranks), sys.executable, "-m", "mpi4py.futures", "-m",
                PIPELINE_WORKER] + args
    return [mpirun, "-n", str(ranks)] + worker + args


def launch(impl, ranks, rows=ROWS, chunk=CHUNK, options=None, env=None, timeout=600):
    """Run one launch; return its PIPELINE_BENCH record (a dict)."""
    options = dict(options or {})
    if impl == "pool":
        options["workers"] = ranks
    extra = {"MPI4PY_FUTURES_BACKOFF": "0", **(env or {})}
    cmd = _command(impl, ranks, rows, chunk, options)
    return launch_record(cmd, clean_env(extra), "PIPELINE_BENCH", timeout)


def _run(out, progress, line, impl, ranks, nrows, chunk, options, env=None, **labels):
    """Launch once, label the record, keep it, and say line (formatted with the record) to progress."""
    rec = launch(impl, ranks, nrows, chunk, options, env=env)
    rec.update(labels, impl=impl, ranks=ranks)
    out.append(rec)
    if progress:
        progress(line.format(**rec, peak_mib=rec["peak_extra_kib"] / 1024))
    return rec


def measure(ranks=(1, 2, 4, 8), repeats=3, rows=ROWS, chunk=CHUNK, progress=None):
    """Run every case at every rank count, interleaved, repeats times; return one row per launch."""
    out = []
    for rep in range(repeats):
        plan = [("one process, one thread", "serial", {}, 1)]
        plan += [(label, impl, opts, n) for n in ranks for label, impl, opts in CASES
                 if not (impl == "mpipool" and n < 2)]
        for label, impl, opts, n in plan:
            _run(out, progress, f"  repeat {rep + 1}/{repeats} {label:<30} {n} ranks {{seconds:8.3f}} s "
                 "crc {checksum}", impl, n, rows, chunk, opts, case=label, repeat=rep)
    return out


def _median(rows, **match):
    got = [r["seconds"] for r in rows if all(r.get(k) == v for k, v in match.items())]
    return statistics.median(got) if got else None


def summary(rows):
    """Return {(case, ranks): {seconds, spread, vs_one, vs_mpi4py, vs_pool}} from measure's rows."""
    one = _median(rows, impl="serial")
    out = {}
    for r in rows:
        key = (r["case"], r["ranks"])
        if key in out:
            continue
        runs = [x["seconds"] for x in rows if (x["case"], x["ranks"]) == key]
        med = statistics.median(runs)
        loop = _median(rows, impl="mpi4py", ranks=r["ranks"])
        pool = _median(rows, impl="pool", ranks=r["ranks"])
        out[key] = {"seconds": med, "min": min(runs), "max": max(runs), "runs": len(runs),
                    "speedup": one / med if one else None,
                    "vs_mpi4py": med / loop if loop else None, "vs_pool": med / pool if pool else None,
                    "checksums": sorted({x["checksum"] for x in rows if (x["case"], x["ranks"]) == key}),
                    "peak_extra_mib": max(x["peak_extra_kib"] for x in rows if (x["case"], x["ranks"]) == key) / 1024}
    return out


def table(rows):
    """Return the table for people: median seconds, speed-up over one process, ratios to the peers."""
    s = summary(rows)
    ranks = sorted({r for _, r in s})
    checks = {c for v in s.values() for c in v["checksums"]}
    w = 38
    lines = [f"{'median seconds (speed-up over one process)':<{w}}" + "".join(f"{f'{n} ranks':>18}" for n in ranks)]
    for label in dict.fromkeys(c for c, _ in s):
        cells = []
        for n in ranks:
            v = s.get((label, n))
            cells.append(f"{v['seconds']:>9.3f} ({v['speedup']:.2f}x)" if v else f"{'-':>18}")
        lines.append(f"{label:<{w}}" + "".join(f"{c:>18}" for c in cells))
    lines.append("")
    lines.append(f"{'time / (mpi4py loop, Pool), same ranks':<{w}}" + "".join(f"{f'{n} ranks':>18}" for n in ranks))
    for label in dict.fromkeys(c for c, _ in s):
        if not label.startswith("spmd"):
            continue
        cells = []
        for n in ranks:
            v = s.get((label, n))
            if not v:
                cells.append("-")
                continue
            loop = f"{v['vs_mpi4py']:.2f}" if v["vs_mpi4py"] else "-"
            pool = f"{v['vs_pool']:.2f}" if v["vs_pool"] else "-"
            cells.append(f"{loop} / {pool}")
        lines.append(f"{label:<{w}}" + "".join(f"{c:>18}" for c in cells))
    lines.append("")
    lines.append(f"every launch's output checksum: {', '.join(sorted(checks))}"
                 + ("" if len(checks) == 1 else "  (THEY DIFFER)"))
    return "\n".join(lines)


# -- a busy neighbour: balance even against speed -----------------------------------------


def _spinner(core):
    code = ("import os, time\n"
            f"os.sched_setaffinity(0, {{{core}}})\n"
            "end = time.time() + 600\n"
            "while time.time() < end:\n    pass\n")
    return subprocess.Popen([sys.executable, "-c", code])


def busy(repeats=5, rows=ROWS, chunk=CHUNK, progress=None, balances=("even", "speed"), spinners=1):
    """Two ranks, one per core; spinners busy processes on rank 1's core; each balance once per repeat.

    Linux shares a core among runnable threads: rank 1 runs two (fn, and
    the reader ahead of it), so one spinning process leaves it about two
    thirds of its core, two about half.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise BenchError("the busy scenario needs two cores")
    out = []
    running = [_spinner(cores[1]) for _ in range(spinners)]
    try:
        time.sleep(0.2)
        for rep in range(repeats):
            for bal in balances:
                _run(out, progress, f"  repeat {rep + 1}/{repeats} balance={bal:<6} {{seconds:8.3f}} s "
                     "rows per rank {rows_per_rank}", "spmd", 2, rows, chunk, {"balance": bal},
                     env={"SPMD_BENCH_PIN": "1"}, case=f"balance={bal}", balance=bal, repeat=rep, spinners=spinners)
    finally:
        for spinner in running:
            spinner.kill()
            spinner.wait()
    return out


def busy_table(rows):
    lines = [f"2 ranks, one per core, {rows[0].get('spinners', 1)} busy process(es) on rank 1's core (medians):"]
    meds = {}
    for bal in dict.fromkeys(r["balance"] for r in rows):
        runs = [r for r in rows if r["balance"] == bal]
        med = statistics.median(r["seconds"] for r in runs)
        meds[bal] = med
        share = statistics.median(r["rows_per_rank"][1] / sum(r["rows_per_rank"]) for r in runs)
        pace = statistics.median(r["rows_per_rank"][1] * r["busy_per_rank"][0]
                                 / (r["rows_per_rank"][0] * r["busy_per_rank"][1]) for r in runs)
        lines.append(f"  balance={bal:<7} {med:7.3f} s  (runs {min(r['seconds'] for r in runs):.3f}-"
                     f"{max(r['seconds'] for r in runs):.3f}); rank 1's share of rows {share:.0%}, "
                     f"its measured speed {pace:.2f}x rank 0's")
    if "even" in meds and "speed" in meds:
        lines.append(f"  speed is {meds['even'] / meds['speed']:.2f}x faster than even")
    return "\n".join(lines)


# -- root's memory at several input sizes --------------------------------------------------


def memory(sizes=(1_000_000, 10_000_000), ranks=2, chunk=CHUNK, progress=None, repeats=1):
    """Root's peak memory above its size at the clock's start, per input size and read mode."""
    out = []
    for rep in range(repeats):
        for rows in sizes:
            for label, opts in (("parallel read", {}), ("scatter (read=root)", {"read": "root"})):
                _run(out, progress, f"  {label:<22} {rows:>10} rows: root's peak +{{peak_mib:.1f}} MiB in "
                     "{seconds:.2f} s", "spmd", ranks, rows, chunk, opts, case=label, rows=rows, repeat=rep)
    return out


def memory_table(rows, chunk=CHUNK):
    per_round = chunk * (FEATURES + OUT_WIDTH) * 4 / (1 << 20)
    lines = [f"root's peak resident memory above its size at the start ({rows[0]['ranks']} ranks); one round's "
             f"input plus output is {per_round:.1f} MiB, 3x that {3 * per_round:.1f} MiB:"]
    for r in rows:
        extra = r["peak_extra_kib"] / 1024
        lines.append(f"  {r['case']:<22} {r['rows']:>10} rows  +{extra:6.1f} MiB  ({extra / per_round:.2f}x a round)"
                     f"  {r['seconds']:.2f} s")
    return "\n".join(lines)


def plot(rows, path, title):
    """Write a PNG: median seconds against ranks, one line per case, one process as a level."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install matplotlib") from None
    from spmd.util.atomic import atomic_path

    s = summary(rows)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label in dict.fromkeys(c for c, _ in s):
        if label.startswith("one process"):
            ax.axhline(s[(label, 1)]["seconds"], color="gray", linestyle=":", label=label)
            continue
        pts = sorted((n, v["seconds"]) for (c, n), v in s.items() if c == label)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                linestyle="-" if label.startswith("spmd") else "--", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({n for _, n in s}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("ranks (processes)")
    ax.set_ylabel("seconds, first read to last result on root (median)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
