"""spmd.train.checkpoint: written atomically by the root, read by the root for every rank."""

import pytest
import torch

from tests.support import ranks_ok, run_ranks
from spmd.train.checkpoint import atomic_save, load_checkpoint, save_checkpoint


@pytest.mark.unit
def test_atomic_save_replaces_whole_files_only(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    atomic_save({"step": 1}, path)
    assert torch.load(path) == {"step": 1}

    def broken(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        atomic_save({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]


@pytest.mark.unit
def test_checkpoints_are_written_and_read_by_root_only(tmp_path):
    path = tmp_path / "ck.pt"

    def rank(comm):
        wrote = save_checkpoint({"w": torch.arange(3)}, path, comm)
        comm.all_gather_object(None)  # the file exists from here on
        return wrote, load_checkpoint(path, comm)

    (out, _) = ranks_ok(run_ranks(2, rank))
    assert out[0][0] == str(path) and out[1][0] is None
    for _, state in out:
        assert torch.equal(state["w"], torch.arange(3))


@pytest.mark.unit
def test_a_missing_checkpoint_fails_on_every_rank(tmp_path):
    missing = tmp_path / "nope.pt"
    errors = run_ranks(2, lambda c: load_checkpoint(missing, c))[1]
    assert isinstance(errors[0], FileNotFoundError)
    assert isinstance(errors[1], RuntimeError) and "nope.pt" in str(errors[1])
