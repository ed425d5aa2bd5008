"""The spmd marker read and checked (spmd.testing.marks)."""

import pytest

from spmd.errors import MarkerError
from spmd.testing.marks import read, size_id

pytestmark = pytest.mark.unit


def _mark(*args, **kwargs):
    return pytest.mark.spmd(*args, **kwargs).mark


def test_a_marker_reads_as_sizes_backend_and_timeout():
    spec = read(_mark(ranks=4, backend="gloo", timeout=5))
    assert (spec.sizes, spec.backend, spec.timeout, spec.parametrized) == ((4,), "gloo", 5.0, False)
    spec = read(_mark([2, 3]))
    assert (spec.sizes, spec.parametrized, spec.backend, spec.timeout) == ((2, 3), True, None, None)


@pytest.mark.parametrize("args, kwargs, words", [
    ((), {}, "say how many ranks"),
    ((), {"ranks": 0}, "an int >= 1"),
    ((), {"ranks": True}, "an int >= 1"),
    ((), {"ranks": []}, "non-empty list"),
    ((), {"ranks": [2, 2]}, "a size twice"),
    ((2,), {"ranks": 2}, "ranks given twice"),
    ((2, 3), {}, "one positional argument"),
    ((), {"ranks": 2, "backend": "nvshmem"}, "backend must be one of"),
    ((), {"ranks": 2, "timeout": 0}, "timeout must be a number of seconds > 0"),
    ((), {"ranks": 2, "procs": 3}, "unknown argument(s) ['procs']"),
])
def test_a_bad_marker_is_refused_naming_the_test_and_the_fix(args, kwargs, words):
    with pytest.raises(MarkerError) as info:
        read(_mark(*args, **kwargs), "test_x.py::test_y")
    assert "test_x.py::test_y: @pytest.mark.spmd:" in str(info.value) and words in str(info.value)


def test_sizes_are_named_as_their_test_ids():
    assert [size_id(n) for n in (1, 2, 8)] == ["1 rank", "2 ranks", "8 ranks"]
