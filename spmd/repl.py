"""``python -m spmd.repl``: the REPL on the ranks a launcher started (``mpirun -n 4 python -m spmd.repl``).

Rank 0 owns the terminal (the launcher's stdin); every statement runs on
every rank.  ``spmd repl -n N`` starts its own ranks instead.
docs/interactive.md is the reference.
"""

from spmd.interactive.launched import main

if __name__ == "__main__":
    main()
