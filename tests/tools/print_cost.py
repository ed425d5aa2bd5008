"""Measure what whole-line output (spmd.runtime.output) costs a print-heavy script (docs/performance.md).

    python tests/tools/print_cost.py [--prints 200000] [--runs 7]

Each run is a fresh python that prints --prints short lines ("rank 0 line
123456") into a file or a pipe, with plain Python streams or with
spmd.runtime.output's, with PYTHONUNBUFFERED=1 and without; the runs of all cases
are interleaved, and the table gives the median seconds of the print loop
(from the first print to the last flush, timed inside the child): wall
clock, and CPU (user + system) which the other jobs of a busy host disturb less.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import sys, time
if sys.argv[1] == "whole":
    from spmd.runtime import output
    output.install(0, 2)
n = int(sys.argv[2])
t, c = time.perf_counter(), time.process_time()
for i in range(n):
    print("rank 0 line", i)
sys.stdout.flush()
sys.stderr.write(f"{time.perf_counter() - t} {time.process_time() - c}\\n")
"""


def once(mode, unbuffered, sink, prints):
    """Return the seconds (wall, CPU) of one child's print loop."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-c", CHILD, mode, str(prints)]
    if sink == "file":
        with tempfile.TemporaryFile() as out:
            done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.PIPE, check=True)
    else:
        done = subprocess.run(cmd, env=env, capture_output=True, check=True)
        assert done.stdout.count(b"\n") == prints
    wall, cpu = done.stderr.decode().split()[-2:]
    return float(wall), float(cpu)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prints", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    cases = [(u, s, m) for u in (True, False) for s in ("file", "pipe") for m in ("plain", "whole")]
    times = {case: [] for case in cases}
    for _ in range(args.runs):
        for case in cases:
            unbuffered, sink, mode = case
            times[case].append(once(mode, unbuffered, sink, args.prints))
    print(f"{args.prints} prints, median seconds of {args.runs} interleaved runs (min-max)")
    print("| PYTHONUNBUFFERED | into | plain wall | whole lines wall | ratio | plain CPU | whole lines CPU | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for unbuffered in (True, False):
        for sink in ("file", "pipe"):
            row = [("1" if unbuffered else "unset"), sink]
            for k in (0, 1):
                plain = [t[k] for t in times[(unbuffered, sink, "plain")]]
                whole = [t[k] for t in times[(unbuffered, sink, "whole")]]
                p, w = statistics.median(plain), statistics.median(whole)
                row += [f"{p:.3f} ({min(plain):.3f}-{max(plain):.3f})",
                        f"{w:.3f} ({min(whole):.3f}-{max(whole):.3f})", f"{w / p:.2f}"]
            print("| " + " | ".join(row) + " |")

if __name__ == "__main__":
    main()
