"""Compare `spmd bench collectives --json` runs of two trees, made one after the other in one sitting.

    python tests/tools/bench_compare.py before1.json after1.json before2.json after2.json ...

Files alternate: before, after, before, after.  For every collective,
spmd implementation and size, spmd's time is taken relative to the raw
library in the same run (spmd-mpi / mpi4py, spmd-gloo / gloo), which
cancels most of the machine's drift between runs.  Printed: the median
ratio before and after, the spread of the ratio between runs of the
same tree, and after/before; the rows where after is slower than before
by more than that spread are listed at the end.
"""

import json
import statistics
import sys

RAW = {"spmd-mpi": "mpi4py", "spmd-mpi+equal": "mpi4py", "spmd-gloo": "gloo", "spmd-gloo+equal": "gloo",
       "spmd-mpi+coalesce": "mpi4py+coalesce", "spmd-gloo+coalesce": "gloo+coalesce"}


def ratios(path):
    rows = json.load(open(path))["rows"]
    by = {(r["collective"], r["impl"], r["size"]): r["time_us"] for r in rows}
    out = {}
    for (coll, impl, size), t in by.items():
        raw = RAW.get(impl)
        if raw and (coll, raw, size) in by:
            out[(coll, impl, size)] = t / by[(coll, raw, size)]
    return out


def main(paths):
    runs = [ratios(p) for p in paths]
    before, after = runs[0::2], runs[1::2]
    keys = sorted(set.intersection(*(set(r) for r in runs)))
    worse = []
    print(f"{'collective':16}{'impl':20}{'bytes':>10}{'before':>9}{'after':>9}{'spread':>9}{'after/before':>14}")
    for k in keys:
        b = [r[k] for r in before]
        a = [r[k] for r in after]
        mb, ma = statistics.median(b), statistics.median(a)
        spread = max(max(b) - min(b), max(a) - min(a)) / mb  # relative, between runs of one tree
        change = ma / mb
        print(f"{k[0]:16}{k[1]:20}{k[2]:>10}{mb:>9.3f}{ma:>9.3f}{spread:>9.1%}{change:>13.3f}x")
        if change - 1 > spread:
            worse.append((k, change, spread))
    print(f"\n{len(keys)} points; after slower than before by more than the run-to-run spread: {len(worse)}")
    for k, change, spread in worse:
        print(f"  {k}: {change:.3f}x (spread {spread:.1%})")


if __name__ == "__main__":
    main(sys.argv[1:])
