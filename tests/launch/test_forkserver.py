"""spmd run --preload: ranks forked from one process that imported torch behave as spawned ones.

Each launcher test runs the same script with and without --preload and
compares what the launcher and the ranks say (output, prefixes, exit
status, messages); the script's first line records whether torch was
already imported, which only a fork server can have done.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from click.testing import CliRunner

from tests.support import PROMISE, clean_env, since_promise, tool

SPMD = tool("spmd")
PRELOAD = ["--preload", "torch"]


def write(tmp_path, body, name="script.py"):
    """Write a script into tmp_path; return its path. A line PROMISE becomes tests.support.PROMISE."""
    path = tmp_path / name
    path.write_text(re.sub(r"(?m)^(\s*)PROMISE$", lambda m: m.group(1) + PROMISE, textwrap.dedent(body)))
    return path


def spmd_run(*args, timeout=60, env=None, stdin=""):
    """Run `spmd run *args` to its end in a session of its own; return (code, stdout, stderr, seconds):
    seconds from the job's first promise line (tests.support.PROMISE) to the end, None without one."""
    proc = subprocess.Popen([SPMD, "run", *map(str, args)], env=env or clean_env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"spmd run {' '.join(map(str, args))} hung for {timeout} s:\n{out[-2000:]}\n{err[-2000:]}")
    return proc.returncode, out, err, since_promise(out + err)


def both(*args, **kw):
    """Run `spmd run --preload torch *args` and `spmd run *args`; return (preloaded, plain)."""
    return spmd_run(*PRELOAD, *args, **kw), spmd_run(*args, **kw)


def masked(err):
    """The lines of err with pids masked."""
    return [re.sub(r"pid \d+", "pid N", line) for line in err.splitlines()]


def launcher_lines(err):
    """The launcher's own lines, and the ranks' spmd reports, with pids masked."""
    return sorted(line for line in masked(err) if line.startswith("spmd run:") or "### spmd:" in line)


def alive(pid):
    """Tell whether pid is a live process (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_dead(pids, seconds=10.0):
    """Return the pids still alive after up to seconds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


# What a rank sees of itself; every line but PRELOADED must be the same with and without preload.
SAME = """
    import sys
    PRELOADED = [m for m in ("torch", "numpy.random") if m in sys.modules]  # before any import of ours
    import os, random, socket, stat
    import numpy as np
    import torch
    from spmd import comm

    def listening():
        n = 0
        for fd in sorted(map(int, os.listdir("/proc/self/fd"))):
            try:
                if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                with socket.socket(fileno=os.dup(fd)) as s:
                    n += s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            except OSError:
                pass
        return n

    print("listening before init", listening(), "fd" if "SPMD_LISTEN_FD" in os.environ else "no fd")
    for key, value in sorted(os.environ.items()):
        if key not in ("MASTER_PORT", "SPMD_SECRET"):  # this launch's own
            print(f"env {key}={value}")
    print("secret", len(os.environ["SPMD_SECRET"]), "characters")
    print("argv", sys.argv[1:], "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)),
          "name", __name__, "cwd", os.getcwd())
    print("own session", os.getsid(0) == os.getpid(), "own group", os.getpgid(0) == os.getpid())
    print("stdin", repr(sys.stdin.read()))
    r, n = comm.rank, comm.size
    x = torch.arange(4, dtype=torch.float64) + r
    comm.all_reduce(x)
    y = torch.full((3,), float(r))
    comm.broadcast(y, root=n - 1)
    print("all_reduce", x.tolist(), "broadcast", y.tolist(), "backend", comm.backend)
    print("all_gather", [t.tolist() for t in comm.all_gather(torch.tensor([10.0 * r]))])
    m = torch.ones(300, 300) @ torch.ones(300, 300)
    print("matmul", m[0, 0].item(), "threads", torch.get_num_threads() >= 1,
          "numpy", float((np.ones((200, 200)) @ np.ones((200, 200)))[0, 0]))
    draws = comm.all_gather_object((random.random(), float(np.random.random()), torch.rand(1).item()))
    print("draws differ between ranks", [len({d[i] for d in draws}) == n for i in range(3)])
    print("PRELOADED", PRELOADED, file=sys.stderr)
"""


@pytest.mark.launcher
@pytest.mark.timeout(150)
def test_gloo_collectives_environment_and_output_match_a_launch_without_preload(tmp_path):
    script = write(tmp_path, SAME)
    args = ["-n", 3, "--backend", "gloo", script, "a", "b c"]
    fast = spmd_run("--preload", "torch,numpy.random", *args, stdin="typed\n")
    slow = spmd_run(*args, stdin="typed\n")
    for code, out, err, _ in (fast, slow):
        assert code == 0, out[-2000:] + err[-3000:]
        assert all(re.match(r"\[\d\] ", line) for line in out.splitlines() + err.splitlines()), out + err
    assert sorted(fast[1].splitlines()) == sorted(slow[1].splitlines())
    lines = fast[1].splitlines()
    assert sum(line.endswith("listening before init 1 fd") for line in lines) == 1, lines
    assert "[0] listening before init 1 fd" in lines
    assert lines.count("[0] stdin 'typed\\n'") == 1 and lines.count("[1] stdin ''") == 1
    assert "[2] all_reduce [3.0, 6.0, 9.0, 12.0] broadcast [2.0, 2.0, 2.0] backend gloo" in lines
    assert "[1] argv ['a', 'b c'] path0 True name __main__ cwd " + str(os.getcwd()) in lines
    assert lines.count("[1] own session True own group True") == 1
    assert "[0] draws differ between ranks [True, True, True]" in lines
    assert sorted(fast[2].splitlines()) == [f"[{r}] PRELOADED ['torch', 'numpy.random']" for r in range(3)]
    assert sorted(slow[2].splitlines()) == [f"[{r}] PRELOADED []" for r in range(3)]


@pytest.mark.launcher
@pytest.mark.timeout(150)
def test_a_module_runs_with_minus_m_and_output_passes_through_unprefixed(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write(pkg, """
        import os, sys
        print("main", __name__, sys.argv[1:], os.environ["SPMD_RANK"], "torch" in sys.modules)
    """, name="main.py")
    env = clean_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{clean_env()['PYTHONPATH']}")
    fast, slow = both("-n", 2, "--no-prefix", "-m", "pkg.main", "x", env=env)
    assert (fast[0], slow[0]) == (0, 0), fast[2] + slow[2]
    assert sorted(fast[1].splitlines()) == ["main __main__ ['x'] 0 True", "main __main__ ['x'] 1 True"]
    assert sorted(slow[1].splitlines()) == ["main __main__ ['x'] 0 False", "main __main__ ['x'] 1 False"]
    alone = spmd_run(*PRELOAD, "-n", 1, "-m", "pkg.main", env=env)
    assert (alone[0], alone[1]) == (0, "main __main__ [] 0 True\n"), alone


@pytest.mark.launcher
@pytest.mark.timeout(150)
def test_a_raising_rank_ends_the_job_promptly_with_one_traceback_and_the_same_status(tmp_path):
    script = write(tmp_path, """
        import numpy as np
        from spmd import comm
        comm.barrier()
        if comm.rank == 1:
            PROMISE
            raise ValueError("rank 1 found a bad record")
        comm.all_reduce(np.ones(10))
    """)
    fast, slow = both("-n", 3, script)
    for code, out, err, seconds in (fast, slow):
        assert code == 1, err[-3000:]
        assert err.count("ValueError: rank 1 found a bad record") == 1, err[-3000:]
        assert "spmd run: rank 1 exited with code 1" in err, err[-3000:]
        assert seconds < 30, f"{seconds:.1f} s:\n{err[-3000:]}"
    assert launcher_lines(fast[2]) == launcher_lines(slow[2])


@pytest.mark.launcher
@pytest.mark.timeout(150)
def test_a_rank_killed_inside_a_collective_is_reported_the_same(tmp_path):
    script = write(tmp_path, """
        import os, signal, time
        import numpy as np
        from spmd import comm
        comm.barrier()
        if comm.rank == 1:
            time.sleep(0.5)  # the others are in the collective
            PROMISE
            os.kill(os.getpid(), signal.SIGKILL)
        comm.all_reduce(np.ones(10))
    """)
    fast, slow = both("-n", 3, script)
    for code, out, err, seconds in (fast, slow):
        assert code == 128 + signal.SIGKILL, err[-3000:]
        assert err.count("rank 1 of 3 died without reporting an error") == 1, err[-3000:]
        assert "spmd run: rank 1 killed by signal SIGKILL" in err, err[-3000:]
        assert seconds < 30, f"{seconds:.1f} s:\n{err[-3000:]}"
    assert launcher_lines(fast[2]) == launcher_lines(slow[2])


@pytest.mark.launcher
@pytest.mark.timeout(150)
@pytest.mark.parametrize("ending, code", [("sys.exit(3)", 3), ("sys.exit('no input')", 1),
                                          ("os.kill(os.getpid(), signal.SIGSEGV)", 128 + signal.SIGSEGV)])
def test_exit_statuses_and_signals_are_reported_the_same(tmp_path, ending, code):
    script = write(tmp_path, f"""
        import os, signal, sys, time
        if os.environ["SPMD_RANK"] == "1":
            PROMISE
            {ending}
        time.sleep(60)
    """)
    fast, slow = both("-n", 3, script)
    assert fast[0] == slow[0] == code, fast[2] + slow[2]
    assert launcher_lines(fast[2]) == launcher_lines(slow[2]) != []
    assert sorted(masked(fast[2])) == sorted(masked(slow[2]))  # the rank's own words too
    assert fast[3] < 20 and slow[3] < 20


@pytest.mark.launcher
@pytest.mark.timeout(150)
def test_timeout_ends_a_stalled_collective_the_same(tmp_path):
    script = write(tmp_path, """
        import time
        import numpy as np
        from spmd import comm
        comm.barrier()
        if comm.rank == 0:
            PROMISE
            comm.all_reduce(np.ones(10))
        else:
            time.sleep(60)
    """)
    fast, slow = both("-n", 2, "--backend", "gloo", "--timeout", 2, script)
    for code, out, err, seconds in (fast, slow):
        assert code != 0, err[-3000:]
        assert err.count("all_reduce (call #2) timed out after 2 s") == 1, err[-3000:]
        assert seconds < 25, f"{seconds:.1f} s:\n{err[-3000:]}"
    assert fast[0] == slow[0]
    assert launcher_lines(fast[2])[-1:] == launcher_lines(slow[2])[-1:]


@pytest.mark.launcher
@pytest.mark.timeout(120)
@pytest.mark.parametrize("target, signum", [("launcher", signal.SIGTERM), ("launcher", signal.SIGKILL),
                                            ("server", signal.SIGKILL)])
def test_a_signalled_launcher_or_fork_server_ends_every_rank(tmp_path, target, signum):
    script = write(tmp_path, f"""
        import os, time
        path = os.path.join({str(tmp_path)!r}, os.environ["SPMD_RANK"] + ".pid")
        open(path + ".tmp", "w").write(f"{{os.getpid()}} {{os.getppid()}}")
        os.rename(path + ".tmp", path)
        time.sleep(60)
    """)
    proc = subprocess.Popen([SPMD, "run", *PRELOAD, "-n", "3", str(script)], env=clean_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.pid"))) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    found = [p.read_text().split() for p in tmp_path.glob("*.pid")]
    pids = [int(pid) for pid, _ in found]
    servers = {int(parent) for _, parent in found}
    assert len(pids) == 3 and len(servers) == 1 and proc.pid not in servers, found
    os.kill(proc.pid if target == "launcher" else next(iter(servers)), signum)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the launcher did not end within 20 s of the signal")
    assert wait_dead(pids + list(servers)) == [], "left behind"
    if target == "server":  # the ranks die with it (their death signal): the launcher says so
        assert proc.returncode == 128 + signal.SIGKILL and "killed by signal SIGKILL" in err, err
    elif signum == signal.SIGKILL:
        assert proc.returncode == -signum
    else:
        assert proc.returncode == 128 + signum and "spmd run: SIGTERM received, stopping" in err, err


# -- refusals --------------------------------------------------------------------------------

def _with_modules(tmp_path, **modules):
    """Write each module's source into tmp_path; return an environment that can import them."""
    for name, body in modules.items():
        write(tmp_path, body, name=f"{name}.py")
    return clean_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{clean_env()['PYTHONPATH']}")


@pytest.mark.launcher
@pytest.mark.timeout(120)
@pytest.mark.parametrize("modules, words", [
    ("torch,no_such_module_here", "--preload: cannot import 'no_such_module_here' "
                                  "(ModuleNotFoundError: No module named 'no_such_module_here')"),
    ("poller", "--preload: importing 'poller' started 1 thread(s) ('poller thread' (daemon)); forking a process "
               "with threads running is unsafe: remove 'poller' from --preload"),
    ("parallel", "--preload: after importing parallel, a forked child did not finish a matrix product within 5 s"),
])
def test_a_module_that_makes_fork_unsafe_is_refused_by_name(tmp_path, modules, words):
    env = _with_modules(
        tmp_path,
        poller="import threading, time\n"
               "threading.Thread(target=time.sleep, args=(60,), name='poller thread', daemon=True).start()\n",
        # a parallel region at import leaves OpenMP threads that a forked child hangs on
        parallel="import torch\n_ = torch.ones(500, 500) @ torch.ones(500, 500)\n",
    )
    env["OMP_NUM_THREADS"] = "2"  # an OpenMP pool, even on one core
    ran = tmp_path / "ran"
    script = write(tmp_path, f"open({str(ran)!r}, 'w').close()")
    code, out, err, seconds = spmd_run("--preload", modules, "-n", 2, script, env=env)
    assert code == 1 and f"Error: {words}" in err, err
    assert not ran.exists() and out == ""  # and within spmd_run's 60 s, or it fails as hung


@pytest.mark.unit
def test_cuda_mpi_and_threads_after_an_import_are_named(monkeypatch):
    import threading
    import types

    from spmd.launch.forkserver import safety

    main = [threading.main_thread()]
    monkeypatch.setattr(safety.threading, "enumerate", lambda: list(main))
    assert safety.unsafe("torch") is None or "torch" in sys.modules  # a real torch: its CUDA is not up here
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert "importing 'mylib' initialised CUDA" in safety.unsafe("mylib")
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", types.SimpleNamespace(Is_initialized=lambda: True))
    assert "importing 'mpi4py.MPI' initialised MPI" in safety.unsafe("mpi4py.MPI")
    monkeypatch.delitem(sys.modules, "mpi4py.MPI")
    assert safety.unsafe("x") is None
    main.append(types.SimpleNamespace(name="watcher", daemon=False))
    assert "importing 'x' started 1 thread(s) ('watcher')" in safety.unsafe("x")


@pytest.mark.unit
def test_module_lists_are_checked_and_the_shared_environment_leaves_out_each_ranks_own():
    from spmd.errors import LaunchError
    from spmd.launch.supervise import _shared, child_env
    from spmd.launch.forkserver.client import parse_modules

    assert parse_modules(" torch, numpy ,torch,torch.distributed") == ["torch", "numpy", "torch.distributed"]
    for bad in ("", ",", "torch,bad-name", "1x"):
        with pytest.raises(LaunchError, match="--preload"):
            parse_modules(bad)
    envs = [child_env(r, 3, port=5, listen_fd=9 if r == 0 else None, base={"HOME": "/h"}) for r in range(3)]
    shared = _shared(envs)
    assert shared["SPMD_SIZE"] == "3" and shared["HOME"] == "/h" and shared["MASTER_PORT"] == "5"
    assert not {"SPMD_RANK", "SPMD_LOCAL_RANK", "SPMD_LISTEN_FD"} & set(shared)
    assert _shared(envs[:1]).keys() == shared.keys()


@pytest.mark.unit
def test_launch_refuses_preload_with_another_runner_and_the_cli_passes_the_list(tmp_path, monkeypatch):
    from spmd.cli import main as cli
    from spmd.errors import LaunchError
    from spmd.launch.supervise import launch

    with pytest.raises(LaunchError, match="preload forks ranks that run spmd's runner"):
        launch(["x.py"], 2, runner=[], preload=["torch"])
    calls = []
    monkeypatch.setattr("spmd.cli.run.launch_with_restarts", lambda argv, n, **kw: calls.append(kw) or 0)
    script = write(tmp_path, "pass")
    res = CliRunner().invoke(cli, ["run", "-n", "2", "--preload", "torch,numpy", str(script)])
    assert res.exit_code == 0 and calls[0]["preload"] == ["torch", "numpy"], res.output
    res = CliRunner().invoke(cli, ["run", "-n", "2", "--preload", "torch,no-such", str(script)])
    assert res.exit_code == 2 and "'no-such' is not a module name" in res.output


@pytest.mark.launcher
@pytest.mark.timeout(60)
def test_a_launcher_interrupted_while_the_server_imports_stops_at_once_and_ends_it(tmp_path):
    env = _with_modules(tmp_path, slow="import os, time\n"
                                       f"open({str(tmp_path / 'server')!r}, 'w').write(str(os.getpid()))\n"
                                       "time.sleep(60)\n")
    ran = tmp_path / "ran"
    script = write(tmp_path, f"open({str(ran)!r}, 'w').close()")
    proc = subprocess.Popen([SPMD, "run", "--preload", "slow", "-n", "2", str(script)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "server").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    server = int((tmp_path / "server").read_text())
    began = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the launcher did not end within 20 s of SIGINT")
    assert proc.returncode == 128 + signal.SIGINT and "spmd run: SIGINT received, stopping" in err, err
    assert time.monotonic() - began < 5
    assert wait_dead([server]) == [] and not ran.exists()


@pytest.mark.unit
def test_a_message_carries_its_descriptors_and_a_closed_peer_reads_as_the_end():
    import socket

    from spmd.launch.forkserver.protocol import recv, send, tell

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        send(ours, {"rank": 3, "argv": ["x.py"]}, [w])
        send(ours, {"rank": 3, "pid": 7})
        message, fds = recv(theirs)
        assert message == {"rank": 3, "argv": ["x.py"]} and len(fds) == 1 and fds[0] != w
        os.write(fds[0], b"through")
        os.close(fds[0])
        assert os.read(r, 16) == b"through"
        assert recv(theirs) == ({"rank": 3, "pid": 7}, [])
        ours.close()
        assert recv(theirs) == (None, [])
        tell(theirs, {"rank": 3, "exit": 0})  # nobody to tell: no error
    finally:
        for fd in (r, w):
            os.close(fd)
        theirs.close()


@pytest.mark.unit
def test_preloaded_names_what_a_server_recorded_and_is_empty_elsewhere():
    from spmd.launch.forkserver import process

    assert process.preloaded() == ()
    try:
        process.record_preloaded(["torch", "numpy"])
        assert process.preloaded() == ("torch", "numpy")
    finally:
        process.record_preloaded(())
    assert process.preloaded() == ()
