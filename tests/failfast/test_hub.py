"""The fail-fast hub against strangers: only ranks that present the job's secret count.

The unit tests run a Hub for rank 0 in this process, with a share that keeps the value
and an exit_now that records instead of exiting; the launcher tests fuzz a real job's hub
from outside (docs/reliability.md, "The hub's threat model").
"""

import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time

import pytest

from tests.support import MPIRUN, PY, clean_env, start
from spmd.failfast.hub import MAX_PENDING, PEER_EXIT, hub_share, open_hub
from spmd.util.authserver import HELLO_WITHIN

SIZE = 3  # rank 0 in this process, ranks 1 and 2 played by sockets


# -- the fuzz, shared by the unit and the launcher tests -------------------------

def _connect(address):
    return socket.create_connection(address, timeout=5)


def _send(address, data, hold):
    """Connect, send data (as much as the hub takes), keep the socket in hold."""
    sock = _connect(address)
    hold.append(sock)
    try:
        sock.sendall(data)
    except OSError:  # the hub closed it: what it should do with most of these
        pass


GARBAGE_GREETINGS = [
    b"HELLO x\n", b"HELLO\n", b"HELLO 1\n", b"HELLO 99 s\n", b"HELLO -1 s\n", b"HELLO 0 s\n",
    b"HELLO 1 s extra words\n", b"HELLO 1 s bad/host\n", b"HELLO  1 s\n", b"HELLO \xff\xfe \x00\n", b"hello 1 s\n",
    b"\n", b"BYE\n",
]


def fuzz(address, connections=500):
    """Throw at address what a port scan or a hostile neighbour could; return the seconds it took."""
    began = time.monotonic()
    hold = []
    rng = secrets.SystemRandom()
    try:
        for _ in range(8):  # random bytes, newlines among them
            _send(address, os.urandom(rng.randrange(1, 8192)), hold)
        for half in (b"HELLO 1", b"FAI", b"HELLO 1 " + b"0" * 31, b"AB"):  # half lines, left open
            _send(address, half, hold)
        _send(address, b"x" * (1 << 20) + b"\n", hold)  # a 1 MiB line
        _send(address, b"HELLO 1 " + b"y" * (1 << 20) + b"\n", hold)  # a 1 MiB greeting
        for _ in range(3):  # wrong secrets, then what only a rank may say
            _send(address, f"HELLO 1 {secrets.token_hex(16)}\nFAIL\n".encode(), hold)
        _send(address, b"FAIL\n", hold)  # FAIL without the secret
        _send(address, b"FAIL\nFAIL\nBYE\n", hold)
        for greeting in GARBAGE_GREETINGS:
            _send(address, greeting + b"FAIL\n", hold)
        for _ in range(connections):  # opened and held, silent
            hold.append(_connect(address))
        return time.monotonic() - began
    finally:
        for sock in hold:
            sock.close()


# -- in-process: rank 0's Hub, a fake share and a fake exit --------------------------

@pytest.fixture
def hub(exits):
    shared = []

    def share(value):
        shared.append(value)
        return value

    hub = open_hub(0, SIZE, share, True, 5)
    hub.shared = shared
    yield hub
    hub.close()
    assert not hub._thread.is_alive()


def secret_of(hub):
    return hub.shared[0].split(" ")[1]


def rank_socket(hub, rank):
    """Connect as rank would, with the job's secret."""
    sock = _connect(hub.address)
    sock.sendall(f"HELLO {rank} {secret_of(hub)}\n".encode())
    return sock


def wait_for(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def closed_within(sock, seconds):
    """Tell whether the other end closes sock within seconds (reading and discarding what comes)."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.recv(4096):
                return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError:  # reset: closed too
        return True
    return False


def assert_a_rank_still_ends_the_job(hub, exits, rank=1):
    """An authenticated rank is met, nothing has ended the job yet, and its FAIL does."""
    sock = rank_socket(hub, rank)
    assert wait_for(lambda: rank in hub._met)
    time.sleep(0.1)
    assert exits.empty()
    sock.sendall(b"FAIL\n")
    assert_abort(hub, exits, sock)


def assert_abort(hub, exits, sock, died=None):
    """The hub ended the job: exit_now called once, and the rank on sock told ABORT."""
    code, message = exits.get(timeout=5)
    assert code == PEER_EXIT
    if died is None:
        assert message is None
    else:
        assert f"rank {died} of {SIZE} died without reporting an error" in message
    if sock is not None:
        sock.settimeout(5)
        assert sock.recv(64) == b"ABORT\n"
    assert exits.empty()


@pytest.mark.unit
def test_the_hub_listens_on_loopback_only_when_every_rank_is_local(hub):
    assert hub.address[0] == "127.0.0.1"
    assert hub._server.getsockname()[0] == "127.0.0.1"
    assert re.fullmatch(r"127\.0\.0\.1:(\d+) [0-9a-f]{32}", hub.shared[0])
    assert int(hub.shared[0].split(":")[1].split()[0]) == hub.address[1]


@pytest.mark.unit
def test_the_hub_shares_its_secret_through_the_job_store_but_never_through_torchruns():
    """spmd's job store serves only the job's ranks: the secret goes there; torchrun's serves anyone who
    reaches it (tests/cluster/test_outsiders.py read it from another host): the secret goes over the group."""
    import torch.distributed as dist

    class JobStoreLike(dict):
        address = ("198.18.0.11", 4000)

        def set(self, key, value):
            self[key] = value.encode()

    own = JobStoreLike()
    share, host = hub_share(own, 0, None, "10.0.0.1")
    assert (share("198.18.0.11:5000 s3cret"), host, own) == (
        "198.18.0.11:5000 s3cret", "198.18.0.11", {"spmd/hub": b"198.18.0.11:5000 s3cret"})
    theirs, sent = dist.PrefixStore("spmd/0", dist.HashStore()), []
    share, host = hub_share(theirs, 0, lambda value: sent.append(value) or value, "10.0.0.1")
    assert (share("10.0.0.1:5000 s3cret"), host, sent) == ("10.0.0.1:5000 s3cret", "10.0.0.1", ["10.0.0.1:5000 s3cret"])
    assert theirs.num_keys() == 0


def _outward_address():
    """This host's address toward the network, or None (no route: no interface but loopback)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # UDP: sends nothing
        addr = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if addr.startswith("127.") else addr


@pytest.mark.unit
@pytest.mark.parametrize("name, bound", [
    ("outward", "outward"),  # the host name resolves to an address of this host: bound, advertised
    ("localhost", "0.0.0.0"),  # resolves to loopback only (Debian's 127.0.1.1): every interface
    ("203.0.113.7", "0.0.0.0"),  # not an address of this host, cannot be bound: every interface
])
def test_across_nodes_the_hub_binds_the_address_it_advertises(exits, monkeypatch, name, bound):
    outward = _outward_address()
    if "outward" in (name, bound) and outward is None:
        pytest.skip("this host has no address but loopback")
    name = outward if name == "outward" else name
    bound = outward if bound == "outward" else bound
    monkeypatch.setattr(socket, "gethostname", lambda: name)
    shared = []
    hub = open_hub(0, 2, lambda v: shared.append(v) or v, False, 5)
    try:
        assert hub._server.getsockname()[0] == bound
        assert hub.address[0] == name
        assert shared[0].startswith(f"{name}:{hub.address[1]} ")
    finally:
        hub.close()


@pytest.mark.unit
def test_a_silent_connection_is_closed_after_hello_within_and_a_fail_without_the_secret_does_nothing(hub, exits):
    silent = _connect(hub.address)
    began = time.monotonic()
    assert closed_within(silent, HELLO_WITHIN + 5.0)
    assert HELLO_WITHIN - 0.1 < time.monotonic() - began < HELLO_WITHIN + 2.0  # on a loaded machine
    failing = _connect(hub.address)
    failing.sendall(b"FAIL\n")
    assert closed_within(failing, 5.0)
    assert_a_rank_still_ends_the_job(hub, exits)


@pytest.mark.unit
@pytest.mark.parametrize("greeting", GARBAGE_GREETINGS, ids=repr)
def test_a_garbage_greeting_closes_that_connection_and_the_hub_lives_on(hub, exits, greeting):
    junk = _connect(hub.address)
    junk.sendall(greeting + b"FAIL\n")
    assert closed_within(junk, 5.0)
    assert hub._noted == {"hello"}  # closed for what it said, not for its silence
    assert hub._thread.is_alive() and exits.empty()
    rank = rank_socket(hub, 2)
    rank.sendall(b"FAIL\n")
    assert_abort(hub, exits, rank)


@pytest.mark.unit
def test_a_wrong_secret_closes_the_connection_and_is_reported_once(hub, exits, capsys):
    for _ in range(3):
        wrong = _connect(hub.address)
        wrong.sendall(f"HELLO 1 {secrets.token_hex(16)}\nFAIL\n".encode())
        assert closed_within(wrong, 5.0)
    assert hub._noted == {"secret"}
    err = capsys.readouterr().err
    assert err.count("wrong secret") == 1, err
    assert exits.empty()


@pytest.mark.unit
def test_unknown_words_from_a_rank_are_ignored_and_reported_once(hub, exits, capsys):
    rank = rank_socket(hub, 1)
    rank.sendall(b"FAILED\nfail\nFAIL \nABORT\nHELLO 1 x\n")
    assert wait_for(lambda: "ignored a message from rank 1" in capsys.readouterr().err)
    assert exits.empty() and not closed_within(rank, 0.2)
    rank.sendall(b"FAIL\n")
    assert_abort(hub, exits, rank)


@pytest.mark.unit
@pytest.mark.parametrize("ending", ["FAIL", "death"])
@pytest.mark.timeout(60)
def test_after_the_fuzz_a_rank_that_fails_or_dies_still_ends_the_job(hub, exits, ending):
    first = rank_socket(hub, 1)  # connected before the fuzz, the usual order
    seconds = fuzz(hub.address)
    assert seconds < 20, seconds
    second = rank_socket(hub, 2)  # and one connected after it
    assert wait_for(lambda: hub._met == {1, 2})
    assert hub._thread.is_alive() and exits.empty()
    if ending == "FAIL":
        first.sendall(b"FAIL\n")
        assert_abort(hub, exits, second)
    else:
        second.close()  # as the kernel does for a SIGKILLed rank
        assert_abort(hub, exits, first, died=2)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_500_held_connections_leave_the_ranks_served(hub, exits):
    held = [_connect(hub.address) for _ in range(500)]
    try:
        rank = rank_socket(hub, 1)
        assert wait_for(lambda: 1 in hub._met)
        assert len(hub._pending) <= MAX_PENDING
        assert len(hub._pending) + len(hub._members) <= MAX_PENDING + SIZE - 1  # the hub's file descriptors stay bounded
        rank.sendall(b"FAIL\n")
        assert_abort(hub, exits, rank)
    finally:
        for sock in held:
            sock.close()


@pytest.mark.unit
def test_only_ranks_are_told_abort_and_a_stranger_closing_is_no_death(hub, exits):
    stranger = _connect(hub.address)
    stranger.sendall(b"HELLO 1")  # half a greeting: pending
    quitter = _connect(hub.address)
    quitter.close()
    assert_a_rank_still_ends_the_job(hub, exits)
    stranger.settimeout(HELLO_WITHIN + 5)
    assert stranger.recv(64) == b""  # closed at its deadline, never told ABORT


@pytest.mark.unit
def test_close_says_bye_to_the_ranks_only(exits):
    shared = []
    hub = open_hub(0, 2, lambda v: shared.append(v) or v, True, 5)
    stranger = _connect(hub.address)
    rank = _connect(hub.address)
    rank.sendall(f"HELLO 1 {shared[0].split()[1]}\n".encode())
    hub.close()
    assert not hub._thread.is_alive()
    rank.settimeout(2)
    assert rank.recv(64) == b"BYE\n"
    stranger.settimeout(2)
    assert stranger.recv(64) == b""
    assert exits.empty()


@pytest.mark.unit
def test_ranks_hub_meets_rank_0_and_both_close_quietly(hub, exits):
    ranks = [open_hub(r, SIZE, lambda _: hub.shared[0], True, 5) for r in (1, 2)]
    assert wait_for(lambda: hub._met == {1, 2})
    for r in ranks:
        r.close()
    time.sleep(0.2)
    assert exits.empty()


# -- the rank's side: only exact lines ABORT and BYE from its own connection -----------

@pytest.fixture
def fake_hub():
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


def _rank_of(fake_hub):
    port = fake_hub.getsockname()[1]
    rank = open_hub(1, 2, lambda _: f"127.0.0.1:{port} {'s' * 32}", True, 5)
    conn, _ = fake_hub.accept()
    conn.settimeout(5)
    assert conn.recv(64) == b"HELLO 1 " + b"s" * 32 + b"\n"
    return rank, conn


@pytest.mark.unit
def test_a_rank_acts_only_on_an_exact_abort(fake_hub, exits):
    rank, conn = _rank_of(fake_hub)
    conn.sendall(b"ABORTED\nxABORT\nABORT \nBYE BYE\nNOBYE\n" + os.urandom(2048).replace(b"\n", b"") + b"\n")
    conn.sendall(b"z" * 100_000)  # a line without end, longer than any rank 0 says
    time.sleep(0.2)
    assert rank._thread.is_alive() and exits.empty()
    conn.sendall(b"\nAB")
    conn.sendall(b"ORT\n")  # split across reads
    assert exits.get(timeout=5) == (PEER_EXIT, None)
    rank._closing = True
    conn.close()


@pytest.mark.unit
def test_a_rank_leaves_quietly_on_bye(fake_hub, exits):
    rank, conn = _rank_of(fake_hub)
    conn.sendall(b"BYE\n")
    rank._thread.join(timeout=5)
    assert not rank._thread.is_alive()
    conn.close()
    rank.close()
    assert exits.empty()


@pytest.mark.unit
@pytest.mark.parametrize("hub_host, name, said", [
    ("", "h2", "lost rank 0 (it died)"),  # rank 0's host not known
    (" h2", "h2", "lost rank 0 (it died)"),  # the same host: its host is no news
    (" h1", "h2", "lost rank 0 on h1 (it died, or its host did)"),
])
def test_a_rank_whose_rank_0_vanishes_ends_naming_rank_0s_host_when_it_is_another(fake_hub, exits, hub_host,
                                                                                   name, said):
    port = fake_hub.getsockname()[1]
    open_hub(1, 2, lambda _: f"127.0.0.1:{port} {'s' * 32}{hub_host}", True, 5, name=name)
    conn, _ = fake_hub.accept()
    conn.close()  # rank 0 gone without BYE
    assert exits.get(timeout=5) == (PEER_EXIT, f"### spmd: rank 1: {said}; ending")


# -- a real job under mpirun, fuzzed from outside --------------------------------------

JOB = """
import os, sys, time
import numpy
import spmd
from spmd import comm
from spmd.runtime import start as runtime

comm.barrier()
hub = next(g for g in runtime._guards if isinstance(g, spmd.failfast.hub.Hub))
if comm.rank == 0:
    print(f"HUB {hub.address[0]} {hub.address[1]}", flush=True)
print(f"PID {comm.rank} {os.getpid()}", flush=True)
go = sys.argv[1]
while not os.path.exists(go):  # the test fuzzes the hub meanwhile
    time.sleep(0.05)
total = comm.all_reduce(numpy.array([comm.rank + 1]))
print(f"DONE {comm.rank} {int(total[0])}", flush=True)
"""


class _Reader:
    """Collect a process's output on a thread, so that the test can wait for a line."""

    def __init__(self, proc):
        self.proc, self.text = proc, ""
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self):
        for line in self.proc.stdout:
            self.text += line

    def wait_for(self, pattern, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = re.findall(pattern, self.text)
            if found:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        pytest.fail(f"no {pattern!r} within {seconds} s; output:\n{self.text[-4000:]}")

    def finish(self, seconds):
        """Wait for the process (killing its group past seconds) and return all it wrote.

        Only this reader's thread reads the pipe: communicate() beside it would
        split the output between the two readers and could tear a line.
        """
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            self._thread.join(timeout=5)
            pytest.fail(f"the job did not end within {seconds} s; output:\n{self.text[-4000:]}")
        self._thread.join(timeout=5)
        return self.text


def _start_job(tmp_path, *mpirun_flags):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    go = tmp_path / "go"
    proc = start([MPIRUN, *mpirun_flags, "-n", 2, PY, job, go], clean_env(SPMD_BACKEND="mpi"))
    reader = _Reader(proc)
    host, port = reader.wait_for(r"HUB (\S+) (\d+)", 60)[0]
    pids = dict(reader.wait_for(r"PID (\d) (\d+)", 30))
    while len(pids) < 2:
        time.sleep(0.05)
        pids = dict(reader.wait_for(r"PID (\d) (\d+)", 30))
    return proc, reader, (host, int(port)), pids, go


@pytest.mark.launcher
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: pip install mpich")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["normal", "SIGKILL"])
def test_a_fuzzed_job_still_finishes_and_still_fails_fast(tmp_path, ending):
    # MPICH's Hydra kills the other ranks itself when one is killed: without its
    # cleanup, only the hub can end rank 0 (which waits for the go file for ever).
    flags = ["-disable-auto-cleanup"] if ending == "SIGKILL" else []
    proc, reader, address, pids, go = _start_job(tmp_path, *flags)
    assert address[0] == "127.0.0.1"
    seconds = fuzz(address)
    print(f"fuzz against the job's hub: {seconds:.2f} s")
    if ending == "normal":
        go.touch()
        out = reader.finish(60)
        assert proc.returncode == 0, out[-4000:]
        assert sorted(re.findall(r"DONE (\d) (\d+)", out)) == [("0", "3"), ("1", "3")], out[-4000:]
        return
    began = time.monotonic()
    os.kill(int(pids["1"]), signal.SIGKILL)
    out = reader.finish(30)
    took = time.monotonic() - began
    print(f"SIGKILL to the job's end: {took:.2f} s")
    assert proc.returncode != 0, out[-4000:]
    assert took < 10, out[-4000:]
    assert "DONE" not in out
    # Rank 0's "rank 1 of 2 died without reporting an error" is usually in out, but
    # Hydra drops output it has not forwarded when the job ends (docs/reliability.md).



@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_rank_that_said_fail_is_not_ended_by_the_abort_it_caused(hub, exits):
    """Its own exit status must win (a raise under spmd run once came out as 75, the ABORT's, in a soak)."""
    from spmd.failfast.hub import HubClient

    failing = HubClient(1, SIZE, lambda value: hub.shared[0], True, 5)
    other = HubClient(2, SIZE, lambda value: hub.shared[0], True, 5)
    failing.fail()
    ended = [exits.get(timeout=10), exits.get(timeout=10)]  # rank 0 (this process's hub) and rank 2
    assert [code for code, _ in ended] == [PEER_EXIT, PEER_EXIT]
    time.sleep(1.0)
    assert exits.empty(), "the failing rank was ended by the ABORT it caused"
    for client in (failing, other):
        client._closing = True


@pytest.mark.unit
def test_a_rank_that_greets_after_the_job_was_ended_hears_abort(hub, exits):
    """A rank whose greeting is read after another's FAIL was told to every rank then must be told too
    (it came out as a lost ABORT under load: the hub told only the ranks it had met)."""
    from spmd.failfast.hub import HubClient

    failing = HubClient(1, SIZE, lambda value: hub.shared[0], True, 5)
    failing.fail()
    assert exits.get(timeout=10)[0] == PEER_EXIT  # rank 0, this process's hub
    late = HubClient(2, SIZE, lambda value: hub.shared[0], True, 5)
    assert exits.get(timeout=10)[0] == PEER_EXIT  # the late rank 2
    for client in (failing, late):
        client._closing = True
