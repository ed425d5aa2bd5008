"""tmp_path shared by a test's ranks (spmd.testing.tmp)."""

from types import SimpleNamespace

import pytest
from _pytest.tmpdir import TempPathFactory

from spmd.testing.tmp import share

pytestmark = pytest.mark.unit


def _config(tmp_path):
    factory = TempPathFactory(tmp_path / "given", 3, "all", trace=lambda *a: None, _ispytest=True)
    return SimpleNamespace(_tmp_path_factory=factory), factory


def test_every_rank_gets_the_same_directories_in_order_and_the_factory_comes_back(tmp_path):
    paths = []
    for _rank in range(3):  # three ranks, each making the same calls in the same order
        config, factory = _config(tmp_path)
        undo = share(config, tmp_path / "t1")
        paths.append((factory.mktemp("test_x"), factory.mktemp("test_x"), factory.mktemp("data", numbered=False),
                      factory.getbasetemp()))
        undo()
        assert factory.getbasetemp() == tmp_path / "given" and factory.mktemp("y").parent == tmp_path / "given"
    assert paths[0] == paths[1] == paths[2]
    assert paths[0] == (tmp_path / "t1" / "test_x0", tmp_path / "t1" / "test_x1", tmp_path / "t1" / "data",
                        tmp_path / "t1")
    assert all(p.is_dir() for p in paths[0])


def test_a_path_outside_the_base_is_refused_as_pytest_refuses_it(tmp_path):
    config, factory = _config(tmp_path)
    share(config, tmp_path / "t2")
    with pytest.raises(ValueError):
        factory.mktemp("../escape")
