"""Call numbers, fingerprints and traces: the pure parts, and a traced job."""

import json

import numpy as np
import pytest

from tests.support import MPIRUN, REPO, clean_env, run, tool
from spmd.failfast.calls import Call, Monitor, chrome_trace, fingerprint_mismatch, summarize


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
def test_the_timeout_watcher_never_owns_the_communicator():
    """Its daemon thread must not free the communicator's tensors at interpreter teardown."""
    import gc
    import threading
    import weakref

    from spmd.failfast.hub import MpiTimeout

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
