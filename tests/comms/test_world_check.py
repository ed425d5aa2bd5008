"""Every collective of spmd.comm at several sizes on gloo, on ranks the spmd pytest plugin forks.

The same script (tests/worlds/check_comm.py) runs under each launcher in
tests/launchers/test_worlds.py, where the launcher is the point; here the
sizes are: the plugin's ranks cost no interpreter start, so odd sizes come cheap.
"""

import runpy
import sys

import pytest

from tests.support import WORLDS

pytestmark = pytest.mark.launcher


@pytest.mark.spmd(ranks=[2, 3, 4, 8], timeout=240)
def test_every_collective_at_every_size(comm, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["check_comm.py"])
    runpy.run_path(str(WORLDS / "check_comm.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert f"rank {comm.rank} size {comm.size} backend gloo launcher spmd" in out and "CHECKS OK" in out, out[-2000:]
