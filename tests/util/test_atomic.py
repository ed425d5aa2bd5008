"""Nothing lost: outputs appear whole or not at all, and the temporaries of killed runs are cleaned.

In process: spmd.util.atomic's writers on errors, exclusive writes and the
removal of dead processes' temporaries. Launched: jobs SIGKILLed while
they write a big output or a checkpoint.
"""

import importlib.util
import os
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tests.support import MPIRUN, PY, REPO, clean_env, finish, start
from spmd.util import atomic
from spmd.util.atomic import AtomicFile, atomic_path, atomic_write, remove_stale, stale_temporaries, temporary_name
from spmd.train.checkpoint import atomic_save

JOBS = REPO / "jobs"
needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found")


def temporaries(folder):
    return sorted(p.name for p in folder.iterdir() if atomic.MARK in p.name)


def dead_pid():
    """Return the pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# -- in process -------------------------------------------------------------------------


@pytest.mark.unit
def test_the_temporary_is_beside_the_target_and_names_it_the_host_and_the_pid(tmp_path):
    tmp = temporary_name(tmp_path / "out.npy")
    name = os.path.basename(tmp)
    assert os.path.dirname(tmp) == str(tmp_path)
    host = atomic._host()
    assert name.startswith(f".out.npy.spmd-tmp-{host}-{os.getpid()}-"), name
    assert host and "/" not in host and (host == socket.gethostname() or "_" in host)
    assert temporary_name(tmp_path / "out.npy") != tmp  # a random part: two writers never collide


@pytest.mark.unit
@pytest.mark.parametrize("how", ["file", "path", "stream", "checkpoint"])
def test_an_exception_mid_write_leaves_the_old_target_and_no_temporary(tmp_path, how, monkeypatch):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old, complete")
    with pytest.raises(OSError, match="disk full"):
        if how == "file":
            with atomic_write(target) as f:
                f.write(b"new, half")
                raise OSError("disk full")
        elif how == "path":
            with atomic_path(target) as tmp:
                with open(tmp, "wb") as f:
                    f.write(b"new, half")
                raise OSError("disk full")
        elif how == "stream":
            out = AtomicFile(target)
            out.file.write(b"new, half")
            monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
            out.commit()
        else:
            def broken(obj, f):
                f.write(b"half a checkpoint")
                raise OSError("disk full")

            monkeypatch.setattr(torch, "save", broken)
            atomic_save({"step": 2}, target)
    monkeypatch.undo()
    assert target.read_bytes() == b"old, complete"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


@pytest.mark.unit
def test_a_whole_write_replaces_the_target_with_the_umasks_mode(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    with atomic_write(target, text=True) as f:
        f.write("new")
    assert target.read_text() == "new"
    with atomic_path(tmp_path / "p.bin") as tmp:
        with open(tmp, "wb") as f:
            f.write(b"via a path")
    assert (tmp_path / "p.bin").read_bytes() == b"via a path"
    umask = os.umask(0)
    os.umask(umask)
    assert (target.stat().st_mode & 0o777) == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "p.bin"]


@pytest.mark.unit
def test_a_name_near_the_limit_still_gets_a_temporary_and_its_cleanup(tmp_path, capsys):
    target = tmp_path / ("x" * 250)
    stale = tmp_path / os.path.basename(temporary_name(target, pid=dead_pid()))
    assert len(stale.name) <= 255
    stale.write_bytes(b"piece")
    with atomic_write(target) as f:
        f.write(b"whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]
    assert "removed 1 temporary file" in capsys.readouterr().err


@pytest.mark.unit
def test_an_exclusive_write_never_replaces_an_existing_file(tmp_path):
    target = tmp_path / "job.sbatch"
    with atomic_write(target, text=True, exclusive=True) as f:
        f.write("#!/bin/bash\n")
    with pytest.raises(FileExistsError):
        with atomic_write(target, text=True, exclusive=True) as f:
            f.write("another job\n")
    assert target.read_text() == "#!/bin/bash\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sbatch"]


@pytest.mark.unit
def test_a_dead_pids_temporary_is_cleaned_on_the_next_write_and_a_live_ones_is_not(tmp_path, capsys):
    target = tmp_path / "out.npy"
    host = atomic._host()
    dead = dead_pid()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        names = {
            "dead": f".out.npy.spmd-tmp-{host}-{dead}-0123abcd",
            "live": f".out.npy.spmd-tmp-{host}-{sleeper.pid}-0123abcd",
            "init": f".out.npy.spmd-tmp-{host}-1-0123abcd",  # another user's live process (EPERM or not)
            "other host": f".out.npy.spmd-tmp-{host}-2-{dead}-0123abcd",  # host "NAME-2": its pids mean nothing here
            "other target": f".other.npy.spmd-tmp-{host}-{dead}-0123abcd",
            "not ours": f".out.npy.{dead}.tmp",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"piece")
        assert stale_temporaries(target) == [(str(tmp_path / names["dead"]), dead)]
        with atomic_write(target) as f:
            f.write(b"whole")
        line = capsys.readouterr().err
        assert line == (f"spmd: removed 1 temporary file of {target} left by dead process "
                        f"(pid {dead}) on this host\n")
        kept = sorted(v for k, v in names.items() if k != "dead")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["out.npy"])
        assert target.read_bytes() == b"whole"
        assert remove_stale(target) == [] and capsys.readouterr().err == ""  # nothing more to say
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.unit
def test_a_checkpoint_save_cleans_a_killed_saves_temporary(tmp_path, capsys):
    path = tmp_path / "ck.pt"
    atomic_save({"step": 1}, path)
    stale = tmp_path / os.path.basename(temporary_name(path, pid=dead_pid()))
    stale.write_bytes(b"half a checkpoint")
    atomic_save({"step": 2}, path)
    assert torch.load(path) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]
    assert "removed 1 temporary file of" in capsys.readouterr().err


# -- SIGKILLed jobs ---------------------------------------------------------------------


def kill_while_writing(proc, folder, name, timeout, min_bytes=1):
    """SIGKILL proc's whole session as soon as a temporary of folder/name holds min_bytes; return its name."""
    deadline = time.monotonic() + timeout
    prefix = f".{name}{atomic.MARK}"
    while time.monotonic() < deadline and proc.poll() is None:
        for entry in os.scandir(folder):
            if entry.name.startswith(prefix):
                try:
                    big = entry.stat().st_size >= min_bytes
                except FileNotFoundError:
                    continue
                if big:
                    os.killpg(proc.pid, signal.SIGKILL)
                    finish(proc, 60)
                    # mpirun has ended, the rank maybe not yet (SIGKILLed, still exiting):
                    # until it has, its temporary is a live writer's, which no run removes.
                    writer = int(entry.name[len(prefix):].rsplit("-", 2)[-2])
                    gone = time.monotonic() + 30
                    while os.path.exists(f"/proc/{writer}") and time.monotonic() < gone:
                        time.sleep(0.01)
                    assert not os.path.exists(f"/proc/{writer}"), f"the writer (pid {writer}) outlived its job by 30 s"
                    return entry.name
        time.sleep(0.002)
    out = finish(proc, 60).stdout
    pytest.fail(f"no temporary of {name} appeared before the job ended (exit {proc.returncode}):\n{out[-3000:]}")


BIG = ["--rows", "300000", "--chunk-rows", "10000", "--quiet"]  # 30 rounds, 9.6 MB of float32


def scatter_gather(output):
    return start([MPIRUN, "-n", 2, PY, JOBS / "scatter_gather.py", *BIG, "--output", output],
                 env=clean_env(SPMD_BACKEND="mpi"))


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(400)
def test_a_job_killed_while_writing_leaves_no_piece_and_the_next_run_cleans_up(tmp_path):
    out = tmp_path / "out.npy"
    # 1: killed while its output is a temporary: nothing under the output's name
    left = kill_while_writing(scatter_gather(out), tmp_path, "out.npy", 200, min_bytes=1 << 20)
    assert not out.exists()
    assert temporaries(tmp_path) == [left]
    assert f"-{socket.gethostname()}-" in left or atomic._host() != socket.gethostname()

    # 2: the next run completes, removes the dead run's temporary and says so
    done = finish(scatter_gather(out), 200)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "spmd: removed 1 temporary file of" in done.stdout and "left by dead process" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.npy"]

    # ... and its output is a clean run's: the job in this process, a world of one
    spec = importlib.util.spec_from_file_location("scatter_gather_job", JOBS / "scatter_gather.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    clean = tmp_path / "clean" / "out.npy"
    clean.parent.mkdir()
    result = CliRunner().invoke(job.main, [*BIG, "--output", str(clean)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == clean.read_bytes()
    assert np.load(out).shape == (300000, 8)

    # 3: killed while replacing a complete output: the complete one stays
    whole = out.read_bytes()
    kill_while_writing(scatter_gather(out), tmp_path, "out.npy", 200, min_bytes=1 << 20)
    assert out.read_bytes() == whole
    assert len(temporaries(tmp_path)) == 1


TRAIN = ["--steps", "40", "--dim", "256", "--layers", "4", "--heads", "4", "--global-batch", "4",
         "--optimizer", "sgd", "--log-every", "0", "--checkpoint-every", "1"]


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(300)
def test_a_training_job_killed_mid_checkpoint_keeps_the_previous_one(tmp_path):
    ck = tmp_path / "ck.pt"
    proc = start([MPIRUN, "-n", 2, PY, JOBS / "train_dp.py", *TRAIN, "--checkpoint", ck],
                 env=clean_env(SPMD_BACKEND="gloo"))
    deadline = time.monotonic() + 200
    while not ck.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ck.exists(), finish(proc, 60).stdout[-3000:]
    kill_while_writing(proc, tmp_path, "ck.pt", 200)  # a later save, mid-way
    state = torch.load(ck)  # the previous checkpoint, whole
    assert 1 <= state["step"] < 40 and state["optimizer_name"] == "sgd"
    assert len(temporaries(tmp_path)) == 1
