"""spmd.train.auto (DataParallel(compress="auto")): the pure choice on links made up, in-process ranks, real ranks.

The choice is a pure function of the measured link and costs, so slow and
fast links are fed to it as numbers (no link is slowed here).  Through
DataParallel with ranks that are threads: the same choice on every rank,
with overlap and accumulation, kept in a checkpoint.  Then real ranks
under ``spmd run`` (gloo over TCP): the line said once, the same choice
everywhere, and training equal to the chosen forms' from the same start.
"""

import copy
import json

import pytest
import torch

from spmd.errors import DataParallelError
from spmd.train.auto import MEASURE_STEPS, POWERSGD_FORM, Candidate, Costs, Link, choose
from spmd.train.compress import check_compress, describe, parse_compress
from spmd.train.data_parallel import DataParallel
from tests.support import REPO, clean_env, ranks_ok, run, run_ranks, tool
from tests.train.test_powersgd import Net, _continue, train

# A matrix of 1024 x 1024 (4 MB) with its rank-4 factors, a bucket-sized vector, a small one.
BIG = Candidate("big", 1024 * 1024, 4 * 2048)
VEC = Candidate("vec", 1 << 20)
SMALL = Candidate("small", 64)
COSTS = Costs(cast_s_per_byte=1e-10, powersgd_s={"big": 0.004})
SLOW = Link(latency_s=1e-3, s_per_byte=1 / 25e6)  # 200 Mbit/s
FAST = Link(latency_s=1e-4, s_per_byte=1 / 5e9)   # 40 Gbit/s


@pytest.mark.unit
def test_a_slow_link_takes_powersgd_for_the_matrix_and_bf16_for_the_rest():
    choice, plain, chosen = choose(SLOW, COSTS, [BIG, VEC, SMALL])
    assert choice == {"big": POWERSGD_FORM, "vec": "bf16", "small": "bf16"}
    assert chosen < 0.5 * plain


@pytest.mark.unit
def test_a_fast_link_keeps_everything_uncompressed():
    choice, plain, chosen = choose(FAST, COSTS, [BIG, VEC, SMALL])
    assert choice == {"big": None, "vec": None, "small": None} and chosen == plain


@pytest.mark.unit
def test_a_gain_under_the_margin_keeps_everything_uncompressed():
    # bf16 saves 2 bytes an element, the cast costs nearly as much: a small gain, refused.
    costs = Costs(cast_s_per_byte=0.45 / 25e6 * 2 / 4 * 2, powersgd_s={})
    choice, plain, chosen = choose(SLOW, costs, [VEC])
    assert choice == {"vec": None} and chosen == plain
    assert choose(SLOW, costs, [VEC], margin=0.0, min_gain_s=0.0)[0] == {"vec": "bf16"}


@pytest.mark.unit
def test_powersgd_is_chosen_only_where_measured_and_worth_its_products():
    no_time = Costs(cast_s_per_byte=1.0, powersgd_s={})  # a cast that never pays, no matrix timed
    assert choose(SLOW, no_time, [BIG])[0] == {"big": None}
    slow_products = Costs(cast_s_per_byte=1.0, powersgd_s={"big": 10.0})
    assert choose(SLOW, slow_products, [BIG])[0] == {"big": None}


@pytest.mark.unit
def test_auto_in_the_names_and_patterns():
    assert check_compress("auto") == "auto" and parse_compress("auto") == "auto"
    assert parse_compress("encoder.*=auto,tokens.*=bf16") == {"encoder.*": "auto", "tokens.*": "bf16"}
    assert describe("auto") == "auto"
    with pytest.raises(DataParallelError, match="'auto'"):
        check_compress("automatic")


@pytest.mark.unit
@pytest.mark.parametrize("overlap, accum", [(False, 1), (True, 2)])
def test_every_rank_takes_the_same_choice_and_trains_alike(overlap, accum):
    base = Net()

    def rank(comm):
        model = copy.deepcopy(base)
        dp, _ = train(comm, model, MEASURE_STEPS - 1, compress="auto", overlap=overlap, accum_steps=accum)
        before = dp.auto_choice
        _continue(comm, dp, torch.optim.SGD(model.parameters(), lr=0.1), model, MEASURE_STEPS - 1, MEASURE_STEPS + 2)
        return before, dp.auto_choice, model.state_dict()

    (out, _) = ranks_ok(run_ranks(2, rank))
    assert out[0][0] is None  # still measuring
    assert out[0][1] == out[1][1] and set(out[0][1]) == {n for n, _ in Net().named_parameters()}
    for name, t in out[0][2].items():
        assert torch.equal(t, out[1][2][name]), name


@pytest.mark.unit
def test_sparse_rows_stay_rows_under_auto():
    from tests.train.test_data_parallel import load_job

    job = load_job()
    base = job.build_model(0)

    def rank(comm):
        model = copy.deepcopy(base)
        dp = DataParallel(model, comm, compress="auto", sparse_rows=True)
        opt = job.make_optimizer(model, "adamw")
        for step in range(MEASURE_STEPS + 1):
            (micro,) = job.rank_batches(0, step, 8, comm.rank, comm.size)
            dp.backward(job.mlm_loss(model, micro))
            opt.step()
            opt.zero_grad()
        return dp.auto_choice, [w.name for w in dp.row_weights]

    (out, _) = ranks_ok(run_ranks(2, rank))
    choice, rows = out[0]
    assert "tokens.weight" in rows and "tokens.weight" not in choice and out[1][0] == choice


@pytest.mark.unit
def test_a_checkpoint_keeps_the_choice_and_one_before_it_measures_afresh():
    def rank(comm):
        dp, _ = train(comm, Net(), MEASURE_STEPS, compress={"mid.*": "auto"})
        decided = dp.state_dict()
        early, _ = train(comm, Net(), 1, compress={"mid.*": "auto"})
        undecided = early.state_dict()
        forced = dict(decided, auto={"choice": {"mid.weight": "bf16", "mid.bias": None}})
        again = train(comm, Net(), 0, compress={"mid.*": "auto"})[0]
        again.load_state_dict(forced)
        kept = again.auto_choice, [b.wire is not None for b in again.buckets]
        again.load_state_dict(undecided)
        errors = []
        for state, compress in ((decided, None), ({}, {"mid.*": "auto"})):
            try:
                train(comm, Net(), 0, compress=compress)[0].load_state_dict(state)
            except DataParallelError as e:
                errors.append(str(e))
        return decided, undecided, kept, again.auto_choice, errors

    (out, _) = ranks_ok(run_ranks(2, rank))
    decided, undecided, kept, after, errors = out[0]
    assert set(decided["auto"]["choice"]) == {"mid.weight", "mid.bias"} and undecided == {"auto": {"choice": None}}
    assert kept[0] == {"mid.weight": "bf16", "mid.bias": None} and True in kept[1]
    assert after is None  # an undecided checkpoint: measured again
    assert len(errors) == 2 and all("compress='auto'" in e for e in errors), errors


RANKS_SCRIPT = REPO / "tests" / "train" / "auto_ranks.py"


@pytest.mark.launcher
@pytest.mark.timeout(200)
def test_real_ranks_choose_alike_say_it_once_and_train_as_the_chosen_forms(tmp_path):
    result = run([tool("spmd"), "run", "-n", "2", RANKS_SCRIPT], 150, env=clean_env(OMP_NUM_THREADS=1),
                 what="auto_ranks")
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    said = [line for line in (result.stdout + result.stderr).splitlines() if "compress='auto' chose" in line]
    assert len(said) == 1, said
    line = next(line for line in result.stdout.splitlines() if '"same_choice"' in line)
    report = json.loads(line[line.index("{"):])  # after spmd run's rank prefix
    assert report["same_choice"] and report["equal_to_chosen"] and report["size"] == 2, report
