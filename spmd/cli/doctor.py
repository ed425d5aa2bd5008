"""``spmd doctor``: the command lives in spmd.doctor.command, so that ``python -m spmd.doctor`` runs it too."""

from spmd.doctor.command import doctor

__all__ = ["doctor"]
