"""Interactive SPMD: a REPL and a notebook magic whose every statement runs on every rank.

``Session`` (session) is the Python API both front ends use; ``host`` forks
and watches the ranks, ``engine`` is one rank, ``merge`` makes one text of
what they said; ``repl`` is ``spmd repl``, ``magic`` is ``%load_ext spmd``.
docs/interactive.md is the reference.
"""
