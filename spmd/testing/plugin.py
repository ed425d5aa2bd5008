"""spmd's pytest plugin (entry point ``pytest11: spmd``): the marker, the fixtures, the mode.

    @pytest.mark.spmd(ranks=4)
    def test_sum(comm):
        assert comm.all_reduce(np.ones(1))[0] == comm.size

Under plain ``pytest`` each marked test runs on ranks forked for it
(spmd.testing.local); under a launcher (``mpirun -n 8 pytest``) on
sub-communicators of the world (spmd.testing.under_launcher).  docs/testing-your-code.md.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from spmd.testing.marks import COMM, PARAM, read, size_id, size_of, spec_of

__all__ = ["pytest_addoption", "pytest_configure", "pytest_generate_tests", "comm", "spmd_ranks",
           "DEFAULT_TIMEOUT"]

#: Seconds a marked test may take on every rank, unless its marker or --spmd-timeout says otherwise.
DEFAULT_TIMEOUT = 120.0

_MARKER = ("spmd(ranks=4, backend=None, timeout=None): run the test on that many ranks (a list: once "
           "per size), each with the comm fixture; backend as spmd.init takes it; timeout in seconds "
           "for the whole test (docs/testing-your-code.md)")


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("spmd", "multi-rank tests (spmd)")
    group.addoption("--spmd-timeout", type=float, default=None, metavar="SECONDS",
                    help=f"seconds a test marked spmd may take on every rank (default: the ini "
                         f"spmd_timeout, else {DEFAULT_TIMEOUT:g}); a marker's timeout= wins")
    parser.addini("spmd_timeout", "seconds a test marked spmd may take (--spmd-timeout)",
                  default=str(DEFAULT_TIMEOUT))


def _timeout(config: Any) -> float:
    value = config.getoption("spmd_timeout")
    if value is None:
        raw = config.getini("spmd_timeout")
        try:
            value = float(raw)
        except ValueError:
            raise pytest.UsageError(f"spmd_timeout = {raw!r} in the ini file: give a number of seconds") from None
    if not value > 0:
        raise pytest.UsageError(f"--spmd-timeout must be a number of seconds > 0, got {value:g}")
    return float(value)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", _MARKER)
    if os.environ.get("SPMD_PYTEST_SERVER") == "1":
        return  # the fork server: its ranks run the tests
    timeout = _timeout(config)
    from spmd.config.placement import detect

    if detect(os.environ).size > 1:
        from spmd.testing.under_launcher import WorldRanks

        config.pluginmanager.register(WorldRanks(config, timeout), "spmd-world")
    else:
        from spmd.testing.local import LocalRanks

        config.pluginmanager.register(LocalRanks(config, timeout), "spmd-local")


def pytest_generate_tests(metafunc: Any) -> None:
    mark = metafunc.definition.get_closest_marker("spmd")
    if mark is None:
        return
    spec = read(mark, metafunc.definition.nodeid)
    if spec.parametrized:
        if PARAM not in metafunc.fixturenames:
            metafunc.fixturenames.append(PARAM)
        metafunc.parametrize(PARAM, spec.sizes, ids=[size_id(n) for n in spec.sizes], indirect=True)


@pytest.fixture
def spmd_ranks(request: Any) -> int:
    """The number of ranks this test runs on (its marker's ranks, or this parametrized size)."""
    spec = spec_of(request.node)
    if spec is None:
        pytest.fail("spmd_ranks is the size of a test marked spmd: mark it @pytest.mark.spmd(ranks=N)",
                    pytrace=False)
    return int(getattr(request, "param", size_of(request.node, spec)))


@pytest.fixture
def comm(request: Any) -> Any:
    """This test's own communicator: its ranks only, with spmd's whole API."""
    found = request.config.stash.get(COMM, None)
    if found is None or request.node.get_closest_marker("spmd") is None:
        pytest.fail("the comm fixture is a test's communicator of several ranks: mark the test "
                    "@pytest.mark.spmd(ranks=N)", pytrace=False)
    return found
