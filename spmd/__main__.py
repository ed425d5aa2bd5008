"""``python -m spmd script.py args``: see spmd.runner."""

from .runner import run_script

if __name__ == "__main__":
    import sys

    run_script(sys.argv[1:])
