"""``spmd submit``: write a SLURM batch file for an spmd job, check it, submit it.

- ``options``: SubmitOptions and ``make`` (validation); SubmitError.
- ``batch``: ``render(options)``, the batch file as a pure function.
- ``profiles``: per-cluster defaults from TOML files.
- ``sbatch``: preflight, ``sbatch --parsable``, the submission record, waiting.
"""

from spmd.submit.batch import render
from spmd.submit.options import SubmitError, SubmitOptions, make

__all__ = ["render", "make", "SubmitOptions", "SubmitError"]
