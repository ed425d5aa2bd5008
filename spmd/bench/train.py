"""Training beside DistributedDataParallel: spmd's DataParallel and torch's DDP on the same job.

    python -m spmd.bench.train [--ranks 1,2,4] [--repeats 5] [--steps 30] [--json train.json]

jobs/train_dp.py's TinyBert under DataParallel (gloo and mpi; plain, overlap,
bf16) and DDP on gloo, each launch on its own (:mod:`spmd.bench.train_worker`);
--cases adds powersgd:4 beside DDP with torch's powerSGD_hook, and compress="auto" (LOW_RANK).  Launches are
interleaved over repeats; the table gives medians of the repeats' medians,
their spread, the speed against DDP and the step's parts.  Method: docs/bench.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from spmd.errors import BenchError
from spmd.bench.startup import clean_env, find_mpirun, launch_record
from spmd.util.paths import TRAIN_WORKER

__all__ = ["CASES", "LOW_RANK", "launch", "measure", "losses", "summary", "targets", "report", "bench", "main"]

#: (label, impl, backend, options): what each launch runs.
CASES = (
    ("spmd gloo", "spmd", "gloo", {}),
    ("spmd gloo overlap", "spmd", "gloo", {"overlap": True}),
    ("spmd gloo bf16", "spmd", "gloo", {"compress": "bf16"}),
    ("spmd mpi", "spmd", "mpi", {}),
    ("spmd mpi overlap", "spmd", "mpi", {"overlap": True}),
    ("spmd mpi bf16", "spmd", "mpi", {"compress": "bf16"}),
    ("DDP gloo", "ddp", "gloo", {}),
)
DDP = "DDP gloo"

#: Cases run only when --cases names them: low-rank compression, which pays on slow links only, and
#: compress="auto", which chooses it (or bf16, or nothing) from the link it measures.
LOW_RANK = (
    ("spmd gloo powersgd:4", "spmd", "gloo", {"compress": "powersgd:4"}),
    ("DDP gloo powerSGD:4", "ddp", "gloo", {"powersgd": 4}),
    ("spmd gloo auto", "spmd", "gloo", {"compress": "auto"}),
)

#: The model and batch of the issue: about 3.2 M parameters.
MODEL = {"dim": 256, "layers": 4, "heads": 4, "global_batch": 64}

#: Parts of a step kept per launch, in ms (means over ranks and timed steps).
BREAKDOWN = ("forward", "local_backward", "backward", "sync", "comm", "optimizer", "other")


def _command(backend, ranks, options, launcher):
    args = ["-m", TRAIN_WORKER, json.dumps(options)]
    mpirun = find_mpirun()
    if launcher == "spmd" or (launcher == "auto" and mpirun is None and backend == "gloo"):
        return [sys.executable, "-c", "from spmd.cli import main; main()", "run", "--no-prefix", "-n", str(ranks),
                *args]
    if mpirun is None:
        raise BenchError("the training benchmark's mpi cases need mpirun: pip install mpich")
    return [mpirun, "-n", str(ranks), sys.executable, *args]


def launch(impl, backend, ranks, options=None, launcher="auto", timeout=900):
    """Run one launch; return its TRAIN_BENCH record (a dict)."""
    options = {"impl": impl, **(options or {})}
    env = {"SPMD_BACKEND": backend}
    if backend == "mpi":
        env["SPMD_TORCH_GROUP"] = "0"  # no idle gloo group beside MPI
    cmd = _command(backend, ranks, options, launcher)
    return launch_record(cmd, clean_env(env), "TRAIN_BENCH", timeout)


def _mean(values):
    return sum(values) / len(values)


def digest(record):
    """Reduce one launch's record to its row: step times in ms and the parts' means."""
    w = record["warmup"]
    parts = {k: [steps[w:] for steps in ranks] for k, ranks in record["parts"].items()}
    slowest = [max(r[i] for r in parts["step"]) * 1e3 for i in range(record["steps"])]
    mean = {k: _mean([_mean(r) for r in v]) * 1e3 if v and v[0] else 0.0 for k, v in parts.items()}
    row = {
        "step_ms": statistics.median(slowest),
        "step_p10_ms": _quantile(slowest, 0.1), "step_p90_ms": _quantile(slowest, 0.9),
        "step_mean_ms": mean["step"], "steps_ms": slowest,
        "forward": mean["forward"], "backward": mean["backward"], "sync": mean["sync"],
        "optimizer": mean["optimizer"], "local_forward": mean["local_forward"],
        "local_backward": mean["local_backward"],
    }
    # Communication not hidden: what backward and sync took beyond the local backward.
    row["comm"] = row["backward"] + row["sync"] - row["local_backward"] if row["local_backward"] else None
    row["other"] = row["step_mean_ms"] - (row["forward"] + row["backward"] + row["sync"] + row["optimizer"])
    row["loss0"] = record["losses"][0]
    row["loss_last"] = record["losses"][-1]  # after warmup + steps steps
    for k in ("ranks", "threads", "params", "backend", "bucket_mb", "buckets", "bucket_params", "wall_s"):
        row[k] = record.get(k)
    return row


def _quantile(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def measure(ranks=(1, 2, 4), repeats=5, steps=30, warmup=5, model=None, cases=None, bucket_mb=None,
            probe=True, launcher="auto", progress=None, timeout=900):
    """Run every case at every rank count, interleaved, repeats times; return one row per launch."""
    model = {**MODEL, **(model or {})}
    chosen = list(CASES) if cases is None else [c for c in CASES + LOW_RANK if c[0] in cases]
    out = []
    for rep in range(repeats):
        for n in ranks:
            # Each repeat starts one case later, so no case always runs first or
            # after the same neighbour (the order showed in 1-rank launches).
            k = rep % len(chosen) if chosen else 0
            for label, impl, backend, extra in chosen[k:] + chosen[:k]:
                opts = {**model, "steps": steps, "warmup": warmup, "probe": probe, **extra}
                if impl == "spmd" and bucket_mb is not None:
                    opts["bucket_mb"] = bucket_mb
                row = digest(launch(impl, backend, n, opts, launcher, timeout))
                row.update(case=label, impl=impl, repeat=rep, overlap=bool(extra.get("overlap")),
                           compress=extra.get("compress"), load=os.getloadavg()[0])
                out.append(row)
                if progress:
                    comm = "-" if row["comm"] is None else f"{row['comm']:.1f}"
                    progress(f"  repeat {rep + 1}/{repeats} {n} ranks {label:<18} {row['step_ms']:8.1f} ms/step "
                             f"(comm {comm} ms, sync {row['sync']:.1f} ms) loss0 {row['loss0']:.6f} "
                             f"last {row['loss_last']:.4f} load {row['load']:.2f}")
    return out


def losses(steps=200, ranks=2, backend="mpi", model=None, launcher="auto", progress=None, timeout=1800):
    """Train steps steps in fp32 and with bf16 gradients; return {compress: {"final", "last10", "losses"}}."""
    model = {**MODEL, **(model or {})}
    out = {}
    for compress in (None, "bf16"):
        opts = {**model, "steps": steps, "warmup": 0, "mode": "loss", "compress": compress}
        rec = launch("spmd", backend, ranks, opts, launcher, timeout)
        curve = rec["losses"]
        out[compress or "fp32"] = {"final": curve[-1], "last10": _mean(curve[-10:]), "losses": curve,
                                   "ranks": ranks, "backend": backend, "wall_s": rec["wall_s"]}
        if progress:
            progress(f"  {steps} steps, {ranks} ranks, {backend}, {compress or 'fp32'}: loss {curve[-1]:.4f} "
                     f"(mean of the last 10 steps {out[compress or 'fp32']['last10']:.4f})")
    return out


def summary(rows):
    """Return {(case, ranks): medians over repeats, their spread, samples/s, speed vs DDP}."""
    out = {}
    for key in dict.fromkeys((r["case"], r["ranks"]) for r in rows):
        mine = [r for r in rows if (r["case"], r["ranks"]) == key]
        meds = [r["step_ms"] for r in mine]
        med = statistics.median(meds)
        s = {"step_ms": med, "min_ms": min(meds), "max_ms": max(meds), "repeats": len(meds),
             "spread": (max(meds) - min(meds)) / med, "stability": _stability(meds)}
        s["within_5pct"] = s["spread"] <= 0.05
        for k in BREAKDOWN:
            vals = [r[k] for r in mine if r.get(k) is not None]
            s[k] = statistics.median(vals) if vals else None
        s["loss0"] = mine[0]["loss0"]
        out[key] = s
    for (case, n), s in out.items():
        ddp = out.get((DDP, n))
        s["vs_ddp"] = ddp["step_ms"] / s["step_ms"] if ddp else None  # > 1: faster than DDP
    return out


def _stability(values):
    """How far the median moves when any one repeat is left out, relative to it (0 with fewer than 3)."""
    if len(values) < 3:
        return 0.0
    med = statistics.median(values)
    return max(abs(statistics.median(values[:i] + values[i + 1:]) - med) for i in range(len(values))) / med


def hidden(s, backend, n):
    """Return (by the wait, net, overlap's time / without) for backend at n ranks, or None."""
    plain, over = s.get((f"spmd {backend}", n)), s.get((f"spmd {backend} overlap", n))
    if not plain or not over:
        return None
    wait = 1 - over["sync"] / plain["sync"] if plain["sync"] else None
    net = 1 - over["comm"] / plain["comm"] if plain.get("comm") and over.get("comm") is not None else None
    return {"by_wait": wait, "net": net, "time_ratio": over["step_ms"] / plain["step_ms"]}


def targets(s):
    """Return [(target, met, how)] from a summary; rank counts above 1 only."""
    ranks = sorted({n for _, n in s if n > 1})
    out = []

    def each(label, check):
        got = []
        for n in ranks:
            v = check(n)
            if v is not None:
                got.append((n, v))
        if got:
            out.append((label, all(ok for _, (ok, _) in got), "; ".join(f"{n} ranks {t}" for n, (_, t) in got)))

    def faster(case, factor):
        def check(n):
            v = s.get((case, n))
            if not v or v["vs_ddp"] is None:
                return None
            return v["vs_ddp"] >= factor, f"{v['vs_ddp']:.2f}x"
        return check

    for case in ("spmd gloo", "spmd gloo overlap"):
        each(f"{case} at least as fast as DDP gloo (>= 1.00x)", faster(case, 1.0))
    for case in ("spmd mpi", "spmd mpi overlap"):
        each(f"{case} at least 1.15x DDP gloo", faster(case, 1.15))
    for backend in ("gloo", "mpi"):
        def half(n, backend=backend):
            h = hidden(s, backend, n)
            if not h or h["by_wait"] is None:
                return None
            net = "-" if h["net"] is None else f"{h['net']:.0%}"
            return h["by_wait"] >= 0.5, f"{h['by_wait']:.0%} by the wait, {net} net"
        each(f"overlap on {backend} hides at least half the communication", half)

        def never_slower(n, backend=backend):
            h = hidden(s, backend, n)
            if not h:
                return None
            return h["time_ratio"] <= 1.0, f"{h['time_ratio']:.2f}x the time without"
        each(f"overlap on {backend} never slower than without", never_slower)
    return out


def _f(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


def report(doc):
    """Return the tables for people from bench()'s document."""
    s = summary(doc["rows"])
    gb = doc["model"]["global_batch"]
    first = doc["rows"][0]
    vocab = f", vocabulary {doc['model']['vocab']:,}" if doc["model"].get("vocab") else ""
    lines = [f"TinyBert dim {doc['model']['dim']}, {doc['model']['layers']} layers{vocab}, {first['params']:,} parameters, "
             f"global batch {gb}, AdamW; {doc['warmup']} warm-up + {doc['steps']} timed steps per launch, "
             f"{doc['repeats']} repeats; ms per step: median of the repeats' medians (slowest rank per step)",
             "",
             f"{'case':<18} {'ranks':>5} {'ms/step':>8} {'spread':>7} {'<=5%':>4} {'stable':>6} {'samples/s':>9}"
             f" {'vs DDP':>6}"
             f" | {'fwd':>6} {'bwd(l)':>6} {'comm':>6} {'sync':>6} {'opt':>6} {'other':>6}"]
    for (case, n), v in sorted(s.items(), key=lambda kv: (kv[0][1], [c[0] for c in CASES + LOW_RANK].index(kv[0][0]))):
        lines.append(
            f"{case:<18} {n:>5} {v['step_ms']:>8.1f} {v['spread']:>6.1%} {'yes' if v['within_5pct'] else 'no':>4} "
            f"{v['stability']:>5.1%} {gb / v['step_ms'] * 1e3:>9.0f} {_f(v['vs_ddp'], '{:.2f}x'):>6} | {_f(v['forward']):>6} "
            f"{_f(v['local_backward']):>6} {_f(v['comm']):>6} {_f(v['sync']):>6} {_f(v['optimizer']):>6} "
            f"{_f(v['other']):>6}")
    lines += ["", "spread: (max - min) / median of the repeats' medians; stable: the most the median moves when "
              "one repeat is left out",
              "fwd: forward; bwd(l): the local backward (no_sync probe); comm: not hidden (backward + sync - "
              "bwd(l)); sync: in synchronize() (spmd); opt: optimizer; other: the rest of the step; ms, means",
              "vs DDP: DDP gloo's ms/step / this case's, same ranks (above 1: faster than DDP)", ""]
    for backend in ("gloo", "mpi"):
        for n in sorted({n for _, n in s if n > 1}):
            h = hidden(s, backend, n)
            if h:
                lines.append(f"overlap, {backend}, {n} ranks: hidden {_f(h['by_wait'], '{:.0%}')} by the wait, "
                             f"{_f(h['net'], '{:.0%}')} net; step {h['time_ratio']:.2f}x the time without")
    losses0 = [v["loss0"] for v in s.values()]
    lines.append(f"loss at step 0, every case and rank count: {min(losses0):.6f} - {max(losses0):.6f}")
    if doc.get("losses"):
        L = doc["losses"]
        lines.append(f"after {len(L['fp32']['losses'])} steps at {L['fp32']['ranks']} ranks ({L['fp32']['backend']}): "
                     f"loss fp32 {L['fp32']['final']:.4f}, bf16 {L['bf16']['final']:.4f} (means of the last 10 "
                     f"steps {L['fp32']['last10']:.4f}, {L['bf16']['last10']:.4f})")
    lines += ["", "targets:"]
    for label, ok, how in targets(s):
        lines.append(f"  {'met    ' if ok else 'NOT met'}  {label}: {how}")
    return "\n".join(lines)


def bench(ranks=(1, 2, 4), repeats=5, steps=30, warmup=5, loss_steps=200, loss_ranks=2, loss_backend="mpi",
          model=None, cases=None, bucket_mb=None, launcher="auto", progress=None):
    """Measure everything; return the JSON document (``report(doc)`` makes the text)."""
    model = {**MODEL, **(model or {})}
    doc = {"schema": "spmd-bench-train/1", "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "load_average_start": list(os.getloadavg()), "cpus": os.cpu_count(), "model": model,
           "ranks": list(ranks), "repeats": repeats, "steps": steps, "warmup": warmup, "bucket_mb": bucket_mb}
    doc["rows"] = measure(ranks, repeats, steps, warmup, model, cases, bucket_mb, True, launcher, progress)
    if loss_steps:
        doc["losses"] = losses(loss_steps, loss_ranks, loss_backend, model, launcher, progress)
    doc["load_average_end"] = list(os.getloadavg())
    s = summary(doc["rows"])
    doc["summary"] = [{"case": c, "ranks": n, **v} for (c, n), v in s.items()]
    doc["targets"] = [{"target": t, "met": ok, "how": how} for t, ok, how in targets(s)]
    return doc


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m spmd.bench.train", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="1,2,4", help="rank counts [default: 1,2,4]")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="timed steps per launch [default: 30]")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first [default: 5]")
    p.add_argument("--cases", default=None, help="comma-separated labels [default: "
                   + ", ".join(c[0] for c in CASES) + "; also: " + ", ".join(c[0] for c in LOW_RANK) + "]")
    p.add_argument("--dim", type=int, default=MODEL["dim"])
    p.add_argument("--layers", type=int, default=MODEL["layers"])
    p.add_argument("--heads", type=int, default=MODEL["heads"])
    p.add_argument("--global-batch", type=int, default=MODEL["global_batch"])
    p.add_argument("--vocab", type=int, default=None, help="vocabulary [default: jobs/train_dp.py's, 32]")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="DataParallel's bucket_mb [default: DataParallel's: 25, with overlap a quarter of the model]")
    p.add_argument("--loss-steps", type=int, default=200, help="steps of the fp32/bf16 loss runs (0: none)")
    p.add_argument("--loss-ranks", type=int, default=2)
    p.add_argument("--loss-backend", default="mpi", choices=("mpi", "gloo"))
    p.add_argument("--launcher", default="auto", choices=("auto", "mpirun", "spmd"),
                   help="auto: mpirun when found (every case), else spmd run (gloo cases)")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--quiet", action="store_true")
    o = p.parse_args(argv)
    try:
        ranks = tuple(int(n) for n in o.ranks.split(",") if n.strip())
    except ValueError:
        p.error(f"--ranks: expected comma-separated integers, got {o.ranks!r}")
    cases = None if o.cases is None else [c.strip() for c in o.cases.split(",") if c.strip()]
    unknown = sorted(set(cases or ()) - {c[0] for c in CASES + LOW_RANK})
    if unknown:
        p.error(f"--cases: unknown {unknown}; known: {[c[0] for c in CASES + LOW_RANK]}")
    model = {"dim": o.dim, "layers": o.layers, "heads": o.heads, "global_batch": o.global_batch,
             **({"vocab": o.vocab} if o.vocab else {})}
    progress = None if o.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        doc = bench(ranks, o.repeats, o.steps, o.warmup, o.loss_steps, o.loss_ranks, o.loss_backend, model, cases,
                    o.bucket_mb, o.launcher, progress)
    except (BenchError, subprocess.TimeoutExpired) as exc:
        sys.exit(f"python -m spmd.bench.train: {exc}")
    print(report(doc))
    print(f"load average: start {doc['load_average_start'][0]:.2f}, end {doc['load_average_end'][0]:.2f}")
    if o.json_path:
        from spmd.bench.report import write_json

        write_json(o.json_path, doc)
        print(f"wrote {o.json_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
