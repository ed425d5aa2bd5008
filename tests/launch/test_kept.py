"""spmd run --preload M --preload-keep S: one fork server kept across launches, for one user.

Every launcher test points XDG_RUNTIME_DIR at a directory of its own (short:
AF_UNIX paths are at most 107 bytes), and the fixture kills whatever is left
there at its end: every process forked from a kept server (its sessions and
their ranks) has the server's command line, which names that directory.
"""

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest
from click.testing import CliRunner

from spmd.util.paths import KEPT_SERVER
from tests.support import clean_env
from tests.launch.test_forkserver import SAME, alive, spmd_run, wait_dead, write


def _cmdlines():
    """{pid: (ppid, command line)} of every process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        found[int(entry)] = (ppid, cmdline)
    return found


class Kept:
    """A test's kept-server directory and the environment that uses it."""

    def __init__(self, base, tmp_path):
        self.base, self.tmp = base, tmp_path
        self.dir = os.path.join(base, "spmd")
        self.env = clean_env(XDG_RUNTIME_DIR=base,
                             PYTHONPATH=f"{tmp_path}{os.pathsep}{clean_env()['PYTHONPATH']}")

    def forked(self):
        """{pid: ppid} of the live kept servers of this test and of everything forked from them."""
        return {pid: ppid for pid, (ppid, cmd) in _cmdlines().items()
                if KEPT_SERVER in cmd and self.base in cmd and alive(pid)}

    def servers(self):
        """The pids of this test's live kept servers (not their sessions or ranks)."""
        procs = self.forked()
        return sorted(pid for pid, ppid in procs.items() if ppid not in procs)

    def sockets(self):
        return sorted(n for n in os.listdir(self.dir) if n.endswith(".sock")) if os.path.isdir(self.dir) else []

    def run(self, *args, keep=30, env=None, **kw):
        return spmd_run("--preload-keep", keep, *args, env=env or self.env, **kw)


@pytest.fixture
def kept(tmp_path):
    base = tempfile.mkdtemp(prefix="spk", dir="/tmp")
    k = Kept(base, tmp_path)
    try:
        yield k
    finally:
        for _ in range(3):
            for pid in k.forked():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not wait_dead(list(k.forked()), 5):
                break
        left = k.forked()
        shutil.rmtree(base, ignore_errors=True)
        assert not left, f"kept servers left running: {left}"


# The module the tests preload: its import appends the importing pid to a file, once per server.
COUNTED = """
    import os, sys
    VALUE = {value}
    with open({count!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    print("counted imported")
    print("counted warns", file=sys.stderr)
"""

# What a rank says: whether the module came preloaded, a collective, the value, its kept server.
SCRIPT = """
    import sys
    PRE = "counted" in sys.modules
    import os
    import counted
    import torch
    from spmd import comm
    x = torch.ones(2) * (comm.rank + 1)
    comm.all_reduce(x)
    session = os.getppid()
    with open(f"/proc/{session}/stat") as f:
        server = int(f.read().rsplit(")", 1)[1].split()[1])
    print("rank", comm.rank, "pre", PRE, "sum", x.tolist(), "value", counted.VALUE, "foo", os.environ.get("FOO"))
    print("server", server, "session", session, file=sys.stderr)
"""


def _counted(kept, value=1):
    count = kept.tmp / "imports"
    write(kept.tmp, COUNTED.format(value=value, count=str(count)), name="counted.py")
    return count


def _servers_of(err):
    """The kept servers the ranks named on stderr."""
    return {int(line.split()[2]) for line in err.splitlines() if " server " in line and "session" in line}


MODULES = ["--preload", "torch,counted"]


@pytest.mark.launcher
@pytest.mark.timeout(180)
def test_consecutive_launches_share_one_kept_server_and_a_failing_rank_still_ends_the_job(kept):
    count = _counted(kept)
    script = write(kept.tmp, SCRIPT)
    first = kept.run(*MODULES, "-n", 2, "--backend", "gloo", script)
    second = kept.run(*MODULES, "-n", 2, "--backend", "gloo", script)
    for code, out, err, _ in (first, second):
        assert code == 0, out[-2000:] + err[-3000:]
        for r in range(2):
            assert f"[{r}] rank {r} pre True sum [3.0, 3.0] value 1 foo None" in out.splitlines(), out + err
    # the imports' words once, untagged, from the launch that started the server
    assert first[1].splitlines().count("counted imported") == 1 and "counted warns" in first[2].splitlines()
    assert "counted imported" not in second[1] and "counted warns" not in second[2]
    servers = _servers_of(first[2]) | _servers_of(second[2])
    assert len(servers) == 1 and count.read_text().split() == [str(s) for s in servers], (servers, first[2])
    assert kept.servers() == sorted(servers) and len(kept.sockets()) == 1

    failing = write(kept.tmp, """
        import counted
        from spmd import comm
        comm.barrier()
        if comm.rank == 1:
            PROMISE
            raise ValueError("rank 1 found a bad record")
        comm.barrier()
    """, name="failing.py")
    code, out, err, seconds = kept.run(*MODULES, "-n", 2, failing)
    assert code == 1, err[-3000:]
    assert err.count("ValueError: rank 1 found a bad record") == 1, err[-3000:]
    assert "spmd run: rank 1 exited with code 1" in err and seconds < 30, err[-3000:]
    assert count.read_text().split() == [str(s) for s in servers]  # no import again
    assert kept.servers() == sorted(servers)


@pytest.mark.launcher
@pytest.mark.timeout(180)
def test_a_kept_launch_matches_a_launch_without_keep(kept):
    script = write(kept.tmp, SAME)
    args = ["--preload", "torch,numpy.random", "-n", 3, "--backend", "gloo", script, "a", "b c"]
    kept.run(*args, stdin="typed\n")  # starts the server
    warm = kept.run(*args, stdin="typed\n")
    plain = spmd_run(*args, stdin="typed\n", env=kept.env)
    for code, out, err, _ in (warm, plain):
        assert code == 0, out[-2000:] + err[-3000:]
    assert sorted(warm[1].splitlines()) == sorted(plain[1].splitlines())
    assert sorted(warm[2].splitlines()) == sorted(plain[2].splitlines())
    lines = warm[1].splitlines()
    assert "[0] stdin 'typed\\n'" in lines and "[0] listening before init 1 fd" in lines
    assert "[0] draws differ between ranks [True, True, True]" in lines
    assert len(kept.servers()) == 1


@pytest.mark.launcher
@pytest.mark.timeout(180)
def test_another_environment_gets_another_server_and_a_changed_module_replaces_its_server(kept):
    count = _counted(kept)
    script = write(kept.tmp, SCRIPT)
    runs = {}
    for foo in ("1", "2"):
        env = dict(kept.env, FOO=foo)
        runs[foo] = kept.run(*MODULES, "-n", 2, script, env=env)
        assert runs[foo][0] == 0 and f"[1] rank 1 pre True sum [3.0, 3.0] value 1 foo {foo}" in runs[foo][1], \
            runs[foo][2][-3000:]
    one, two = _servers_of(runs["1"][2]), _servers_of(runs["2"][2])
    assert len(one) == len(two) == 1 and one != two and len(kept.sockets()) == 2
    assert sorted(count.read_text().split()) == sorted(map(str, one | two))

    time.sleep(0.01)
    _counted(kept, value=22)  # another size and mtime: the server that imported it is stale
    code, out, err, _ = kept.run(*MODULES, "-n", 2, script, env=dict(kept.env, FOO="1"))
    assert code == 0 and "[0] rank 0 pre True sum [3.0, 3.0] value 22 foo 1" in out, err[-3000:]
    three = _servers_of(err)
    assert len(three) == 1 and three != one and "counted imported" in out
    assert wait_dead(list(one)) == [], "the stale server did not exit"
    assert len(count.read_text().split()) == 3 and len(kept.sockets()) == 2
    assert kept.servers() == sorted(two | three)


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_a_kept_server_exits_after_its_idle_time_and_removes_its_socket(kept):
    _counted(kept)
    script = write(kept.tmp, """
        import os, sys
        print("server", int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1]),
              "session", os.getppid(), file=sys.stderr)
    """)
    code, out, err, _ = kept.run("--preload", "counted", "-n", 2, script, keep=3)
    assert code == 0, err
    (server,) = _servers_of(err)
    assert alive(server) and len(kept.sockets()) == 1
    began = time.monotonic()
    assert wait_dead([server], 20) == [], "still running 20 s after its launch"
    assert time.monotonic() - began > 1.0  # it waited
    assert kept.sockets() == []
    with open(os.path.join(kept.dir, os.listdir(kept.dir)[0].split(".")[0] + ".err")) as f:
        assert "idle for 3 s: exiting" in f.read()


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_the_socket_is_for_its_user_alone(kept):
    _counted(kept)
    script = write(kept.tmp, "pass")
    code, _, err, _ = kept.run("--preload", "counted", "-n", 1, script)
    assert code == 0, err
    assert stat.S_IMODE(os.stat(kept.dir).st_mode) == 0o700
    (name,) = kept.sockets()
    path = os.path.join(kept.dir, name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    if os.getuid() != 0:
        pytest.skip("the other-uid half needs root")
    (server,) = kept.servers()
    other = r"""
import ctypes, os, socket, sys
mode, path = sys.argv[1:]
if mode == "uid":
    os.setuid(65534)
else:  # another uid for SO_PEERCRED, root's for the directory's permissions
    os.seteuid(65534)
    ctypes.CDLL(None).setfsuid(0)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    s.connect(path)
except OSError as e:
    print("refused", type(e).__name__)
    sys.exit()
s.settimeout(10)
print("connected, then", repr(s.recv(100)))
"""
    refused = subprocess.run([sys.executable, "-c", other, "uid", path], capture_output=True, text=True, timeout=30)
    assert refused.stdout == "refused PermissionError\n", refused.stdout + refused.stderr
    dropped = subprocess.run([sys.executable, "-c", other, "euid", path], capture_output=True, text=True,
                             timeout=30)
    assert dropped.stdout == "connected, then b''\n", dropped.stdout + dropped.stderr
    with open(path[:-5] + ".err") as f:
        assert "dropped a connection from uid 65534" in f.read()
    assert [p for p, pp in kept.forked().items() if pp == server] == []  # no session was forked
    assert kept.servers() == [server]


@pytest.mark.launcher
@pytest.mark.timeout(180)
def test_a_killed_launcher_ends_its_ranks_but_not_the_kept_server(kept):
    count = _counted(kept)
    script = write(kept.tmp, f"""
        import os, time
        import counted
        path = os.path.join({str(kept.tmp)!r}, os.environ["SPMD_RANK"] + ".pid")
        open(path + ".tmp", "w").write(f"{{os.getpid()}} {{os.getppid()}}")
        os.rename(path + ".tmp", path)
        time.sleep(60)
    """)
    proc = subprocess.Popen([*_spmd(), "run", "--preload-keep", "30", *MODULES, "-n", "3", str(script)],
                            env=kept.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(list(kept.tmp.glob("*.pid"))) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    found = [p.read_text().split() for p in kept.tmp.glob("*.pid")]
    ranks = [int(pid) for pid, _ in found]
    sessions = {int(parent) for _, parent in found}
    assert len(ranks) == 3 and len(sessions) == 1, (found, proc.poll())
    (server,) = kept.servers()
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=20)
    began = time.monotonic()
    assert wait_dead(ranks + list(sessions)) == [], "left behind"
    assert time.monotonic() - began < 5
    assert kept.servers() == [server]
    code, out, err, _ = kept.run(*MODULES, "-n", 2, write(kept.tmp, SCRIPT))
    assert code == 0 and _servers_of(err) == {server}, err[-3000:]
    assert count.read_text().split() == [str(server)]


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_launches_starting_at_once_end_with_one_server(kept):
    count = _counted(kept)
    script = write(kept.tmp, """
        import os, sys
        print("server", int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1]),
              "session", os.getppid(), file=sys.stderr)
    """)
    procs = [subprocess.Popen([*_spmd(), "run", "--preload-keep", "30", "--preload", "counted", "-n", "2", str(script)],
                              env=kept.env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True) for _ in range(3)]
    results = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], results
    servers = set().union(*(_servers_of(err) for _, err in results))
    assert len(servers) == 1 and count.read_text().split() == [str(s) for s in servers], results
    assert sum(out.count("counted imported") for out, _ in results) == 1


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_a_refused_import_is_refused_as_without_keep_and_leaves_no_server(kept):
    ran = kept.tmp / "ran"
    script = write(kept.tmp, f"open({str(ran)!r}, 'w').close()")
    code, out, err, _ = kept.run("--preload", "no_such_module_here", "-n", 2, script)
    assert code == 1 and ("Error: --preload: cannot import 'no_such_module_here' (ModuleNotFoundError: "
                          "No module named 'no_such_module_here')") in err, err
    assert not ran.exists() and out == ""
    assert kept.servers() == [] and kept.sockets() == []


def _spmd():
    from tests.launch.test_forkserver import SPMD

    return [SPMD]


# -- unit ---------------------------------------------------------------------------------------

@pytest.mark.unit
def test_the_key_leaves_out_the_launchs_own_variables_only():
    from spmd.launch.supervise import _shared, child_env
    from spmd.launch.forkserver.kept import server_key

    def key(port=5, size=2, base=None, modules=("torch",), cwd="/w", executable=None):
        envs = [child_env(r, size, port=port, base=base or {"HOME": "/h"}, backend="gloo") for r in range(size)]
        return server_key(modules, _shared(envs), cwd=cwd, executable=executable)

    same = key()
    assert len(same) == 16 and key(port=6) == same and key(size=8) == same
    assert key(base={"HOME": "/h", "SPMD_DEBUG": "1"}) == same
    assert key(base={"HOME": "/h", "FOO": "1"}) != same
    assert key(modules=("torch", "numpy")) != same
    assert key(modules=("numpy", "torch")) != key(modules=("torch", "numpy"))
    assert key(cwd="/elsewhere") != same and key(executable="/other/python") != same


@pytest.mark.unit
def test_the_directory_is_made_0700_and_an_open_or_foreign_one_is_refused(tmp_path):
    from spmd.errors import LaunchError
    from spmd.launch.forkserver.kept import runtime_dir

    path = runtime_dir({"XDG_RUNTIME_DIR": str(tmp_path)})
    assert path == str(tmp_path / "spmd") and stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert runtime_dir({"XDG_RUNTIME_DIR": str(tmp_path)}) == path
    os.chmod(path, 0o755)
    with pytest.raises(LaunchError, match=rf"{path} is open to other users \(mode 0755\).*chmod 700 {path}"):
        runtime_dir({"XDG_RUNTIME_DIR": str(tmp_path)})
    os.chmod(path, 0o700)
    if os.getuid() == 0:
        os.chown(path, 65534, -1)
        with pytest.raises(LaunchError, match=rf"{path} is owned by uid 65534, not by you.*rm -r {path}"):
            runtime_dir({"XDG_RUNTIME_DIR": str(tmp_path)})
        os.chown(path, 0, -1)
    os.rmdir(path)
    os.symlink(tmp_path, path)
    with pytest.raises(LaunchError, match="is not a directory"):
        runtime_dir({"XDG_RUNTIME_DIR": str(tmp_path)})


@pytest.mark.unit
def test_a_changed_or_removed_module_file_makes_the_snapshot_stale(tmp_path, monkeypatch):
    import importlib

    from spmd.launch.forkserver.kept import changed, snapshot

    write(tmp_path, "X = 1\n", name="snapmod_a.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "snapmod_a", raising=False)
    importlib.import_module("snapmod_a")
    snap = snapshot()
    assert changed(snap) is None
    assert str(tmp_path / "snapmod_a.py") in snap and any(f.endswith("spmd/launch/forkserver/kept.py") for f in snap)
    (tmp_path / "snapmod_a.py").write_text("X = 22\n")
    assert changed(snap) == f"{tmp_path / 'snapmod_a.py'} changed"
    (tmp_path / "snapmod_a.py").unlink()
    assert changed(snap) == f"{tmp_path / 'snapmod_a.py'} is gone"
    sys.modules.pop("snapmod_a", None)


@pytest.mark.unit
def test_a_watching_server_tells_a_shut_down_writing_side_from_a_closed_peer():
    from spmd.launch.forkserver.protocol import hung_up

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    assert not hung_up(ours, 0)
    theirs.shutdown(socket.SHUT_WR)
    assert not hung_up(ours, 0.01)
    theirs.close()
    assert hung_up(ours, 0)
    ours.close()


@pytest.mark.unit
def test_the_cli_passes_preload_keep_and_its_variable_needs_preload(tmp_path, monkeypatch):
    from spmd.cli import main as cli
    from spmd.errors import LaunchError
    from spmd.launch.supervise import launch

    with pytest.raises(LaunchError, match="preload_keep keeps a fork server of preloaded modules"):
        launch(["x.py"], 2, preload_keep=5)
    with pytest.raises(LaunchError, match="preload_keep must be a number of seconds >= 0"):
        launch(["x.py"], 2, preload=["torch"], preload_keep=-1)
    calls = []
    monkeypatch.setattr("spmd.cli.run.launch_with_restarts", lambda argv, n, **kw: calls.append(kw) or 0)
    script = write(tmp_path, "pass")
    res = CliRunner().invoke(cli, ["run", "-n", "2", "--preload", "torch", "--preload-keep", "60", str(script)])
    assert res.exit_code == 0 and calls[-1]["preload_keep"] == 60, res.output
    res = CliRunner().invoke(cli, ["run", "-n", "2", "--preload", "torch", str(script)],
                             env={"SPMD_PRELOAD_KEEP": "30"})
    assert res.exit_code == 0 and calls[-1]["preload_keep"] == 30, res.output
    res = CliRunner().invoke(cli, ["run", "-n", "2", str(script)], env={"SPMD_PRELOAD_KEEP": "30"})
    assert res.exit_code == 0 and calls[-1]["preload_keep"] == 0 and calls[-1]["preload"] is None, res.output
    res = CliRunner().invoke(cli, ["run", "-n", "2", "--preload", "torch", str(script)],
                             env={"SPMD_PRELOAD_KEEP": None})
    assert res.exit_code == 0 and calls[-1]["preload_keep"] == 0, res.output
    res = CliRunner().invoke(cli, ["run", "-n", "2", "--preload-keep", "60", str(script)])
    assert res.exit_code == 2 and "give --preload MODULES too" in res.output, res.output
