"""Errors keep their meaning: what comes out of a public call when something fails inside it.

An SpmdError raised inside a call goes on as it is, whatever its text
says; only a backend's own timeout becomes a CollectiveTimeout; any other
backend RuntimeError becomes PeerLostError or CommunicationError with the
original chained; an async handle's wait() is bounded and converted like
the call.  In one process, on every backend that runs there (as
tests/comms/test_conformance.py builds them).
"""

import io
import time

import numpy as np
import pytest
from tests.support import IN_PROCESS_BACKENDS, open_comm

import spmd
from spmd.errors import CollectiveError, CollectiveTimeout, CommunicationError, PeerLostError
from spmd.failfast.calls import Call, Monitor, named

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch")

BACKENDS = IN_PROCESS_BACKENDS
TORCH_BACKENDS = {"gloo", "torch"}  # those whose backend has a timeout of its own

#: What torch 2.13's gloo raises (plain RuntimeErrors), as a 2-rank job printed them.
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                "Timed out waiting 6000ms for recv operation to complete")
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
               "by peer [127.0.0.1]:10937. This is typically caused by a remote worker crashing.")
#: A script path with the word in it: the text of an error is no evidence of what it is.
SCRIPT = "/home/u/timeout_study/train.py"


def _open(backend, debug=False):
    return open_comm(backend, Monitor(debug=debug))


@pytest.fixture(params=BACKENDS)
def backend(request, gloo_group):
    return request.param


def _failing(comm, exc):
    """Make every broadcast of comm raise exc inside its hook (direct or general)."""

    def hook(*args):
        raise exc

    comm._backend.direct_broadcast = lambda x, root: (hook, ())
    comm._backend.broadcast = hook


def test_a_debug_mismatch_from_a_script_whose_path_says_timeout_stays_a_collective_error(backend):
    comm = _open(backend, debug=True)
    real = comm._backend.all_gather_object

    def gathered(call):  # a second rank that called all_reduce from SCRIPT
        return real(call) + [Call(call.seq, "all_reduce", None, "sum", "float64", (3,), f"{SCRIPT}:12")]

    comm._backend.all_gather_object = gathered
    with pytest.raises(CollectiveError) as info:
        comm.broadcast(np.ones(3))
    assert type(info.value) is CollectiveError
    assert "collective mismatch at call #1" in str(info.value) and SCRIPT in str(info.value)
    assert "timed out" not in str(info.value)


@pytest.mark.parametrize("path", ["direct", "general"])
def test_an_spmd_error_raised_inside_a_hook_goes_on_as_it_is(backend, path):
    comm = _open(backend, debug=path == "general")
    for exc in (CollectiveError(f"bad value read from {SCRIPT}: timeout"), CollectiveTimeout("timed out in p2p")):
        _failing(comm, exc)
        with pytest.raises(type(exc)) as info:
            comm.broadcast(np.ones(3))
        assert info.value is exc and info.value.__cause__ is None
    assert comm._mon.busy == 0


@pytest.mark.parametrize("path", ["direct", "general"])
def test_a_backend_error_that_is_no_timeout_becomes_an_spmd_error_with_the_original_chained(backend, path):
    comm = _open(backend, debug=path == "general")
    original = RuntimeError(GLOO_CLOSED)
    _failing(comm, original)
    with pytest.raises(PeerLostError) as info:
        comm.broadcast(np.ones(3))
    err = info.value
    assert isinstance(err, CommunicationError) and isinstance(err, ConnectionError)
    assert err.__cause__ is original
    assert f"rank 0: broadcast (call #1) failed ({backend if backend != 'torch' else 'gloo'}: " in str(err)
    assert "Connection closed by peer" in str(err) and spmd.errors.is_peer_lost(err)
    other = RuntimeError(f"unexpected state in {SCRIPT} (a timeout?)")  # says timeout, is none
    _failing(comm, other)
    with pytest.raises(CommunicationError) as info:
        comm.broadcast(np.ones(3))
    assert type(info.value) is CommunicationError and info.value.__cause__ is other
    assert "broadcast (call #2) failed" in str(info.value)


@pytest.mark.parametrize("path", ["direct", "general"])
def test_an_error_that_is_no_runtime_error_goes_on_as_it_is(backend, path):
    comm = _open(backend, debug=path == "general")
    for exc in (TypeError(f"a bug in a hook ({SCRIPT})"), KeyboardInterrupt()):
        _failing(comm, exc)
        with pytest.raises(type(exc)) as info:
            comm.broadcast(np.ones(3))
        assert info.value is exc and info.value.__cause__ is None
    assert comm._mon.busy == 0


def test_a_lost_peer_is_what_the_backend_says_it_is(backend):
    comm = _open(backend)
    said = []

    def lost(exc):
        said.append(exc)
        return "gone" in str(exc)

    comm._backend.is_peer_lost = lost
    for text, expected in (("peer gone", PeerLostError), (GLOO_CLOSED + " (words it does not count)", CommunicationError)):
        exc = RuntimeError(text)
        _failing(comm, exc)
        with pytest.raises(CommunicationError) as info:
            comm.broadcast(np.ones(3))
        assert type(info.value) is expected and info.value.__cause__ is exc and said[-1] is exc


def test_only_the_backends_own_timeout_is_a_collective_timeout(backend):
    import torch.distributed as dist

    comm = _open(backend)
    for exc in (RuntimeError(GLOO_TIMEOUT), RuntimeError("Application timeout caused pair closure"),
                dist.DistStoreError("wait timeout after 6000ms, keys: /spmd/x")):
        _failing(comm, exc)
        expected = CollectiveTimeout if backend in TORCH_BACKENDS else CommunicationError
        with pytest.raises(expected) as info:
            comm.broadcast(np.ones(3))
        assert info.value.__cause__ is exc
        if expected is CollectiveTimeout:
            assert "broadcast (call #" in str(info.value) and "timed out after 60 s waiting" in str(info.value)


def _pending(comm, kind):
    """An async call's handle still pending (an irecv, or an all_reduce where the backend gives one)."""
    if kind == "irecv" or comm.backend == "serial":
        return comm.irecv(0, tag=7), "recv from rank 0 (tag 7)"
    return comm.all_reduce(np.ones(3), async_op=True), "all_reduce"


@pytest.mark.parametrize("kind", ["all_reduce", "irecv"])
def test_an_async_handles_wait_is_the_calls_wait_and_converts_errors(backend, kind):
    comm = _open(backend)
    mon = comm._mon
    handle, name = _pending(comm, kind)
    seq = mon.seq
    assert handle._owner is comm and not handle._done
    seen, real = [], (handle._wait, handle._test)

    def timing_out():
        seen.append((mon.busy, mon.waiting))
        raise RuntimeError(GLOO_TIMEOUT)

    handle._wait = timing_out
    expected = CollectiveTimeout if backend in TORCH_BACKENDS else CommunicationError
    with pytest.raises(expected) as info:
        handle.wait()
    assert seen == [(seq, mon.find(seq))]  # the mpi watcher counts the wait as the call's
    assert (mon.busy, mon.waiting) == (0, None)
    text = str(info.value)
    assert f"{name} (call #{seq}) " in text and "in wait() of its async handle" in text, text
    assert isinstance(info.value.__cause__, RuntimeError)

    handle._wait = lambda: (_ for _ in ()).throw(RuntimeError(GLOO_CLOSED))
    with pytest.raises(PeerLostError, match=rf"\(call #{seq}\) failed in wait\(\) of its async handle"):
        handle.wait()
    mismatch = CollectiveError(f"out does not fit ({SCRIPT})")
    handle._wait = lambda: (_ for _ in ()).throw(mismatch)
    with pytest.raises(CollectiveError) as info:
        handle.wait()
    assert info.value is mismatch

    handle._test = lambda: (_ for _ in ()).throw(RuntimeError(GLOO_CLOSED))
    with pytest.raises(PeerLostError):
        handle.is_completed()
    assert (mon.busy, mon.waiting) == (0, None)
    handle._wait, handle._test = real  # let the real work end (MPI would keep its request)
    if kind == "irecv" or comm.backend == "serial":
        comm.send(np.ones(1), 0, tag=7)
    handle.wait()


def test_a_completed_async_call_still_gives_its_result(backend):
    comm = _open(backend)
    x = np.ones(3)
    handle = comm.all_reduce(x, async_op=True)
    assert handle.wait() is x and handle.is_completed()
    got = comm.irecv(0, tag=2)
    comm.send(np.arange(2.0), 0, tag=2)
    assert np.array_equal(got.wait(), np.arange(2.0)) and got.source == 0 and got.tag == 2
    assert (comm._mon.busy, comm._mon.waiting) == (0, None)


def test_the_mpi_watcher_names_an_async_calls_wait(monkeypatch):
    from spmd.failfast import mpi_timeout as watchdog

    class Comm:  # what MpiTimeout reads
        rank, size, timeout = 0, 2, 0.2

    ended, err = [], io.StringIO()
    monkeypatch.setattr(watchdog, "abort_job", lambda code, after=None: ended.append(code))
    monkeypatch.setattr("sys.stderr", err)
    mon = Monitor()
    for _ in range(20):  # call #12 is long out of the ring of the last eight
        call = named(mon.note("all_reduce", np.ones(3), None, "sum") if mon.seq == 11 else mon.note("barrier"))
        if call.seq == 12:
            waited = call
    mon.waiting, mon.busy = waited, waited.seq
    watcher = watchdog.MpiTimeout(Comm(), [mon])
    try:
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        watcher.close()
    assert ended and ended[0] == 1
    assert ("rank 0 of 2: all_reduce (call #12) timed out after 0.2 s in wait() of its async handle, "
            "waiting for the other ranks") in err.getvalue()
