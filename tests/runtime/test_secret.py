"""The job's secret: from the environment, or a private file rank 0 writes and the others read."""

import os
import stat
import time

import pytest

from spmd.errors import RendezvousError
from spmd.runtime import secret

pytestmark = pytest.mark.unit


def test_spmd_secret_is_used_and_one_too_short_is_refused_with_the_fix():
    assert secret.given({}) is None and secret.given({"SPMD_SECRET": "  "}) is None
    assert secret.given({"SPMD_SECRET": "a" * 32}) == b"a" * 32
    with pytest.raises(RendezvousError, match="at least 16 random ones.*token_hex"):
        secret.given({"SPMD_SECRET": "short"})
    assert len(secret.new()) == 32 and secret.new() != secret.new()


def test_rank_0_publishes_for_its_user_alone_and_the_others_read_it(tmp_path):
    env = {"SPMD_SECRET_DIR": str(tmp_path / "s")}
    key = secret.new()
    path = secret.publish("slurm-7.0", key, env)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert secret.read("slurm-7.0", env, time.monotonic() + 1) == key
    secret._remove(path, b"another job's")  # a later job's file is not removed
    assert path.exists()
    secret._remove(path, key)
    assert not path.exists()


def test_a_folder_others_can_read_is_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(RendezvousError, match="not private to this user.*chmod 700"):
        secret.publish("x", secret.new(), {"SPMD_SECRET_DIR": str(open_dir)})


def test_no_secret_in_time_names_the_file_and_the_ways_out(tmp_path):
    env = {"SPMD_SECRET_DIR": str(tmp_path)}
    began = time.monotonic()
    with pytest.raises(RendezvousError, match=r"no secret for this job at .*/127.0.0.1-1234.*SPMD_SECRET"):
        secret.read("127.0.0.1-1234", env, time.monotonic() + 0.3)
    assert time.monotonic() - began < 5


def test_the_default_folder_is_in_the_users_cache():
    assert str(secret.folder({"XDG_CACHE_HOME": "/c"})) == "/c/spmd/secrets"
