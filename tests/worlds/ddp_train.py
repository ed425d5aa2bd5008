"""Reference for jobs/train_dp.py: the same training with torch's own DDP, no spmd.

Run under torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):

    torchrun --standalone --nproc-per-node 2 tests/worlds/ddp_train.py OUT.pt --steps 6

The model, data, loss and optimizer come from jobs/train_dp.py; the
process group, parameter broadcast and gradient averaging are
torch.distributed's.  Rank 0 writes the final state_dict to OUT.pt.

With --spmd-init the process group is the one spmd.init() starts instead,
so it also runs under mpirun on the default (mpi) backend:

    mpirun -n 2 python tests/worlds/ddp_train.py OUT.pt --spmd-init
"""

import argparse
import gc
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

JOB = Path(__file__).resolve().parents[2] / "jobs" / "train_dp.py"


def load_job():
    spec = importlib.util.spec_from_file_location("train_dp", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--sparse-embedding", action="store_true", help="nn.Embedding(sparse=True)")
    parser.add_argument("--spmd-init", action="store_true",
                        help="let spmd.init() start torch.distributed (any launcher)")
    args = parser.parse_args()
    job = load_job()

    if args.spmd_init:
        import spmd

        spmd.init()
    else:
        dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    vocab = job.VOCAB if args.vocab is None else args.vocab
    model = job.build_model(args.seed, vocab=vocab, sparse=args.sparse_embedding)
    # The pooler gets no gradient, as in BERT: DDP must be told to look for it.
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = job.make_optimizer(model, args.optimizer)
    for step in range(args.steps):
        (micro,) = job.rank_batches(args.seed, step, args.global_batch, rank, size, vocab=vocab)
        job.mlm_loss(ddp, micro).backward()
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        torch.save(model.state_dict(), args.out)
    print(f"DDP OK rank {rank} size {size}", flush=True)
    # DDP's reducer holds the process group, and gloo's worker threads stop only
    # once nothing holds it: left to interpreter teardown, one that frees a tensor
    # aborts the process ("terminate called without an active exception").
    del ddp, optimizer, model
    gc.collect()
    if args.spmd_init:
        spmd.finalize()  # destroys the group it started
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
