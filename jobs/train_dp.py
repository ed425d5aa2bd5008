"""Train a small BERT-like encoder with data parallelism, on CPU.

\b
    mpirun -n 4 python jobs/train_dp.py
    spmd run -n 2 jobs/train_dp.py --overlap --accum-steps 2
    spmd run -n 2 jobs/train_dp.py --vocab 30522 --sparse-rows
    python jobs/train_dp.py --steps 50

The guide's distributed BERT case: every rank starts from rank 0's
parameters (or the checkpoint rank 0 reads, --resume), trains on its
slice of each global batch, and averages gradients with bucketed
all_reduce (spmd.data_parallel).  Loss and samples/s are gathered to
rank 0 and logged; rank 0 writes checkpoints atomically.  At the end
every rank's parameter checksum is compared on rank 0, and the job
fails if they differ.

The task is masked-token prediction on synthetic sequences drawn from
--seed: each sequence counts from a random start in a random stride,
modulo the vocabulary, with 4 of 16 tokens masked; or, with --zipf 1, words
drawn by their frequency as in text (a large vocabulary then learns within
a hundred steps).  --vocab 30522 is BERT's vocabulary: the token embedding
is then the largest gradient, of which a step touches only its batch's
tokens (--sparse-rows sends those).
"""

import hashlib
import os
import sys
import time
from types import SimpleNamespace

import click
import torch
import torch.nn.functional as F
from torch import nn

from spmd import comm, run_command
from spmd.errors import DataParallelError
from spmd.runtime import preempt
from spmd.train.data_parallel import (
    DataParallel,
    gather_metrics,
    load_checkpoint,
    save_checkpoint,
)
from spmd.train.compress import describe, parse_compress

VOCAB = 32  # ordinary tokens 0..VOCAB-1 (the default of --vocab)
MASK = VOCAB  # the [MASK] token: the vocabulary's size
SEQ_LEN = 16
# Masked positions per sequence.  The same in every sequence, so the mean
# loss of any slice of a batch weighs each sequence alike, and the mean of
# the ranks' means is the mean over the global batch.
MASKED = 4


class TinyBert(nn.Module):
    """Token and position embeddings, a pre-norm encoder, a masked-token head.

    vocab: ordinary tokens (the [MASK] token is one more); sparse: the token
    embedding makes sparse gradients (nn.Embedding(sparse=True)).
    """

    def __init__(self, dim=64, layers=2, heads=4, dropout=0.0, vocab=VOCAB, sparse=False):
        super().__init__()
        self.tokens = nn.Embedding(vocab + 1, dim, sparse=sparse)
        self.positions = nn.Embedding(SEQ_LEN, dim)
        # No biases inside the encoder: softmax ignores a shift of the scores, so
        # the attention key bias has an exactly zero gradient, and AdamW would
        # turn its rounding noise into full-size steps that differ from run to run.
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout, batch_first=True, norm_first=True, bias=False
        )
        self.encoder = nn.TransformerEncoder(
            layer, layers, norm=nn.LayerNorm(dim), enable_nested_tensor=False
        )
        self.mlm = nn.Linear(dim, vocab)
        # BERT's pooler serves sentence-level heads that masked-token training
        # does not use: like in BERT it is there and never gets a gradient.
        self.pooler = nn.Linear(dim, dim)

    def forward(self, tokens, where=None):
        """Logits of every position, or of the positions where (batch x k) only: the head's cost
        grows with the vocabulary, and the loss reads the masked positions alone."""
        h = self.encoder(self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1])))
        if where is not None:
            h = h.gather(1, where.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        return self.mlm(h)


def build_model(seed=0, dim=64, layers=2, heads=4, dropout=0.0, vocab=VOCAB, sparse=False):
    """Return the model, initialised from seed."""
    torch.manual_seed(seed)
    return TinyBert(dim, layers, heads, dropout, vocab, sparse)


#: Optimizers and their default learning rates.  AdamW trains best; SGD's step
#: is proportional to the gradient, so a wrongly scaled gradient shows.
LEARNING_RATES = {"adamw": 3e-3, "sgd": 0.1}


def make_optimizer(model, name="adamw", lr=None):
    """Return a fresh optimizer: AdamW, or SGD with momentum."""
    lr = LEARNING_RATES[name] if lr is None else lr
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def make_batch(seed, step, batch, vocab=VOCAB, zipf=0.0):
    """Return global batch number step: (inputs, masked positions, targets); [MASK] is token vocab.

    zipf 0: arithmetic sequences modulo vocab (every token alike; learnable only
    through the arithmetic).  zipf s > 0: tokens drawn independently with
    probability proportional to 1 / rank**s, as words in text are (s about 1),
    so the first hundred steps learn the frequencies, as a real BERT's do.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if zipf > 0:
        weights = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-zipf)
        seq = torch.multinomial(weights, batch * SEQ_LEN, replacement=True, generator=g).view(batch, SEQ_LEN)
    else:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, vocab, (batch, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ_LEN)) % vocab
    where = torch.rand(batch, SEQ_LEN, generator=g).argsort(dim=1)[:, :MASKED]
    return seq.scatter(1, where, vocab), where, seq.gather(1, where)


def check_batch(global_batch, size, accum_steps):
    """Return sequences per micro-batch, or raise if the batch does not divide."""
    parts = size * accum_steps
    if global_batch < 1 or global_batch % parts:
        raise ValueError(
            f"--global-batch {global_batch} does not split into {size} ranks x "
            f"{accum_steps} micro-batches; use a positive multiple of {parts}"
        )
    return global_batch // parts


def rank_batches(seed, step, global_batch, rank, size, accum_steps=1, vocab=VOCAB, zipf=0.0):
    """Return this rank's micro-batches of global batch number step."""
    n = check_batch(global_batch, size, accum_steps)
    batch = make_batch(seed, step, global_batch, vocab, zipf)
    first = rank * n * accum_steps
    return [
        tuple(t[first + i * n : first + (i + 1) * n] for t in batch) for i in range(accum_steps)
    ]


def mlm_loss(model, micro):
    """Mean cross-entropy over the masked positions of a micro-batch."""
    inputs, where, targets = micro
    picked = model(inputs, where)
    return F.cross_entropy(picked.reshape(-1, picked.shape[-1]), targets.reshape(-1))


def checksum(model):
    """Hash the bytes of every parameter and buffer."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _set_threads():
    """Share the CPUs between the ranks on this node unless OMP_NUM_THREADS says."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cpus or 1) // comm.local_size))


def say(*parts):
    if comm.rank == 0:
        print(*parts, flush=True)


def usage_error(message):
    """Exit with status 2 on every rank, once rank 0 has printed message."""
    if comm.rank == 0:
        click.UsageError(message, click.get_current_context()).show()
    comm.barrier()
    sys.exit(2)


# A restarted job's attempt number (0 in the first attempt), from SLURM, torchrun and spmd run.
RESTART_COUNTS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SPMD_RESTART_COUNT")
# Set by spmd submit --signal-before: SLURM warns the job before its time is up.
WARNED = bool(os.environ.get("SPMD_PREEMPT_SIGNAL"))


def requeued(o):
    """Tell whether this job was restarted (requeued by SLURM, or relaunched by torchrun's or spmd run's
    --max-restarts) and its checkpoint is there to resume from."""
    restarts = max(int(os.environ.get(name) or 0) for name in RESTART_COUNTS)
    if not (restarts and o.checkpoint and "{step}" not in o.checkpoint):
        return False
    # Only rank 0 touches checkpoints (load_checkpoint): its answer goes to every rank.
    return comm.broadcast_object(os.path.exists(o.checkpoint) if comm.rank == 0 else None)


def start(o):
    """Build (or resume) model and optimizer; return them, the wrapper and the first step."""
    model = build_model(o.seed, o.dim, o.layers, o.heads, o.dropout, o.vocab, o.sparse_embedding)
    optimizer = make_optimizer(model, o.optimizer_name, o.lr)
    first = 0
    if not o.resume and requeued(o):
        o.resume = o.checkpoint
    if o.resume:
        state = load_checkpoint(o.resume)
        if state["optimizer_name"] != o.optimizer_name:
            usage_error(f"--resume {o.resume} was written with --optimizer {state['optimizer_name']}")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["step"]
    # Broadcasts rank 0's parameters, so every rank starts from the same point.
    try:
        dp = DataParallel(model, bucket_mb=o.bucket_mb, overlap=o.overlap, compress=o.compress,
                          accum_steps=o.accum_steps, sparse_rows=o.sparse_rows)
        if o.resume:  # PowerSGD's error feedback and warm start (empty without it)
            dp.load_state_dict(state.get("data_parallel", {}))
    except DataParallelError as exc:  # a --compress pattern that matches no parameter
        raise click.UsageError(str(exc)) from None
    return model, optimizer, dp, first


def train(o, model, optimizer, dp, first):
    """Train from step first to o.steps; return the last logged loss."""
    logged, window_loss, window_steps = float("nan"), 0.0, 0
    window_start = time.perf_counter()
    for step in range(first, o.steps):
        torch.manual_seed(o.seed * 1_000_003 + step * 1009 + comm.rank)  # dropout only
        losses = []
        for micro in rank_batches(o.seed, step, o.global_batch, comm.rank, comm.size, o.accum_steps, o.vocab,
                                  o.zipf):
            loss = mlm_loss(model, micro)
            dp.backward(loss)  # averages the gradients after the last micro-batch
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        window_loss += sum(losses) / len(losses)
        window_steps += 1
        done = step + 1
        if (o.log_every and done % o.log_every == 0) or done == o.steps:
            seconds = time.perf_counter() - window_start
            m = gather_metrics({
                "loss": window_loss / window_steps,
                "samples_per_s": window_steps * o.global_batch / comm.size / seconds,
            })
            if m is not None:
                logged = sum(m["loss"]) / len(m["loss"])
                say(f"step {done:>5}/{o.steps}  loss {logged:.4f}  "
                    f"samples/s {sum(m['samples_per_s']):,.0f}")
            window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
        stop = WARNED and preempt.any_preempted(comm)  # every rank stops at the same step
        if o.checkpoint and (stop or done == o.steps
                             or (o.checkpoint_every and done % o.checkpoint_every == 0)):
            write_checkpoint(o, model, optimizer, dp, done)
        if stop and done < o.steps:
            say(f"preempted after step {done}: stopping; a requeued run resumes from the checkpoint")
            sys.exit(0)
    return logged


def write_checkpoint(o, model, optimizer, dp, done):
    """Save model, optimizer and DataParallel state at step done (rank 0 writes, atomically; every rank calls)."""
    state = {"step": done, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "data_parallel": dp.state_dict(),
             "optimizer_name": o.optimizer_name, "seed": o.seed, "global_batch": o.global_batch}
    path = save_checkpoint(state, o.checkpoint.replace("{step}", str(done)))
    if path:
        say(f"checkpoint: step {done} -> {path}")


def finish(o, model, first, loss, seconds):
    """Save the final parameters and fail unless they are the same on every rank."""
    if o.save_final:
        save_checkpoint(model.state_dict(), o.save_final)  # rank 0 writes
    sums = comm.gather_object(checksum(model))
    if comm.rank != 0:
        return
    if len(set(sums)) > 1:
        for r, s in enumerate(sums):
            print(f"rank {r}: parameters sha256 {s}", file=sys.stderr)
        sys.exit("train_dp: the ranks' parameters differ")
    say(f"done: steps {first}..{o.steps} in {seconds:.1f} s, final loss {loss:.4f}, "
        f"parameters identical on {comm.size} rank{'s' * (comm.size > 1)} (sha256 {sums[0][:16]})")


class CompressParam(click.ParamType):
    """--compress: one dtype for every gradient, or pattern=dtype pairs (spmd.train.compress)."""

    name = "none|fp16|bf16|powersgd[:R]|auto|PATTERN=NAME,..."

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return parse_compress(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


@click.command(help=__doc__)
@click.option("--steps", default=200, show_default=True, type=click.IntRange(min=0),
              help="Optimizer steps to reach (counting those of a resumed checkpoint).")
@click.option("--global-batch", default=64, show_default=True, type=click.IntRange(min=1),
              help="Sequences per optimizer step, over all ranks and micro-batches.")
@click.option("--optimizer", "optimizer_name", default="adamw", show_default=True,
              type=click.Choice(sorted(LEARNING_RATES)), help="AdamW, or SGD with momentum 0.9.")
@click.option("--lr", type=float,
              help="Learning rate [default: 3e-3 for adamw, 0.1 for sgd; "
                   "a resumed checkpoint keeps its own].")
@click.option("--bucket-mb", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Size of one gradient all_reduce, in megabytes "
                   "[default: 25; with --overlap a quarter of the gradients, 1 to 25, "
                   "unless the node has more ranks than CPUs].")
@click.option("--overlap/--no-overlap", default=False, show_default=True,
              help="All-reduce each bucket asynchronously during backward.")
@click.option("--accum-steps", default=1, show_default=True, type=click.IntRange(min=1),
              help="Micro-batches per step; gradients are averaged once per step.")
@click.option("--compress", default="none", show_default=True, type=CompressParam(),
              help="How the gradients travel: none, fp16 or bf16 (their dtype), powersgd[:R] (matrices as "
                   "rank-R factors, default 4), auto (chosen per gradient from the link measured after 3 "
                   "uncompressed steps); or per parameter, 'tokens.*=bf16,encoder.*=powersgd:4' "
                   "(the rest uncompressed).")
@click.option("--vocab", default=VOCAB, show_default=True, type=click.IntRange(min=2),
              help="Ordinary tokens (BERT's: 30522).")
@click.option("--zipf", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Tokens drawn with probability 1/rank**S, as words in text (0: arithmetic sequences).")
@click.option("--sparse-rows/--no-sparse-rows", default=False, show_default=True,
              help="Send the token embedding's gradient as the rows each rank's batch touched.")
@click.option("--sparse-embedding/--no-sparse-embedding", default=False, show_default=True,
              help="nn.Embedding(sparse=True): sparse gradients (needs --sparse-rows and --optimizer sgd).")
@click.option("--log-every", default=20, show_default=True, type=click.IntRange(min=0),
              help="Log loss and samples/s every N steps (0: at the end only).")
@click.option("--checkpoint", type=click.Path(dir_okay=False),
              help="Checkpoint file, written by rank 0; '{step}' in it becomes the step.  Without '{step}', "
                   "a restarted job (SLURM's requeue, torchrun's or spmd run's --max-restarts) resumes from it.")
@click.option("--checkpoint-every", default=0, show_default=True, type=click.IntRange(min=0),
              help="Write the checkpoint every N steps (0: at the end only).")
@click.option("--resume", type=click.Path(dir_okay=False),
              help="Continue from this checkpoint (read by rank 0, sent to all).")
@click.option("--save-final", type=click.Path(dir_okay=False),
              help="Rank 0 writes the final model state_dict here.")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seed of the initial parameters and of the data.")
@click.option("--dim", default=64, show_default=True, type=click.IntRange(min=1),
              help="Model width.")
@click.option("--layers", default=2, show_default=True, type=click.IntRange(min=1),
              help="Encoder layers.")
@click.option("--heads", default=4, show_default=True, type=click.IntRange(min=1),
              help="Attention heads.")
@click.option("--dropout", default=0.0, show_default=True,
              type=click.FloatRange(0, 1, max_open=True),
              help="Dropout rate (seeded per step and rank, so runs repeat).")
def main(**options):
    o = SimpleNamespace(**options)
    if o.dim % o.heads:
        raise click.UsageError(f"--dim {o.dim} must be a multiple of --heads {o.heads}")
    if o.sparse_embedding and not (o.sparse_rows or comm.size == 1):
        raise click.UsageError("--sparse-embedding makes sparse gradients, which DataParallel sends as rows "
                               "only: add --sparse-rows")
    if o.sparse_embedding and o.optimizer_name != "sgd":
        raise click.UsageError("--sparse-embedding needs --optimizer sgd (AdamW takes no sparse gradients)")
    try:
        per_micro = check_batch(o.global_batch, comm.size, o.accum_steps)
    except ValueError as exc:
        usage_error(str(exc))
    _set_threads()
    if WARNED:
        preempt.install()  # before the first step: the warning may come at any time
    model, optimizer, dp, first = start(o)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"train_dp: {comm.size} rank{'s' * (comm.size > 1)} ({comm.backend}), "
        f"{n_params:,} parameters in {len(dp.buckets)} bucket{'s' * (len(dp.buckets) > 1)}; "
        f"global batch {o.global_batch} = {comm.size} x {o.accum_steps} x {per_micro}; "
        f"overlap {'on' if o.overlap else 'off'}, compress {describe(o.compress)}"
        + (f"; vocabulary {o.vocab:,}" if o.vocab != VOCAB else "")
        + (f"; words by frequency (zipf {o.zipf:g})" if o.zipf else "")
        + (f"; sparse rows: {', '.join(w.name for w in dp.row_weights)}" if o.sparse_rows else "")
        + (f"; resuming at step {first}" if o.resume else ""))
    began = time.perf_counter()
    loss = train(o, model, optimizer, dp, first)
    finish(o, model, first, loss, time.perf_counter() - began)


if __name__ == "__main__":
    run_command(main)  # a bad option: said once, every rank exits 2
