"""The doctor's collectives: one check of every public collective of Comm, each right on a world of one."""

import inspect

import numpy as np
import pytest

from spmd.comms.comm import Comm
from spmd.doctor.collectives import NAMES, _cases, combine, covered

pytestmark = pytest.mark.unit


def public_collectives():
    """Every public method Comm takes from its collective families (spmd.comms.api) or holds itself (split,
    free), found on the class: a collective added there is a check the doctor is missing until it runs one."""
    return {name for name, member in inspect.getmembers(Comm, inspect.isfunction)
            if not name.startswith("_") and (member.__module__.startswith("spmd.comms.api.")
                                             or member.__module__ == Comm.__module__)}


def test_the_doctor_runs_every_public_collective_of_comm():
    found = public_collectives()
    assert {"all_reduce", "scan", "exscan", "all_gather_object", "split", "free"} <= found  # the scan finds them
    assert found - covered() == set(), "collectives the doctor does not run"
    assert "sendrecv" in covered()


def test_each_check_runs_and_is_right_on_a_world_of_one():
    from spmd.comms.backends.serial import SerialBackend

    comm = Comm(SerialBackend())
    cases = _cases(comm, np)
    assert tuple(name for name, _ in cases) == NAMES
    assert {name: bool(case()) for name, case in cases} == dict.fromkeys(NAMES, True)


def test_a_collective_failed_on_some_ranks_keeps_them():
    ok = {"name": "scan", "ok": True, "error": None, "ms": 1.0, "backend": "gloo"}
    bad = dict(ok, ok=False, error="a wrong result", ms=3.0)
    (got,) = combine([[ok], [bad], [ok], [dict(bad, error="timed out")]])
    assert got == {"name": "scan", "ok": False, "backend": "gloo", "ms": 3.0, "error": "a wrong result",
                   "ranks": [1, 3]}
