"""MPICH's /dev/shm segment is unlinked once every local rank has it mapped (spmd.runtime.mpishm)."""

import pytest

from spmd.runtime import mpishm

pytestmark = pytest.mark.unit


def test_only_mpichs_segments_that_still_have_a_name_are_found(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 rw-s 00000000 00:1a 11 /dev/shm/mpich_shm_82ce785a_0\n"
        "7f10-7f20 rw-s 00000000 00:1a 12 /dev/shm/mpich_shm_1187f027_0 (deleted)\n"
        "7f20-7f30 rw-s 00000000 00:1a 13 /dev/shm/sm_segment.vm.0.1eb00000.0\n"
        "7f30-7f40 r-xp 00000000 08:01 14 /usr/lib/libc.so.6\n"
        "7f40-7f50 rw-p 00000000 00:00 0\n")
    assert mpishm.mapped_segments(str(maps)) == ["/dev/shm/mpich_shm_82ce785a_0"]
    assert mpishm.mapped_segments(str(tmp_path / "none")) == []


class FakeLocal:
    def __init__(self, rank):
        self.rank, self.calls = rank, []

    def Barrier(self):
        self.calls.append("barrier")

    def Get_rank(self):
        return self.rank

    def Free(self):
        self.calls.append("free")


class FakeMPI:
    COMM_TYPE_SHARED = 1

    def __init__(self, version):
        self.version = version

    def Get_library_version(self):
        return self.version


class FakeWorld:
    def __init__(self, local):
        self.local = local

    def Split_type(self, kind):
        return self.local


def test_local_rank_0_unlinks_after_the_barrier_and_other_mpis_are_left_alone(tmp_path, monkeypatch):
    seg = tmp_path / "mpich_shm_x_0"
    seg.write_bytes(b"x")
    monkeypatch.setattr(mpishm, "mapped_segments", lambda: [str(seg)])
    other = FakeLocal(1)
    assert mpishm.release_segments(FakeMPI("MPICH Version: 5.0.2"), FakeWorld(other)) == []
    assert seg.exists() and other.calls == ["barrier", "free"]
    first = FakeLocal(0)
    assert mpishm.release_segments(FakeMPI("MPICH Version: 5.0.2"), FakeWorld(first)) == [str(seg)]
    assert not seg.exists() and first.calls == ["barrier", "free"]
    assert mpishm.release_segments(FakeMPI("Open MPI v5.0.8"), FakeWorld(FakeLocal(0))) == []
