"""``spmd doctor``: every pair of hosts checked before a job spends its allocation.

Launched like any job (``mpirun -n N -ppn K python -m spmd.doctor``, ``srun spmd doctor``,
``torchrun ... -m spmd.doctor``); rank 0 prints a table of hosts, a matrix of every pair's
connection and bandwidth, one of every collective, and one line per finding naming hosts and the
fix.  ``diagnose`` runs it in this process; docs/doctor.md.
"""

from spmd.doctor.run import Options, Outcome, diagnose

__all__ = ["Options", "Outcome", "diagnose"]
