"""spmd's own rendezvous store: torch's Store semantics, for members of the job alone."""

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from spmd.errors import RendezvousError
from spmd.runtime.jobstore import JobStore, StoreServer, bind, frames
from spmd.util.authserver import MAX_PENDING, answer, is_wildcard

pytestmark = pytest.mark.unit

SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.fixture
def served():
    srv = StoreServer(bind("127.0.0.1", 0, 16), SECRET)
    yield srv
    srv.close()


def test_it_binds_one_interface_never_a_wildcard(served):
    assert served.address[0] == "127.0.0.1"
    assert not is_wildcard(served.address[0]) and is_wildcard("0.0.0.0")
    assert is_wildcard("::")


def test_every_operation_answers_as_torchs_own_store_does(served):
    ours, theirs = JobStore(served.address, SECRET, 5), dist.HashStore()
    steps = [
        ("set", ("a", b"1")), ("get", ("a",)), ("add", ("n", 3)), ("add", ("n", -1)), ("get", ("n",)),
        ("check", (["a", "n"],)), ("check", (["a", "zz"],)), ("compare_set", ("c", "", "v")),
        ("compare_set", ("c", "x", "w")), ("compare_set", ("c", "v", "w")), ("get", ("c",)),
        ("append", ("a", b"23")), ("get", ("a",)), ("num_keys", ()), ("delete_key", ("c",)),
        ("delete_key", ("c",)), ("num_keys", ()), ("multi_set", (["m1", "m2"], [b"x", b"y"])),
        ("multi_get", (["m1", "m2"],)),
    ]
    for name, args in steps:
        assert getattr(ours, name)(*args) == getattr(theirs, name)(*args), (name, args)
    assert sorted(ours.list_keys()) == sorted(theirs.list_keys())


def test_a_get_waits_for_the_key_and_a_wait_past_the_timeout_says_which_keys(served):
    store = JobStore(served.address, SECRET, 5)
    threading.Timer(0.3, lambda: JobStore(served.address, SECRET, 5).set("late", "L")).start()
    assert store.get("late") == b"L"
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(RendezvousError, match=r"did not answer get\('never'\) within 0.3 s"):
        store.get("never")
    with pytest.raises(RendezvousError, match=r"wait\('x', 'y'\)"):
        store.wait(["x", "y"], timedelta(seconds=0.2))
    assert store.get("late") == b"L"  # a fresh connection after the one that timed out


def test_threads_share_a_store_each_on_its_own_connection(served):
    store, errors = JobStore(served.address, SECRET, 10), []

    def count():
        try:
            for _ in range(200):
                store.add("hits", 1)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and store.get("hits") == b"800"


def test_a_wrong_secret_is_refused_and_noted_once(served, capfd):
    for _ in range(3):
        with pytest.raises(RendezvousError, match="closed"):
            JobStore(served.address, b"f" * 32, 2).get("spmd/hub")
    JobStore(served.address, SECRET, 2).set("still", "served")
    assert JobStore(served.address, SECRET, 2).get("still") == b"served"
    err = capfd.readouterr().err
    assert err.count("did not prove it belongs to the job") == 1, err


def test_torchs_tcpstore_client_and_a_request_before_the_answer_get_nothing(served):
    JobStore(served.address, SECRET, 2).set("spmd/hub", "secret invitation")
    with pytest.raises(Exception):  # noqa: B017 - torch's DistStoreError or RuntimeError
        dist.TCPStore(*served.address, None, False, timedelta(seconds=2), wait_for_workers=False)
    with socket.create_connection(served.address, timeout=5) as raw:
        assert raw.recv(64).startswith(frames.GREETING)
        raw.sendall(frames.frame(frames.OPS["get"], b"spmd/hub") + b"\n")
        assert raw.recv(64) == b""  # closed, nothing answered
    assert JobStore(served.address, SECRET, 2).get("spmd/hub") == b"secret invitation"


def test_silent_strangers_are_closed_and_cannot_crowd_a_member_out(served, monkeypatch):
    held = [socket.create_connection(served.address) for _ in range(MAX_PENDING + 20)]
    try:
        store = JobStore(served.address, SECRET, 5)
        store.set("k", "v")  # the oldest silent ones made room
        assert store.get("k") == b"v"
        closed = 0
        for s in held[:20]:
            s.settimeout(5)
            try:
                s.recv(64)  # the greeting, then the close
                closed += s.recv(64) == b""
            except OSError:
                closed += 1
        assert closed == 20
    finally:
        for s in held:
            s.close()


def test_an_oversized_frame_closes_only_that_connection(served):
    member = JobStore(served.address, SECRET, 5)
    member.set("a", "1")
    with socket.create_connection(served.address, timeout=5) as raw:
        nonce = raw.recv(64)[len(frames.GREETING):].strip()
        raw.sendall(answer(SECRET, nonce) + b"\x01\x00\x00\x00\x01" + (frames.MAX_FIELD + 1).to_bytes(4, "big"))
        assert raw.recv(64) == b""
    assert member.get("a") == b"1"


def test_it_is_torchs_rendezvous_for_a_world_of_one(served):
    import torch

    dist.init_process_group("gloo", store=JobStore(served.address, SECRET, 10), rank=0, world_size=1)
    try:
        x = torch.ones(3)
        dist.all_reduce(x)
        assert x.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_a_closed_server_fails_its_members_requests_promptly(served):
    store = JobStore(served.address, SECRET, 30)
    store.set("a", "1")
    served.close()
    began = time.monotonic()
    with pytest.raises(RendezvousError):
        store.get("a")
    assert time.monotonic() - began < 10
