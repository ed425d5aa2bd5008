"""What a rank tells rank 0 of itself: the MPI library's version, read without starting MPI."""

import subprocess
import sys

import pytest

from tests.support import clean_env

pytestmark = pytest.mark.unit

ASK = """
from spmd.doctor.facts import versions
found = versions()
from mpi4py import MPI
print(found["mpi"], "|", found["mpi4py"], "|", MPI.Is_initialized())
"""


def test_the_mpi_library_answers_with_no_launcher_and_mpi_not_started():
    """No launcher at all (as under srun --mpi=none or torchrun, where nothing starts MPI): the library is
    loaded and asked, and MPI_Init is never called."""
    got = subprocess.run([sys.executable, "-c", ASK], capture_output=True, text=True, timeout=120, env=clean_env())
    assert got.returncode == 0, got.stderr[-2000:]
    library, mpi4py, initialized = (part.strip() for part in got.stdout.strip().split("|"))
    assert library.startswith(("MPICH Version:", "Open MPI v")) and mpi4py and initialized == "False", got.stdout


def test_a_library_that_does_not_load_is_said_with_why(monkeypatch):
    """mpi4py installed but its library missing: 'none (the error)', not a crash."""
    import mpi4py

    import spmd.doctor.facts as facts

    monkeypatch.delattr(mpi4py, "MPI", raising=False)  # an earlier test's import leaves it on the package
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    monkeypatch.setattr(facts, "_version", lambda name: "4.1.2")
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)  # its import fails
    assert facts.mpi_library().startswith("none (ModuleNotFoundError: import of mpi4py.MPI halted")
