"""Call numbers, fingerprints and traces: the pure parts, and a traced job."""

import json

import numpy as np
import pytest

from tests.support import MPIRUN, REPO, clean_env, run, tool
from spmd.failfast.calls import Call, Monitor, call_name, fingerprint_mismatch, named, timed_out
from spmd.failfast.trace import chrome_trace, summarize


def fps(*calls):
    return [Call(1, name, root, op, dtype, shape, f"job.py:{10 + i}")
            for i, (name, root, op, dtype, shape) in enumerate(calls)]


@pytest.mark.unit
def test_matching_fingerprints_pass_and_gathers_may_differ_in_dim0():
    same = fps(("all_reduce", None, "sum", "float32", (4,)), ("all_reduce", None, "sum", "float32", (4,)))
    assert fingerprint_mismatch(same) is None
    gathers = fps(("gather", 0, None, "float32", (3, 2)), ("gather", 0, None, "float32", (5, 2)))
    assert fingerprint_mismatch(gathers) is None


@pytest.mark.unit
def test_equal_gathers_must_agree_on_the_whole_shape():
    equal = fps(("all_gather", None, "equal", "float32", (3, 2)), ("all_gather", None, "equal", "float32", (5, 2)))
    assert "(3, 2)" in fingerprint_mismatch(equal) and "(5, 2)" in fingerprint_mismatch(equal)
    mixed = fps(("gather", 0, "equal", "float32", (3, 2)), ("gather", 0, None, "float32", (3, 2)))
    assert "op=equal" in fingerprint_mismatch(mixed)


@pytest.mark.unit
def test_mismatch_lists_every_rank_and_where():
    message = fingerprint_mismatch(fps(("broadcast", 0, None, "float64", (8,)),
                                       ("all_reduce", None, "sum", "float64", (8,))))
    assert "collective mismatch at call #1" in message
    assert "rank 0: #1 broadcast root=0 float64 (8,) at job.py:10" in message
    assert "rank 1: #1 all_reduce op=sum float64 (8,) at job.py:11" in message
    shapes = fingerprint_mismatch(fps(("all_reduce", None, "sum", "float32", (3,)),
                                      ("all_reduce", None, "sum", "float32", (4,))))
    assert "(3,)" in shapes and "(4,)" in shapes


@pytest.mark.unit
def test_ring_keeps_the_last_calls_cheaply():
    mon = Monitor()
    x = np.zeros((2, 3), dtype=np.float32)
    for _ in range(10):
        mon.note("all_reduce", x, None, "sum")
    assert mon.seq == 10 and len(mon.ring) == 8
    assert mon.recent().startswith("#3 all_reduce op=sum float32 (2, 3)")


@pytest.mark.unit
def test_a_record_reads_by_name_and_a_send_or_recv_by_peer_and_tag():
    mon = Monitor()
    x = np.zeros((2, 3), dtype=np.float32)
    record = mon.note("all_reduce", x, None, "sum")
    call = named(record)
    assert type(call) is Call and named(call) is call and call == record  # the same fields, in Call's order
    assert (call.seq, call.name, call.root, call.op, call.dtype, call.shape, call.where) == (
        1, "all_reduce", None, "sum", np.float32, (2, 3), None)
    mon.note("recv", None, 2, 5)
    mon.note("send", x, 1, 7)
    recv, send = mon.calls()[-2:]
    assert (recv.peer, recv.tag, send.peer, send.tag) == (2, 5, 1, 7)
    assert call_name(recv) == "recv from rank 2 (tag 5)" and call_name(send) == "send to rank 1 (tag 7)"
    assert call_name(mon.note("recv", None, None, 3)) == "recv from any rank (tag 3)"
    assert [type(c) for c in mon.calls()] == [Call] * 4 and mon.find(3) == send and type(mon.find(1)) is Call
    assert mon.find(99) is None
    mon.waiting = record  # an async call's wait, its record as the call path holds it
    for _ in range(10):
        mon.note("barrier")
    assert mon.find(1) == call and type(mon.find(1)) is Call
    upcoming = mon.upcoming("gather", x, 0)
    assert type(upcoming) is Call and upcoming.seq == mon.seq + 1 and mon.find(mon.seq + 1) is upcoming


@pytest.mark.unit
def test_every_timeout_report_starts_with_the_same_words():
    assert timed_out("rank 0", "all_reduce (call #3)", 6.0, "the other ranks") == (
        "rank 0: all_reduce (call #3) timed out after 6 s waiting for the other ranks")
    assert timed_out("### spmd: rank 1 of 2", "send to rank 0 (tag 1) (call #4)", 0.25, "its peer", True) == (
        "### spmd: rank 1 of 2: send to rank 0 (tag 1) (call #4) timed out after 0.25 s "
        "in wait() of its async handle, waiting for its peer")
    assert timed_out("rank 2", "a point-to-point wait", 30) == "rank 2: a point-to-point wait timed out after 30 s"


@pytest.mark.unit
def test_the_timeout_watcher_never_owns_the_communicator():
    """Its daemon thread must not free the communicator's tensors at interpreter teardown."""
    import gc
    import threading
    import weakref

    from spmd.failfast.mpi_timeout import MpiTimeout

    class Comm:  # what MpiTimeout reads
        rank, size, timeout = 0, 2, 100.0

    comm, freed = Comm(), []
    weakref.finalize(comm, lambda: freed.append(threading.current_thread().name))
    watcher = MpiTimeout(comm, [])
    del comm
    gc.collect()
    assert freed == ["MainThread"]
    watcher.close()
    assert not watcher._thread.is_alive()


@pytest.mark.unit
def test_summary_uses_nccl_tests_bus_factors():
    events = [{"name": "all_reduce", "bytes": 1000, "dur": 1.0, "seq": 1, "ts": 0.0},
              {"name": "broadcast", "bytes": 1000, "dur": 1.0, "seq": 2, "ts": 0.0}]
    rows = {r[0]: r for r in summarize(events, 4)}
    assert rows["all_reduce"][4] == 1000 and rows["all_reduce"][5] == pytest.approx(1500)
    assert rows["broadcast"][5] == pytest.approx(1000)
    trace = chrome_trace([events, events])
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}


@pytest.mark.launcher
@pytest.mark.timeout(120)
@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found")
def test_a_traced_job_writes_one_merged_trace(tmp_path):
    path = tmp_path / "trace.json"
    result = run([tool("spmd"), "run", "-n", 2, REPO / "jobs" / "collectives.py"], 110,
                 clean_env(SPMD_TRACE=path))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "spmd trace: collectives over 2 ranks" in result.stdout
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {"reduce", "all_reduce", "scatter", "gather", "all_gather", "broadcast"} <= {e["name"] for e in spans}
    assert all(e["dur"] >= 0 for e in spans)
    assert any(e["name"] == "scatter" and e["args"]["bytes"] > 0 for e in spans)
