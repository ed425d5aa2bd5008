"""MPICH's shared-memory segment, unlinked as soon as every rank of the host has it mapped.

MPICH makes ``/dev/shm/mpich_shm_*`` at MPI_Init and unlinks it only at
MPI_Finalize, so every job that fails (a raise ending in MPI_Abort, a killed
rank, a killed mpirun) leaves one behind, and /dev/shm fills up.  Once every
local rank has mapped it the name is not needed: the mappings live on, and
MPICH's own unlink at finalize finds nothing and says nothing.
"""

import os

__all__ = ["mapped_segments", "release_segments"]

PREFIX = "/dev/shm/mpich_shm_"


def mapped_segments(maps: str = "/proc/self/maps") -> list[str]:
    """The MPICH segments this process has mapped whose names still exist."""
    try:
        with open(maps) as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    return sorted({row[5] for row in rows if len(row) == 6 and row[5].startswith(PREFIX)})


def release_segments(MPI, world) -> list[str]:
    """Collective over world, under MPICH: unlink its segments once each local rank has mapped them; return them."""
    if "MPICH" not in MPI.Get_library_version():
        return []
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        mine = mapped_segments()
        local.Barrier()  # every rank of this host is past MPI_Init, its mapping made
        if local.Get_rank() != 0:
            return []
        for path in mine:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return mine
    finally:
        local.Free()
