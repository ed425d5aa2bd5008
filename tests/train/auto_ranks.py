"""Run by tests/train/test_auto.py under ``spmd run -n 2``: DataParallel(compress="auto") on real ranks.

TinyBert (jobs/train_dp.py, dim 64) trains with compress="auto", overlap
and 2 micro-batches per step; the same start trains again uncompressed for
auto's measuring steps, then with the chosen forms named one by one.  Rank 0
prints one JSON line: whether every rank chose alike and whether both runs
ended on the same parameters, bit for bit.
"""

import copy
import json

import torch

import spmd
from spmd import comm
from spmd.train.auto import MEASURE_STEPS
from spmd.train.data_parallel import DataParallel
from spmd.bench.train_worker import load_job

STEPS, ACCUM = MEASURE_STEPS + 3, 2


def steps(job, model, dp, opt, first, last):
    for step in range(first, last):
        for micro in job.rank_batches(0, step, 16, comm.rank, comm.size, accum_steps=ACCUM):
            dp.backward(job.mlm_loss(model, micro))
        opt.step()
        opt.zero_grad()


def main():
    spmd.init()
    job = load_job()
    base = job.build_model(0)
    model = copy.deepcopy(base)
    dp = DataParallel(model, compress="auto", overlap=True, accum_steps=ACCUM)
    opt = job.make_optimizer(model, "adamw")
    steps(job, model, dp, opt, 0, STEPS)
    choice = dp.auto_choice
    choices = comm.all_gather_object(choice)

    ref = copy.deepcopy(base)
    opt2 = job.make_optimizer(ref, "adamw")
    plain = DataParallel(ref, overlap=True, accum_steps=ACCUM)
    steps(job, ref, plain, opt2, 0, MEASURE_STEPS)
    plain.close()
    chosen = DataParallel(ref, compress={name: form for name, form in choice.items()}, overlap=True,
                          accum_steps=ACCUM)
    steps(job, ref, chosen, opt2, MEASURE_STEPS, STEPS)
    equal = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    equal_everywhere = comm.all_gather_object(equal)
    if comm.rank == 0:
        print(json.dumps({"size": comm.size, "same_choice": all(c == choices[0] for c in choices),
                          "equal_to_chosen": all(equal_everywhere), "choice": choice}), flush=True)
    spmd.finalize()


if __name__ == "__main__":
    main()
