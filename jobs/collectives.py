"""The guide's collective examples (reduce, all_reduce, scatter/gather,
all_gather, broadcast) written with ``spmd.comm``.

Each example follows the guide's code and prints the guide's lines, in
rank order, with values that are right at any world size; under
``mpirun -n 4`` they are the guide's own values::

    mpirun -n 4 python jobs/collectives.py
    spmd run -n 4 jobs/collectives.py
    python jobs/collectives.py              # a world of one

Lines are collected on rank 0 and printed there, so output from
different ranks never interleaves.
"""

import torch

from spmd import comm


def show(line=None):
    """Print every rank's line (None for none) on rank 0, in rank order."""
    lines = comm.gather_object(line, root=0)
    if comm.rank == 0:
        for text in lines:
            if text is not None:
                print(text)


def section(title):
    """Print a heading on rank 0."""
    if comm.rank == 0:
        print(f"\n== {title} ==")


def do_reduce(rank, size):
    """3.1: sum every rank's rank+1 into rank 0."""
    tensor = torch.ones(1) * (rank + 1)
    comm.reduce(tensor, root=0, op="sum")
    show(f"Reduced result on rank 0: {tensor.item()}" if rank == 0 else None)


def do_all_reduce(rank, size):
    """3.2: sum every rank's rank+1 into every rank."""
    tensor = torch.tensor([rank + 1], dtype=torch.float32)
    comm.all_reduce(tensor, op="sum")
    show(f"Rank {rank} result: {tensor.item()}")


def do_scatter_gather(rank, size):
    """3.3: rank 0 hands out i+1 to rank i, each doubles it, rank 0 collects."""
    scatter_list = [torch.tensor([i + 1.0]) for i in range(size)] if rank == 0 else None
    tensor = comm.scatter(scatter_list, root=0)
    show(f"Rank {rank} after scatter: {tensor.item()}")

    tensor *= 2  # each rank works on its own piece

    gather_list = comm.gather(tensor, root=0)
    show(f"Gathered results: {[x.item() for x in gather_list]}" if rank == 0 else None)


def do_all_gather(rank, size):
    """3.4: every rank collects every rank's rank+1."""
    tensor = torch.tensor([rank + 1.0])
    tensor_list = comm.all_gather(tensor)
    show(f"Rank {rank} got: {[x.item() for x in tensor_list]}")


def do_broadcast(rank, size):
    """3.5: copy rank 0's tensor to every rank."""
    if rank == 0:
        tensor = torch.tensor([1, 2, 3])
    else:
        tensor = torch.zeros(3, dtype=torch.int64)
    comm.broadcast(tensor, root=0)
    show(f"Rank {rank} received: {tensor}")


EXAMPLES = [
    ("3.1 reduce", do_reduce),
    ("3.2 all_reduce", do_all_reduce),
    ("3.3 scatter / gather", do_scatter_gather),
    ("3.4 all_gather", do_all_gather),
    ("3.5 broadcast", do_broadcast),
]


def main():
    if comm.rank == 0:
        print(f"world size {comm.size}, backend {comm.backend}")
    for title, example in EXAMPLES:
        section(title)
        example(comm.rank, comm.size)


if __name__ == "__main__":
    main()
