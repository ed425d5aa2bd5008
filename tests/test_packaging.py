"""What the packaging promises is what is tested: the Python floor, and the test dependencies declared."""

import configparser
import os
import re
import sys

import pytest

from tests.support import CI, REPO

pytestmark = pytest.mark.unit


def setup_cfg():
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(REPO / "setup.cfg")
    return cfg


def stated_floors():
    """Return {where: (major, minor)} for every place that states the Python floor."""
    requires = setup_cfg()["options"]["python_requires"].strip()
    m = re.fullmatch(r">=\s*(\d+)\.(\d+)", requires)
    assert m, f"setup.cfg python_requires is {requires!r}, not '>=X.Y'"
    found = {"setup.cfg python_requires": (int(m[1]), int(m[2]))}
    readme = re.findall(r"Python (\d+)\.(\d+)\+", (REPO / "README.md").read_text())
    assert readme, "README.md states no 'Python X.Y+'"
    found.update({f"README.md 'Python {a}.{b}+'": (int(a), int(b)) for a, b in readme})
    mypy = setup_cfg()["mypy"]["python_version"].strip()  # tests/test_typing.py checks the code as this Python
    found["setup.cfg [mypy] python_version"] = tuple(int(n) for n in mypy.split("."))
    return found


def test_the_python_floor_is_stated_once_and_is_the_one_tested():
    floors = stated_floors()
    assert len(set(floors.values())) == 1, f"the Python floor is stated differently: {floors}"
    floor = next(iter(floors.values()))
    running = sys.version_info[:2]
    assert running >= floor, f"Python {running} runs below the stated floor {floor}"
    # CI (.ci/run, or any CI that sets CI=true) is what tests the floor: it must run on the floor itself.
    if CI or os.environ.get("CI") == "true":
        assert running == floor, (f"CI runs Python {running[0]}.{running[1]}, but the stated floor is "
                                  f"{floor[0]}.{floor[1]}: run CI on the floor, or state the floor CI tests")
