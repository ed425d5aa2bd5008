"""``python -m spmd script.py args``: see spmd.runtime.runner."""

from spmd.runtime.runner import run_script

if __name__ == "__main__":
    import sys

    run_script(sys.argv[1:])
