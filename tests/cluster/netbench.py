"""Benchmarks where the network is the bottleneck: jobs across the private cluster's hosts, links capped.

    python -m tests.cluster.netbench train [--layouts 2x1,2x2,4x1] [--caps 0,1000,200] [--rounds 2]
    python -m tests.cluster.netbench collectives [--layouts 2x1,4x1] [--caps 1000,200] [--sizes 16M,64M]
    python -m tests.cluster.netbench pipeline [--layouts 2x1] [--caps 1000,200]

Each starts a lab of 4 hosts (tests/cluster/lab.py; root), caps every host's link both ways with
tc tbf (``0``: uncapped) and launches each case with MPICH's mpiexec from the login host, HOSTSxRANKS
(``2x2``: 2 hosts, 2 ranks on each), one launch per case, in an order rotated each round.  Every
launch also counts the bytes h1 sent on its link (eth0's tx_bytes, read in h1's namespace).

- ``train``: jobs/train_dp.py's TinyBert at BERT's vocabulary under DataParallel's forms and
  DDP with torch's hooks (spmd.bench.train_worker, gloo), the never-used pooler frozen for every
  form; the table gives each form's median ms per step, its ratio to DDP's best hook whose loss
  stays within 1% of plain DDP's, its loss after the same steps and h1's bytes per step.
- ``collectives``: ``spmd bench collectives`` in one launched world per layout and cap: spmd's
  gloo and mpi backends beside raw gloo and raw mpi4py, bus bandwidth against the cap.
- ``pipeline``: the main job's scatter and gather (spmd.bench.pipeline_worker) beside the
  hand-written mpi4py Scatterv/Gatherv loop.

--json keeps every launch's record; --table writes the markdown.  Method: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from spmd.bench.startup import launch_record
from tests.cluster.lab import Lab
from tests.cluster.runs import MPIEXEC, env
from tests.support import PY, REPO

#: The issue's job: TinyBert, dim 128, 2 layers, BERT's vocabulary, words drawn as in text (zipf 1), global batch 32, 40 steps.
MODEL = {"dim": 128, "layers": 2, "heads": 4, "vocab": 30522, "global_batch": 32, "warmup": 5, "steps": 35,
         "probe": False, "freeze_unused": True, "zipf": 1.0}

#: label -> train_worker options: DDP with torch's hooks, DataParallel's forms.
FORMS = {
    "DDP": {"impl": "ddp"},
    "DDP fp16_compress_hook": {"impl": "ddp", "ddp_hook": "fp16"},
    "DDP powerSGD_hook:4": {"impl": "ddp", "powersgd": 4},
    "DataParallel": {"impl": "spmd"},
    "DataParallel bf16": {"impl": "spmd", "compress": "bf16"},
    "DataParallel powersgd:4": {"impl": "spmd", "compress": "powersgd:4"},
    "DataParallel auto": {"impl": "spmd", "compress": "auto"},
}
DDP_FORMS = [k for k, v in FORMS.items() if v["impl"] == "ddp"]
LOSS_WITHIN = 0.01  # a hook counts as DDP's best only while its loss stays within 1% of plain DDP's


def layouts(text):
    """'2x1,2x2' -> [(2, 1), (2, 2)]."""
    out = []
    for part in text.split(","):
        hosts, _, ranks = part.partition("x")
        out.append((int(hosts), int(ranks or 1)))
    return out


def tx_bytes(lab, host="h1"):
    """Bytes host has sent on its link so far (eth0's counter, in host's own namespace)."""
    out = subprocess.run(["ip", "netns", "exec", lab.host(host).netns, "cat",
                          "/sys/class/net/eth0/statistics/tx_bytes"], capture_output=True, text=True, check=True)
    return int(out.stdout)


def set_caps(lab, mbit):
    for h in lab.hosts:
        if mbit:
            lab.cap(h.name, mbit)
        else:
            lab.uncap(h.name)


def mpiexec(lab, layout, args):
    hosts, ppn = layout
    return lab.command("login", lab.mpiexec_args(MPIEXEC, ["-n", str(hosts * ppn), "-ppn", str(ppn), *args],
                                                 [f"h{i}" for i in range(1, hosts + 1)]))


def launch(lab, layout, args, tag, timeout, **extra):
    """Run one launch across the lab; return (its TAG record, the bytes h1 sent meanwhile)."""
    before = tx_bytes(lab)
    record = launch_record(mpiexec(lab, layout, args), env(SPMD_TIMEOUT="300", OMP_NUM_THREADS="1", **extra),
                           tag, timeout)
    return record, tx_bytes(lab) - before


# -- training ------------------------------------------------------------------------------------


def train_launch(lab, layout, label, model):
    from spmd.bench.train import digest

    options = {**model, **FORMS[label]}
    record, sent = launch(lab, layout, [PY, "-m", "spmd.bench.train_worker", json.dumps(options)],
                          "TRAIN_BENCH", 1800, SPMD_BACKEND="gloo")
    row = digest(record)
    row["h1_bytes_per_step"] = sent / (options["warmup"] + options["steps"])
    return row


def train_summary(runs):
    """Per (layout, cap): each form's medians, and its ratio to DDP's best hook within 1% loss."""
    out = []
    for key in sorted({(r["layout"], r["cap"]) for r in runs}, key=lambda k: (k[0], -k[1] or -1e9)):
        rows = {}
        for label in FORMS:
            mine = [r for r in runs if (r["layout"], r["cap"]) == key and r["form"] == label]
            if mine:
                rows[label] = {"step_ms": statistics.median(r["step_ms"] for r in mine),
                               "rounds_ms": [round(r["step_ms"], 1) for r in mine],
                               "loss": mine[0]["loss_last"],
                               "h1_mb_per_step": statistics.median(r["h1_bytes_per_step"] for r in mine) / 1e6}
        plain = rows.get("DDP", {}).get("loss")
        fair = [k for k in DDP_FORMS if k in rows and plain and abs(rows[k]["loss"] / plain - 1) <= LOSS_WITHIN]
        best = min(fair, key=lambda k: rows[k]["step_ms"]) if fair else None
        for k, v in rows.items():
            v["loss_vs_ddp"] = v["loss"] / plain - 1 if plain else None
            v["vs_best_hook"] = v["step_ms"] / rows[best]["step_ms"] if best else None
        ours = [k for k in rows if k.startswith("DataParallel") and rows[k]["loss_vs_ddp"] is not None
                and abs(rows[k]["loss_vs_ddp"]) <= LOSS_WITHIN]
        out.append({"layout": key[0], "cap": key[1], "best_hook": best,
                    "best_ours": min(ours, key=lambda k: rows[k]["step_ms"]) if ours else None, "rows": rows})
    return out


def train_table(summary):
    lines = []
    for s in summary:
        cap = f"{s['cap']} Mbit/s" if s["cap"] else "uncapped"
        lines += ["", f"**{s['layout']}, {cap}** (DDP's best hook within 1% loss: {s['best_hook']}; "
                      f"DataParallel's best form within 1%: {s['best_ours']})", "",
                  "| form | ms per step (median) | each round | vs DDP's best hook | loss | vs DDP's loss "
                  "| MB out of h1 per step |", "|---|---:|---|---:|---:|---:|---:|"]
        for label, v in s["rows"].items():
            ratio = f"{v['vs_best_hook']:.2f}" if v["vs_best_hook"] is not None else "-"
            lines.append(f"| {label} | {v['step_ms']:.0f} | {', '.join(f'{x:.0f}' for x in v['rounds_ms'])} | "
                         f"{ratio} | {v['loss']:.5f} | {v['loss_vs_ddp'] * 100:+.2f}% | {v['h1_mb_per_step']:.2f} |")
    return "\n".join(lines) + "\n"


def train(lab, args):
    model = {**MODEL, "steps": args.steps}
    forms = args.forms.split(",") if args.forms else list(FORMS)
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        sys.exit(f"unknown forms {unknown}; known: {list(FORMS)}")
    runs = []
    for rnd in range(args.rounds):
        for cap in args.caps:
            set_caps(lab, cap)
            for layout in args.layouts:
                k = (rnd + len(runs)) % len(forms)
                for label in forms[k:] + forms[:k]:  # rotated each round
                    t0 = time.monotonic()
                    row = train_launch(lab, layout, label, model)
                    row.update(form=label, cap=cap, layout=f"{layout[0]}x{layout[1]}", round=rnd)
                    runs.append(row)
                    print(f"round {rnd} {row['layout']} cap {cap or '-'} {label}: {row['step_ms']:.0f} ms/step, "
                          f"loss {row['loss_last']:.5f}, {row['h1_bytes_per_step'] / 1e6:.2f} MB/step out of h1 "
                          f"({time.monotonic() - t0:.0f} s)", flush=True)
    set_caps(lab, 0)
    summary = train_summary(runs)
    return {"model": model, "runs": runs, "summary": summary}, train_table(summary)


# -- collectives and the pipeline ----------------------------------------------------------------


def collectives(lab, args):
    docs = []
    for rnd in range(args.rounds):
        for cap in args.caps:
            set_caps(lab, cap)
            for layout in args.layouts:
                out = Path(args.work) / f"coll-{layout[0]}x{layout[1]}-{cap}-{rnd}.json"
                cmd = [PY, "-m", "spmd.cli.bench", "collectives", "--collectives", args.collectives,
                       "--sizes", args.sizes, "--rounds", "2", "--target-time", "0.3", "--json", str(out),
                       "--quiet"]
                subprocess.run(mpiexec(lab, layout, cmd), env=env(SPMD_TIMEOUT="300", OMP_NUM_THREADS="1"),
                               check=True, timeout=1800, stdout=subprocess.DEVNULL)
                doc = json.loads(out.read_text())
                docs.append({"layout": f"{layout[0]}x{layout[1]}", "cap": cap, "round": rnd, "doc": doc})
                print(f"round {rnd} {layout} cap {cap}: {out}", flush=True)
    set_caps(lab, 0)
    return {"runs": docs}, collectives_table(docs)


def collectives_table(docs):
    """Median busbw over rounds per layout, cap, collective, size and implementation; against the cap
    (Mbit/s over 8: MB/s of Ethernet frames, so TCP's payload tops out near 95% of it) and raw gloo."""
    lines = ["| layout | cap | collective | size | implementation | busbw MB/s (median) | each round "
             "| of the cap | vs raw gloo |", "|---|---|---|---:|---|---:|---|---:|---:|"]
    keys = {}
    for d in docs:
        for row in d["doc"]["rows"]:
            key = (d["layout"], d["cap"], row["collective"], row["size"], row["impl"])
            keys.setdefault(key, []).append(row["busbw_gbps"] * 1e3)
    median = {k: statistics.median(v) for k, v in keys.items()}
    for key in sorted(keys, key=lambda k: (k[0], -k[1] or -1e9, k[2], k[3], k[4])):
        layout, cap, coll, size, impl = key
        gloo = median.get((layout, cap, coll, size, "gloo"))
        share = f"{median[key] / (cap / 8):.0%}" if cap else "-"
        vs_gloo = f"{median[key] / gloo:.2f}" if gloo else "-"
        lines.append(f"| {layout} | {f'{cap} Mbit/s' if cap else 'uncapped'} | {coll} | {size >> 20} MiB | {impl} | "
                     f"{median[key]:.1f} | {', '.join(f'{v:.1f}' for v in keys[key])} | {share} | {vs_gloo} |")
    return "\n".join(lines) + "\n"


def pipeline(lab, args):
    from spmd.bench.pipeline import CHUNK, ROWS

    cases = {"spmd scatter (read=root)": ("spmd", {"read": "root"}), "mpi4py Scatterv/Gatherv loop": ("mpi4py", {})}
    runs = []
    for rnd in range(args.rounds):
        for cap in args.caps:
            set_caps(lab, cap)
            for layout in args.layouts:
                for label, (impl, options) in list(cases.items())[::1 if rnd % 2 == 0 else -1]:
                    cmd = [PY, "-m", "spmd.bench.pipeline_worker", impl, str(ROWS), str(CHUNK), json.dumps(options)]
                    record, sent = launch(lab, layout, cmd, "PIPELINE_BENCH", 1800)
                    runs.append({"form": label, "cap": cap, "layout": f"{layout[0]}x{layout[1]}", "round": rnd,
                                 "seconds": record["seconds"], "checksum": record["checksum"], "h1_bytes": sent})
                    print(f"round {rnd} {layout} cap {cap} {label}: {record['seconds']:.2f} s, "
                          f"{sent / 1e6:.1f} MB out of h1", flush=True)
    set_caps(lab, 0)
    return {"runs": runs}, pipeline_table(runs)


def pipeline_table(runs):
    """Median seconds per layout, cap and case, and spmd's against the hand-written loop's; the checksums
    of every run must agree (the same rows out)."""
    lines = ["| layout | cap | case | s (median) | each round | MB out of h1 | vs the mpi4py loop |",
             "|---|---|---|---:|---|---:|---:|"]
    sums = {r["checksum"] for r in runs}
    keys = sorted({(r["layout"], r["cap"]) for r in runs}, key=lambda k: (k[0], -k[1] or -1e9))
    for layout, cap in keys:
        mine = [r for r in runs if (r["layout"], r["cap"]) == (layout, cap)]
        med = {f: statistics.median(r["seconds"] for r in mine if r["form"] == f) for f in {r["form"] for r in mine}}
        loop = next((v for k, v in med.items() if k.startswith("mpi4py")), None)
        for form in sorted(med):
            each = [r for r in mine if r["form"] == form]
            rounds = ", ".join(f"{r['seconds']:.2f}" for r in each)
            sent = statistics.median(r["h1_bytes"] for r in each) / 1e6
            ratio = f"{med[form] / loop:.2f}" if loop else "-"
            lines.append(f"| {layout} | {f'{cap} Mbit/s' if cap else 'uncapped'} | {form} | {med[form]:.2f} | "
                         f"{rounds} | {sent:.1f} | {ratio} |")
    note = "" if len(sums) == 1 else f"\nchecksums differ between runs: {sorted(sums)}\n"
    return "\n".join(lines) + "\n" + note


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tests.cluster.netbench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("measurement", choices=("train", "collectives", "pipeline"))
    p.add_argument("--layouts", default="2x1", type=layouts, help="HOSTSxRANKS, comma-separated [2x1]")
    p.add_argument("--caps", default="0,1000,200", type=lambda s: [int(c) for c in s.split(",")],
                   help="link caps in Mbit/s, 0 uncapped [0,1000,200]")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=MODEL["steps"], help="timed steps after 5 of warm-up [35]")
    p.add_argument("--forms", default=None, help=f"train: comma-separated, of {', '.join(FORMS)} [all]")
    p.add_argument("--collectives", default="all_reduce,all_gather,broadcast")
    p.add_argument("--sizes", default="16M,64M")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--table", default=None, help="write the markdown table here")
    p.add_argument("--work", default="/tmp", help="where the collectives' JSON files go")
    args = p.parse_args(argv)
    hosts = max(h for h, _ in args.layouts)
    with Lab.start(hosts=max(hosts, 2), dummy=False) as lab:
        doc, table = {"train": train, "collectives": collectives, "pipeline": pipeline}[args.measurement](lab, args)
    doc["command"] = " ".join(["python -m tests.cluster.netbench", *(argv if argv is not None else sys.argv[1:])])
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(doc, indent=1))
    if args.table:
        Path(args.table).write_text(table)
    print(table)


if __name__ == "__main__":
    main()
