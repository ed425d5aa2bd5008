"""Tests of the local launcher, with real processes and tiny torch-free scripts."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from spmd.launch.supervise import STRIPPED, child_env, launch

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = (
    "import json, sys; from spmd.launch.supervise import launch; "
    "sys.exit(launch(sys.argv[2:], **json.loads(sys.argv[1])))"
)


def _command(script, nprocs, *args, **kw):
    """Return argv of a launcher subprocess whose children run ``script``."""
    kw = dict(nprocs=nprocs, runner=[], **kw)
    return [sys.executable, "-c", LAUNCHER, json.dumps(kw), str(script), *args]


def _env():
    """Return the test environment with the repository importable."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def spmd_run(script, nprocs, *args, **kw):
    """Launch ``script`` as ``nprocs`` ranks and wait; return the CompletedProcess."""
    return subprocess.run(_command(script, nprocs, *args, **kw), env=_env(),
                          capture_output=True, text=True, timeout=50)


def write(tmp_path, body, name="script.py"):
    """Write a script to ``tmp_path``; return its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def alive(pid):
    """Tell whether ``pid`` is a live process (zombies count as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_dead(pids, seconds=5.0):
    """Return the pids still alive after waiting up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return left


PRINT_ENV = """
    import os, sys
    for key in ("SPMD_RANK", "SPMD_SIZE", "SPMD_LOCAL_RANK", "SPMD_LOCAL_SIZE",
                "SPMD_NODE_RANK", "SPMD_NUM_NODES", "MASTER_ADDR",
                "MASTER_PORT", "SPMD_BACKEND", "SPMD_TIMEOUT",
                "PYTHONUNBUFFERED", "RANK", "OMPI_COMM_WORLD_RANK",
                "SLURM_JOB_ID", "SPMD_LISTEN_FD"):
        print(f"{key}={os.environ.get(key)}")
    print("to stderr", file=sys.stderr)
"""


def parse(lines):
    """Split prefixed ``[rank] KEY=VALUE`` lines into {rank: {KEY: VALUE}}."""
    seen = {}
    for line in lines:
        m = re.fullmatch(r"\[(\d+)\] (\w+)=(.*)", line)
        assert m, f"badly prefixed line: {line!r}"
        seen.setdefault(int(m[1]), {})[m[2]] = m[3]
    return seen


@pytest.mark.launcher
def test_env_and_prefix(tmp_path):
    n = 4
    res = spmd_run(write(tmp_path, PRINT_ENV), n, backend="gloo", timeout=90)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == n * 15
    seen = parse(lines)
    assert sorted(seen) == list(range(n))
    ports = {env["MASTER_PORT"] for env in seen.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, env in seen.items():
        assert env["SPMD_RANK"] == env["SPMD_LOCAL_RANK"] == str(rank)
        assert env["SPMD_SIZE"] == env["SPMD_LOCAL_SIZE"] == str(n)
        assert env["SPMD_NODE_RANK"] == "0" and env["SPMD_NUM_NODES"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["SPMD_BACKEND"] == "gloo" and env["SPMD_TIMEOUT"] == "90"
        assert env["PYTHONUNBUFFERED"] == "1"
    assert sorted(res.stderr.splitlines()) == [f"[{r}] to stderr" for r in range(n)]


@pytest.mark.launcher
def test_prefix_is_padded_to_the_widest_rank(tmp_path):
    script = write(tmp_path, "import os; print('rank', os.environ['SPMD_RANK'])")
    res = spmd_run(script, 11)
    assert res.returncode == 0, res.stderr
    expected = [f"[{r:>2}] rank {r}" for r in range(11)]
    assert sorted(res.stdout.splitlines()) == sorted(expected)
    assert "[ 3] rank 3" in res.stdout.splitlines()


@pytest.mark.launcher
def test_single_rank_has_no_prefix_by_default(tmp_path):
    res = spmd_run(write(tmp_path, "print('alone')"), 1)
    assert (res.returncode, res.stdout) == (0, "alone\n")


@pytest.mark.launcher
def test_other_launchers_variables_are_stripped(tmp_path):
    base = dict(os.environ, RANK="7", OMPI_COMM_WORLD_RANK="7",
                SLURM_JOB_ID="42", SPMD_LISTEN_FD="99", SPMD_BACKEND="nccl")
    res = spmd_run(write(tmp_path, PRINT_ENV), 2, env=base)
    assert res.returncode == 0, res.stderr
    seen = parse(res.stdout.splitlines())
    for rank, env in seen.items():
        assert env["RANK"] == env["OMPI_COMM_WORLD_RANK"] == "None"
        assert env["SLURM_JOB_ID"] == "42"
        assert env["SPMD_BACKEND"] == "nccl"  # the user's own setting is kept
    assert seen[1]["SPMD_LISTEN_FD"] == "None"
    assert seen[0]["SPMD_LISTEN_FD"] != "99"


@pytest.mark.unit
def test_child_env_is_a_pure_function():
    env = child_env(2, 3, port=1234, master_addr="::1", timeout=0.5,
                    base={"WORLD_SIZE": "8", "HOME": "/h"})
    assert env["SPMD_RANK"] == "2" and env["SPMD_SIZE"] == "3"
    assert env["MASTER_ADDR"] == "::1" and env["MASTER_PORT"] == "1234"
    assert env["SPMD_TIMEOUT"] == "0.5" and env["HOME"] == "/h"
    assert "WORLD_SIZE" not in env and "SPMD_BACKEND" not in env
    assert "SPMD_LISTEN_FD" not in env
    assert "RANK" in STRIPPED and "SLURM_JOB_ID" not in STRIPPED


@pytest.mark.launcher
def test_rank0_gets_the_listening_socket(tmp_path):
    script = write(tmp_path, """
        import os, socket
        fd = os.environ.get("SPMD_LISTEN_FD")
        if os.environ["SPMD_RANK"] == "0":
            sock = socket.socket(fileno=int(fd))
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            host, port = sock.getsockname()
            print("bound", host, port, os.environ["MASTER_PORT"])
            conn, _ = sock.accept()
            print("got", conn.recv(100).decode())
        else:
            print("fd", fd)
            port = int(os.environ["MASTER_PORT"])
            with socket.create_connection((os.environ["MASTER_ADDR"], port)) as c:
                c.sendall(b"hello")
    """)
    res = spmd_run(script, 2)
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    _, host, port, master_port = lines[0].split()[1:]
    assert lines[0].startswith("[0] bound")
    assert (host, port) == ("127.0.0.1", master_port)
    assert lines[1] == "[0] got hello"
    assert lines[2] == "[1] fd None"


@pytest.mark.launcher
def test_a_failing_rank_stops_the_others(tmp_path):
    n = 4
    script = write(tmp_path, f"""
        import os, subprocess, sys, time
        rank = int(os.environ["SPMD_RANK"])
        here = {str(tmp_path)!r}
        if rank == 1:
            while len([f for f in os.listdir(here) if f.endswith(".pid")]) < {2 * (n - 1)}:
                time.sleep(0.02)
            print("bye", file=sys.stderr)
            sys.exit(3)
        child = subprocess.Popen(["sleep", "60"])
        open(os.path.join(here, f"g{{rank}}.pid"), "w").write(str(child.pid))
        open(os.path.join(here, f"r{{rank}}.pid"), "w").write(str(os.getpid()))
        time.sleep(60)
    """)
    start = time.monotonic()
    res = spmd_run(script, n)
    assert time.monotonic() - start < 15
    assert res.returncode == 3
    assert res.stderr.count("spmd run:") == 1
    assert "spmd run: rank 1 exited with code 3" in res.stderr
    assert res.stderr.index("[1] bye") < res.stderr.index("spmd run:")
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 * (n - 1)
    assert wait_dead(pids) == []


@pytest.mark.launcher
def test_a_rank_killed_by_a_signal(tmp_path):
    script = write(tmp_path, """
        import os, signal, time
        if os.environ["SPMD_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    """)
    res = spmd_run(script, 2)
    assert res.returncode == 128 + signal.SIGKILL
    assert "spmd run: rank 1 killed by signal SIGKILL" in res.stderr


@pytest.mark.launcher
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_signalled_launcher_stops_the_ranks(tmp_path, signum):
    if signum == signal.SIGKILL and not sys.platform.startswith("linux"):
        pytest.skip("ranks die with the launcher through Linux's PR_SET_PDEATHSIG")
    script = write(tmp_path, f"""
        import os, time
        path = os.path.join({str(tmp_path)!r}, os.environ["SPMD_RANK"] + ".pid")
        open(path, "w").write(str(os.getpid()))
        time.sleep(60)
    """)
    proc = subprocess.Popen(_command(script, 3), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while len(list(tmp_path.glob("*.pid"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)  # let the last pid file be written in full
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=20)
    if signum == signal.SIGKILL:
        assert proc.returncode == -signum
    else:
        assert proc.returncode == 128 + signum
        assert f"spmd run: {signal.Signals(signum).name} received" in err
    assert len(pids) == 3 and wait_dead(pids) == []


@pytest.mark.launcher
def test_concurrent_launches_get_their_own_ports(tmp_path):
    script = write(tmp_path, """
        import os, socket, sys, time
        tag = sys.argv[1]
        port = int(os.environ["MASTER_PORT"])
        if os.environ["SPMD_RANK"] == "0":
            sock = socket.socket(fileno=int(os.environ["SPMD_LISTEN_FD"]))
            conn, _ = sock.accept()
            print("port", port, "peer", conn.recv(100).decode())
        else:
            time.sleep(0.3)  # both jobs are up at the same time
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(tag.encode())
    """)
    procs = [subprocess.Popen(_command(script, 2, tag), env=_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for tag in ("a", "b")]
    outs = [p.communicate(timeout=50) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ports = set()
    for tag, (out, _) in zip("ab", outs):
        _, _, port, _, peer = out.split()
        assert peer == tag
        ports.add(port)
    assert len(ports) == 2


@pytest.mark.launcher
def test_no_prefix_passes_output_through(tmp_path):
    script = write(tmp_path, """
        import os, sys
        # One write per line: spmd run's ranks are unbuffered, where print writes text and
        # newline apart, and without spmd (runner=[]) nothing keeps the two ranks' lines whole.
        sys.stdout.write(f"out {os.environ['SPMD_RANK']}\\n")
        sys.stderr.write(f"err {os.environ['SPMD_RANK']}\\n")
    """)
    res = spmd_run(script, 2, prefix=False)
    assert res.returncode == 0
    assert sorted(res.stdout.splitlines()) == ["out 0", "out 1"]
    assert sorted(res.stderr.splitlines()) == ["err 0", "err 1"]


@pytest.mark.launcher
def test_a_partial_last_line_is_completed(tmp_path):
    script = write(tmp_path, "import sys; sys.stdout.write('no newline')")
    res = spmd_run(script, 2)
    assert sorted(res.stdout.splitlines()) == ["[0] no newline", "[1] no newline"]


@pytest.mark.unit
def test_lines_are_tagged_whole():
    """In-process, the pure part of the output tests above (exits in words: tests/util/test_words.py)."""
    import io

    from spmd.launch.supervise import _Output

    out, err = io.StringIO(), io.StringIO()
    r, w = os.pipe()
    os.write(w, b"one\ntwo")  # the last line without its newline
    os.close(w)
    _Output(out, err).pump(os.fdopen(r, "rb"), b"[ 1] ", err=True).join(10)
    assert (out.getvalue(), err.getvalue()) == ("", "[ 1] one\n[ 1] two\n")


class _Exits:
    """A child whose poll() says it runs for its first ``after`` polls, then returns ``code``."""

    def __init__(self, code, after=0):
        self.code, self.after, self.polls = code, after, 0

    def poll(self):
        self.polls += 1
        return self.code if self.polls > self.after else None


@pytest.mark.unit
def test_the_first_cause_is_the_rank_that_failed_not_the_ranks_it_ended(monkeypatch):
    from spmd.launch import supervise as module

    monkeypatch.setattr(module, "POLL", 0.001)
    monkeypatch.setattr(module, "SETTLE", 1e6)  # a wait that did not end as it should hits the test's timeout
    # A raising rank that exits after the peers it aborted (status 75) is still the cause.
    procs = [_Exits(1, after=5), _Exits(75), _Exits(75)]
    assert module._first_cause(procs, 1, 75) == (0, 1)
    # A killed rank is the cause, and the others get the moment they need to report it:
    # it returns once rank 0 has exited by itself, not before.
    procs = [_Exits(75, after=5), _Exits(-9)]
    assert module._first_cause(procs, 1, -9) == (1, -9)
    assert procs[0].polls == 6, procs[0].polls
    # Only ended ranks: the first one seen stands.
    assert module._first_cause([_Exits(75), _Exits(75)], 1, 75) == (1, 75)
    # A launcher's signal cuts the wait short: the rank still running is not even polled.
    running = _Exits(0, after=10**9)
    assert module._first_cause([running, _Exits(3)], 1, 3, stop=[15]) == (1, 3)
    assert running.polls == 0
    # A rank that never exits is waited for SETTLE seconds, then left to _terminate.
    monkeypatch.setattr(module, "SETTLE", 0.05)
    running = _Exits(0, after=10**9)
    assert module._first_cause([running, _Exits(2)], 1, 2) == (1, 2)
    assert running.polls >= 1
    # While only ranks a peer ended (75) have exited, the rank that failed is waited for
    # past SETTLE (its report can take longer than SETTLE under load), up to CAUSE_WAIT.
    monkeypatch.setattr(module, "SETTLE", 0.001)
    monkeypatch.setattr(module, "CAUSE_WAIT", 1e6)
    assert module._first_cause([_Exits(75), _Exits(1, after=200)], 0, 75) == (1, 1)
    monkeypatch.setattr(module, "CAUSE_WAIT", 0.05)
    running = _Exits(0, after=10**9)
    assert module._first_cause([_Exits(75), running], 0, 75) == (0, 75)
    assert running.polls >= 2


@pytest.mark.unit
def test_launch_checks_its_arguments():
    with pytest.raises(ValueError, match="nprocs"):
        launch(["x.py"], 0)
    with pytest.raises(ValueError, match="argv"):
        launch([], 2)


# The click command

@pytest.fixture
def cli():
    """Return the ``spmd run`` click command."""
    from spmd.cli.run import run

    return run


@pytest.mark.unit
def test_cli_rejects_zero_ranks(cli, tmp_path):
    script = write(tmp_path, "pass")
    res = CliRunner().invoke(cli, ["-n", "0", str(script)])
    assert res.exit_code == 2
    assert "-n" in res.output and "0" in res.output


@pytest.mark.unit
def test_cli_names_a_missing_script(cli, tmp_path):
    missing = tmp_path / "nope.py"
    res = CliRunner().invoke(cli, ["-n", "2", str(missing)])
    assert res.exit_code == 2
    assert "no such file" in res.output and "nope.py" in res.output


@pytest.mark.unit
def test_cli_rejects_an_unknown_backend(cli, tmp_path):
    res = CliRunner().invoke(cli, ["-n", "2", "--backend", "tcp", "x.py"])
    assert res.exit_code == 2 and "tcp" in res.output


@pytest.mark.unit
def test_cli_reports_a_bad_master_addr(cli, tmp_path):
    script = write(tmp_path, "pass")
    res = CliRunner().invoke(cli, ["-n", "1", "--master-addr", "192.0.2.1",
                                   str(script)])
    assert res.exit_code == 1 and "192.0.2.1" in res.output


@pytest.mark.unit
def test_cli_passes_options_and_arguments(cli, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("spmd.cli.run.launch_with_restarts",
                        lambda argv, n, **kw: calls.append((argv, n, kw)) or 5)
    script = write(tmp_path, "pass")
    res = CliRunner().invoke(cli, ["-n", "3", "--backend", "gloo", "--no-prefix",
                                   "--timeout", "2.5", str(script), "-n", "9"])
    assert res.exit_code == 5
    argv, n, kw = calls[0]
    assert argv == [str(script), "-n", "9"] and n == 3
    assert kw == dict(backend="gloo", prefix=False, timeout=2.5, master_addr="127.0.0.1",
                      preload=None, preload_keep=0, max_restarts=0, restart_ranks=None)
    res = CliRunner().invoke(cli, ["-n", "2", "-m", "pkg.main", "--flag"])
    assert res.exit_code == 5 and calls[1][0] == ["-m", "pkg.main", "--flag"]
