#!/usr/bin/env bash
# Run `spmd bench collectives --launch N` on two trees in one sitting, alternating, then compare them.
#   tests/tools/bench_sitting.sh BEFORE_TREE AFTER_TREE [REPEATS] [spmd bench collectives options...]
# Each tree is put first on PYTHONPATH (the venv's spmd is this repository's); runs alternate
# before, after, before, ... and tests/tools/bench_compare.py takes spmd's time relative to the
# raw library in the same run, then the median over runs and the run-to-run spread.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
before="$(cd "$1" && pwd)"; after="$(cd "$2" && pwd)"; shift 2
repeats=3
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then repeats="$1"; shift; fi
py="${SPMD_VENV:-$repo/.venv}/bin/python"
out="$(mktemp -d)"
files=()
for i in $(seq 1 "$repeats"); do
    for tree in "$before" "$after"; do
        name="$out/$(basename "$tree")-$i.json"
        echo "bench_sitting: run $i of $tree" >&2
        # A tree from before spmd bench had subcommands takes the same options with no subcommand.
        sub=(collectives); grep -q "^def collectives" "$tree/spmd/cli/bench.py" || sub=()
        (cd "$tree" && PYTHONPATH="$tree" "$py" -m spmd.cli.bench "${sub[@]}" --launch 2 --quiet --json "$name" "$@" >/dev/null)
        files+=("$name")
    done
done
"$py" "$repo/tests/tools/bench_compare.py" "${files[@]}"
