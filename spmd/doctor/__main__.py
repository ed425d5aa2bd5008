"""``python -m spmd.doctor``: the same as ``spmd doctor``."""

from spmd.doctor.command import doctor

doctor(prog_name="python -m spmd.doctor")
