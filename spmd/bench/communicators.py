"""The benchmark's world: every implementation alive in the same processes.

Under an MPI launcher one process holds mpi4py's ``COMM_WORLD`` (raw
mpi4py, and spmd's mpi backend built on it) and torch.distributed's
default gloo group (raw gloo, and spmd's gloo backend, which made it
through spmd's rendezvous).  Without an MPI launcher only the gloo
pair runs.  Timing control (barriers, the max over ranks) goes over MPI
when it is there, else over gloo; it is never inside a timed block.
"""

import os

from spmd.errors import BenchError
from spmd.config.placement import Placement, check_mpi_world, detect

__all__ = ["IMPLS", "World", "open_world", "open_alone"]

#: Every implementation, in table order.
IMPLS = ("spmd-mpi", "mpi4py", "spmd-gloo", "gloo")


class World:
    """The ranks of a launched job and the communicators under test."""

    def __init__(self, placement, mpi=None, spmd_mpi=None, spmd_gloo=None, threads=None):
        self.placement = placement
        self.rank, self.size = placement.rank, placement.size
        self.mpi, self.spmd_mpi, self.spmd_gloo = mpi, spmd_mpi, spmd_gloo
        self.threads = threads

    @property
    def impls(self):
        """The implementations this world can run, in table order."""
        have = {"spmd-mpi": self.spmd_mpi, "mpi4py": self.mpi,
                "spmd-gloo": self.spmd_gloo, "gloo": self.spmd_gloo}
        return tuple(name for name in IMPLS if have[name] is not None)

    def barrier(self):
        """Wait for every rank (MPI when present, else gloo)."""
        if self.mpi is not None:
            self.mpi.Barrier()
        else:
            import torch.distributed as dist

            dist.barrier()

    def max(self, values):
        """Return the element-wise maximum over ranks of a list of floats."""
        import numpy as np

        a = np.asarray(values, dtype=np.float64)
        if self.mpi is not None:
            from mpi4py import MPI

            self.mpi.Allreduce(MPI.IN_PLACE, a, MPI.MAX)
            return a.tolist()
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(a)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def close(self):
        """End the gloo group (MPI ends at exit)."""
        if self.spmd_gloo is None:
            return
        if self.placement.size == 1:
            import torch.distributed as dist

            dist.destroy_process_group()
        else:
            import spmd

            spmd.finalize()
        self.spmd_gloo = None


def _threads(placement, threads):
    """Give each rank its share of the cores for torch's own work, as torchrun does."""
    import torch

    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // max(1, placement.local_size))
    torch.set_num_threads(threads)
    return threads


def open_alone(backends=("mpi", "gloo"), threads=None):
    """Start a world of one: spmd and raw on MPI.COMM_SELF and on a one-rank gloo group.

    With no peer to wait for, spmd's time minus the raw time is the
    wrapper's own cost per call, free of the other rank's noise.
    """
    placement = Placement(rank=0, size=1, local_rank=0, local_size=1, node_rank=0,
                          num_nodes=1, launcher="none")
    mpi = spmd_mpi = spmd_gloo = None
    if "mpi" in backends:
        from mpi4py import MPI

        from spmd.comms.backends.mpi.backend import MpiBackend
        from spmd.comms.comm import Comm

        mpi = MPI.COMM_SELF
        spmd_mpi = Comm(MpiBackend(mpi), placement)
    threads = _threads(placement, threads)
    if "gloo" in backends:
        import torch.distributed as dist

        from spmd.comms.backends.torchdist.gloo import GlooBackend
        from spmd.comms.comm import Comm

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        spmd_gloo = Comm(GlooBackend("gloo"), placement)
    return World(placement, mpi, spmd_mpi, spmd_gloo, threads)


def open_world(backends=("mpi", "gloo"), threads=None):
    """Start the communicators under test for this launched process.

    backends: which of "mpi" and "gloo" to run; "mpi" needs an MPI
    launcher.  threads: torch's intra-op threads per rank (default:
    the cores divided by the ranks on this node).
    """
    placement = detect(os.environ)
    if placement.size < 2:
        raise BenchError(
            "spmd bench needs at least 2 ranks: start it under a launcher "
            "(mpirun -n 2 spmd bench collectives) or let it launch itself (spmd bench collectives --launch 2)"
        )
    mpi = spmd_mpi = spmd_gloo = None
    if "mpi" in backends:
        if not placement.is_mpi:
            raise BenchError(
                f"the mpi implementations need an MPI launcher, but this job was started by "
                f"{placement.launcher}; use mpirun -n N spmd bench collectives, or --backends gloo"
            )
        from mpi4py import MPI

        from spmd.comms.backends.mpi.backend import MpiBackend
        from spmd.comms.comm import Comm

        mpi = MPI.COMM_WORLD
        check_mpi_world(placement, mpi.Get_rank(), mpi.Get_size(), MPI.Get_library_version())
        spmd_mpi = Comm(MpiBackend(mpi), placement)
    threads = _threads(placement, threads)
    if "gloo" in backends:
        import spmd

        spmd_gloo = spmd.init(backend="gloo")
    return World(placement, mpi, spmd_mpi, spmd_gloo, threads)
