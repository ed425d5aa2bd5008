"""tests/cluster/netbench.py's arithmetic: DDP's best hook within 1% of plain DDP's loss, each form's ratio to it,
and the collectives' shares of the cap.  (The benchmark itself runs for tens of minutes: docs/performance.md.)"""

import pytest

from tests.cluster import netbench as nb

pytestmark = pytest.mark.unit


def _run(form, step_ms, loss, cap=200, layout="2x1", sent=1e6, rnd=0):
    return {"form": form, "step_ms": step_ms, "loss_last": loss, "cap": cap, "layout": layout,
            "h1_bytes_per_step": sent, "round": rnd}


def test_the_best_hook_is_the_fastest_within_one_percent_of_plain_ddps_loss():
    runs = [_run("DDP", 1400, 8.0), _run("DDP", 1500, 8.0, rnd=1),
            _run("DDP fp16_compress_hook", 800, 8.01),
            _run("DDP powerSGD_hook:4", 100, 8.2),  # fastest, but 2.5% above: not DDP's best
            _run("DataParallel bf16", 700, 8.0), _run("DataParallel powersgd:4", 600, 8.05)]
    (s,) = nb.train_summary(runs)
    assert s["best_hook"] == "DDP fp16_compress_hook"
    assert s["rows"]["DDP"]["step_ms"] == 1450 and s["rows"]["DDP"]["rounds_ms"] == [1400, 1500]
    assert s["rows"]["DataParallel powersgd:4"]["vs_best_hook"] == pytest.approx(0.75)
    assert s["rows"]["DDP powerSGD_hook:4"]["loss_vs_ddp"] == pytest.approx(0.025)
    assert s["best_ours"] == "DataParallel powersgd:4"
    table = nb.train_table([s])
    assert "| DataParallel powersgd:4 | 600 | 600 | 0.75 | 8.05000 | +0.63% | 1.00 |" in table


def test_layouts_and_caps_are_summarised_apart_uncapped_first():
    runs = [_run("DDP", 100, 8.0, cap=0), _run("DDP", 300, 8.0, cap=200), _run("DDP", 200, 8.0, cap=1000),
            _run("DDP", 400, 8.0, cap=200, layout="2x2")]
    keys = [(s["layout"], s["cap"]) for s in nb.train_summary(runs)]
    assert keys == [("2x1", 0), ("2x1", 1000), ("2x1", 200), ("2x2", 200)]


def test_collectives_table_gives_the_share_of_the_cap_and_the_ratio_to_raw_gloo():
    rows = [{"collective": "all_reduce", "size": 16 << 20, "impl": "gloo", "busbw_gbps": 0.020},
            {"collective": "all_reduce", "size": 16 << 20, "impl": "spmd-gloo", "busbw_gbps": 0.0236}]
    table = nb.collectives_table([{"layout": "2x1", "cap": 200, "round": 0, "doc": {"rows": rows}}])
    assert "| 2x1 | 200 Mbit/s | all_reduce | 16 MiB | spmd-gloo | 23.6 | 23.6 | 94% | 1.18 |" in table
    assert "| 2x1 | 200 Mbit/s | all_reduce | 16 MiB | gloo | 20.0 | 20.0 | 80% | 1.00 |" in table


def test_layouts_read_hosts_by_ranks():
    assert nb.layouts("2x1,2x2,4") == [(2, 1), (2, 2), (4, 1)]


def test_pipeline_table_compares_with_the_loop_and_flags_differing_checksums():
    runs = [{"form": "spmd scatter (read=root)", "cap": 200, "layout": "2x1", "round": r, "seconds": s,
             "checksum": "ab", "h1_bytes": 40e6} for r, s in enumerate((3.0, 5.0))]
    runs += [{"form": "mpi4py Scatterv/Gatherv loop", "cap": 200, "layout": "2x1", "round": 0, "seconds": 5.0,
              "checksum": "ab", "h1_bytes": 40e6}]
    table = nb.pipeline_table(runs)
    assert "| 2x1 | 200 Mbit/s | spmd scatter (read=root) | 4.00 | 3.00, 5.00 | 40.0 | 0.80 |" in table
    assert "checksums differ" not in table
    runs[0]["checksum"] = "cd"
    assert "checksums differ between runs: ['ab', 'cd']" in nb.pipeline_table(runs)
