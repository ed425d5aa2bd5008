"""The guide's BERT case: the embedding's gradient as rows (``sparse_rows``) beside dense averaging and DDP.

    python -m spmd.bench.embedding [--ranks 2,4] [--backends gloo,mpi] [--repeats 3] [--vocab 30522]

jobs/train_dp.py's TinyBert with BERT's vocabulary, trained with SGD, each
case a launch of its own (:mod:`spmd.bench.train_worker`), interleaved over
repeats: DataParallel dense, with ``sparse_rows``, with the token embedding
compressed to bf16 (``compress={"tokens.*": "bf16"}``), with ``sparse_rows``
and ``nn.Embedding(sparse=True)`` (no dense gradient of the table at all), and torch's DDP with
a dense embedding and with ``nn.Embedding(sparse=True)`` (gloo: torch has no
mpi backend here).  The table gives ms per step (median of the repeats'
medians, slowest rank per step) and the bytes of gradients one rank sends per
step (a ring all_reduce sends 2 (n-1)/n of its buffer, an all_gather its part
to each other rank); then the loss after --loss-steps steps of each spmd form,
on words drawn by frequency (``zipf`` 1: the timed runs' arithmetic sequences
do not learn in 200 steps at this vocabulary).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from spmd.bench.train import digest, launch
from spmd.bench.train import summary as train_summary
from spmd.errors import BenchError

__all__ = ["CASES", "MODEL", "measure", "summary", "targets", "losses", "crossover", "report", "main"]

#: (label, impl, options) of each case; spmd's run on every backend asked, DDP's on gloo.
CASES = (
    ("DataParallel dense", "spmd", {}),
    ("DataParallel sparse_rows", "spmd", {"sparse_rows": True}),
    ("DataParallel sparse_rows, sparse emb.", "spmd", {"sparse_rows": True, "sparse_embedding": True}),
    ("DataParallel tokens bf16", "spmd", {"compress": {"tokens.*": "bf16"}}),
    ("DDP dense embedding", "ddp", {}),
    ("DDP sparse embedding", "ddp", {"sparse_embedding": True}),
)
#: The training benchmark's model (about 3.2 M parameters without the vocabulary) with BERT's vocabulary.
MODEL = {"dim": 256, "layers": 4, "heads": 4, "global_batch": 64, "vocab": 30522, "optimizer": "sgd"}
#: The loss runs' text: words drawn with probability 1/rank (a loss that moves within 200 steps).
LOSS_ZIPF = 1.0
#: The target: sparse_rows at most this times the best DDP form's time per step (2 ranks, gloo).
TARGET = 0.8


def _cases(backends):
    for label, impl, extra in CASES:
        for backend in (backends if impl == "spmd" else ("gloo",)):
            if impl == "ddp" and "gloo" not in backends:
                continue
            yield f"{label} ({backend})", impl, backend, extra


def measure(ranks=(2, 4), backends=("gloo", "mpi"), repeats=3, steps=10, warmup=3, model=None,
            launcher="auto", progress=None):
    """Run every case at every rank count, interleaved, repeats times; return one row per launch."""
    model = {**MODEL, **(model or {})}
    chosen = list(_cases(backends))
    rows = []
    for rep in range(repeats):
        for n in ranks:
            k = rep % len(chosen)
            for label, impl, backend, extra in chosen[k:] + chosen[:k]:
                opts = {**model, "steps": steps, "warmup": warmup, "probe": True, **extra}
                record = launch(impl, backend, n, opts, launcher)
                row = digest(record)
                wire = record["wire_bytes"][warmup:] or record["wire_bytes"]
                row.update(case=label, repeat=rep, wire_mb=statistics.median(wire) / 2**20,
                           load=os.getloadavg()[0])
                rows.append(row)
                if progress:
                    progress(f"  repeat {rep + 1}/{repeats} {n} ranks {label:<36} {row['step_ms']:8.1f} ms/step "
                             f"{row['wire_mb']:8.2f} MB sent, sync {row['sync']:.1f} ms, load {row['load']:.2f}")
    return rows


def summary(rows):
    """The training benchmark's summary (medians over repeats, spread, the step's parts), with MB sent."""
    out = train_summary(rows)
    for (case, n), s in out.items():
        s["wire_mb"] = statistics.median(r["wire_mb"] for r in rows if (r["case"], r["ranks"]) == (case, n))
    return out


def targets(s):
    """[(target, met, how)]: sparse_rows (its faster form) at most TARGET x the best DDP form, 2 ranks, gloo."""
    forms = [s.get((f"{c} (gloo)", 2)) for c in ("DataParallel sparse_rows", "DataParallel sparse_rows, sparse emb.")]
    forms = [f for f in forms if f]
    rows = min(forms, key=lambda f: f["step_ms"]) if forms else None
    ddps = [s.get((f"{c} (gloo)", 2)) for c in ("DDP dense embedding", "DDP sparse embedding")]
    ddps = [d for d in ddps if d]
    if not rows or not ddps:
        return []
    best = min(d["step_ms"] for d in ddps)
    ratio = rows["step_ms"] / best
    return [(f"sparse_rows at most {TARGET}x the best DDP form's time per step (2 ranks, gloo)", ratio <= TARGET,
             f"{rows['step_ms']:.1f} ms against {best:.1f} ms: {ratio:.2f}x")]


def losses(steps=200, ranks=2, backend="gloo", model=None, launcher="auto", progress=None):
    """Train steps steps with each spmd form; return {case: loss at the end (mean of the last 10 steps)}."""
    model = {**MODEL, "zipf": LOSS_ZIPF, **(model or {})}
    out = {}
    for label, impl, extra in CASES:
        if impl != "spmd":
            continue
        rec = launch(impl, backend, ranks, {**model, "steps": steps, "warmup": 0, "mode": "loss", **extra},
                     launcher, timeout=3600)
        curve = rec["losses"]
        out[label] = {"first": curve[0], "final": curve[-1], "last10": sum(curve[-10:]) / len(curve[-10:])}
        if progress:
            progress(f"  {steps} steps, {ranks} ranks, {backend}, {label}: loss {curve[-1]:.4f}")
    return out


def crossover(ranks=2, backend="gloo", vocab=30522, width=256, repeats=15, launcher="auto"):
    """Time one embedding's gradient sent as rows and whole, at touched fractions (spmd.bench.crossover_worker)."""
    import json

    from spmd.bench.startup import clean_env, find_mpirun, launch_record

    args = ["-m", "spmd.bench.crossover_worker", json.dumps({"vocab": vocab, "width": width, "repeats": repeats})]
    mpirun = find_mpirun()
    if launcher == "spmd" or (mpirun is None and backend == "gloo"):
        cmd = [sys.executable, "-c", "from spmd.cli import main; main()", "run", "--no-prefix", "-n", str(ranks),
               *args]
    elif mpirun is None:
        raise BenchError("the crossover on mpi needs mpirun: pip install mpich")
    else:
        cmd = [mpirun, "-n", str(ranks), sys.executable, *args]
    return launch_record(cmd, clean_env({"SPMD_BACKEND": backend}), "CROSSOVER_BENCH", 900)


def crossover_table(found):
    """The crossover measurements as text, one line per fraction."""
    lines = [f"{found['vocab']:,} x {found['width']} float32, {found['ranks']} ranks, {found['backend']}: "
             "ms per synchronize (slowest rank's median)",
             f"{'touched':>8} {'rows':>7} {'as rows':>8} {'whole':>8} {'rule sends':>10}"]
    for p in found["points"]:
        lines.append(f"{p['fraction']:>8.1%} {p['rows']:>7,} {p['rows_ms']:>8.2f} {p['dense_ms']:>8.2f} "
                     f"{p['rule']:>10}")
    return "\n".join(lines)


def report(doc):
    """The table for people from main()'s document."""
    s = summary(doc["rows"])
    m = doc["model"]
    lines = [f"TinyBert dim {m['dim']}, {m['layers']} layers, vocabulary {m['vocab']:,} "
             f"({doc['rows'][0]['params']:,} parameters), global batch {m['global_batch']}, {m['optimizer']}; "
             f"{doc['warmup']} warm-up + {doc['steps']} timed steps per launch, {doc['repeats']} repeats",
             "",
             f"{'case':<38} {'ranks':>5} {'ms/step':>8} {'spread':>7} {'MB sent':>8} | {'fwd':>6} {'bwd(l)':>6} "
             f"{'bwd':>6} {'sync':>6} {'opt':>6}"]
    for (case, n), v in sorted(s.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"{case:<38} {n:>5} {v['step_ms']:>8.1f} {v['spread']:>6.1%} {v['wire_mb']:>8.2f} | "
                     f"{v['forward']:>6.1f} {v['local_backward']:>6.1f} {v['backward']:>6.1f} {v['sync']:>6.1f} "
                     f"{v['optimizer']:>6.1f}")
    lines += ["", "MB sent: gradients one rank sends per step (median); fwd, bwd(l) (local backward, no_sync), bwd, "
              "sync, opt: ms, medians of the launches' means"]
    if doc.get("losses"):
        got = doc["losses"]
        base = got.get("DataParallel dense", next(iter(got.values())))["last10"]
        lines += ["", f"loss after {doc['loss_steps']} steps, 2 ranks, gloo, words drawn by frequency (zipf "
                  f"{LOSS_ZIPF:g}); mean of the last 10 steps, beside dense fp32:"]
        lines += [f"  {case:<38} {v['first']:.4f} -> {v['last10']:.6f} ({v['last10'] - base:+.1e})"
                  for case, v in got.items()]
    lines += ["", "targets:"] + [f"  {'met    ' if ok else 'NOT met'}  {t}: {how}" for t, ok, how in targets(s)]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m spmd.bench.embedding", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--backends", default="gloo,mpi")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab", type=int, default=MODEL["vocab"])
    p.add_argument("--dim", type=int, default=MODEL["dim"])
    p.add_argument("--loss-steps", type=int, default=200, help="steps of the loss runs (0: none)")
    p.add_argument("--launcher", default="auto", choices=("auto", "mpirun", "spmd"))
    p.add_argument("--json", dest="json_path")
    p.add_argument("--crossover", action="store_true",
                   help="measure only where rows stop paying: one embedding's gradient as rows and whole, "
                        "at touched fractions, on each backend at each rank count")
    o = p.parse_args(argv)
    ranks = tuple(int(n) for n in o.ranks.split(","))
    backends = tuple(b.strip() for b in o.backends.split(",") if b.strip())
    model = {"vocab": o.vocab, "dim": o.dim}
    if o.crossover:
        for n in ranks:
            for backend in backends:
                print(crossover_table(crossover(n, backend, o.vocab, o.dim, launcher=o.launcher)) + "\n")
        return
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    doc = {"schema": "spmd-bench-rows/1", "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "model": {**MODEL, **model}, "repeats": o.repeats, "steps": o.steps, "warmup": o.warmup,
           "load_average_start": list(os.getloadavg()), "loss_steps": o.loss_steps}
    try:
        doc["rows"] = measure(ranks, backends, o.repeats, o.steps, o.warmup, model, o.launcher, progress)
        if o.loss_steps:
            doc["losses"] = losses(o.loss_steps, 2, "gloo", model, o.launcher, progress)
    except (BenchError, subprocess.TimeoutExpired) as exc:
        sys.exit(f"python -m spmd.bench.embedding: {exc}")
    doc["load_average_end"] = list(os.getloadavg())
    print(report(doc))
    if o.json_path:
        from spmd.bench.report import write_json

        write_json(o.json_path, doc)


if __name__ == "__main__":
    main()
