"""``python -m spmd.cli.bench``: ``spmd bench`` (how ``--launch`` starts its ranks)."""

from spmd.cli.bench import bench

bench(prog_name="spmd bench")
