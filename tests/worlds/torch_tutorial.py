"""PyTorch's tutorial "Writing Distributed Applications with PyTorch", after spmd.init.

The tutorial's run() functions, in spirit unchanged, on torch.distributed's
default group, whichever launcher started the job: spmd.init() must leave
torch.distributed initialised (on the mpi backend, a group beside MPI).
Synthetic data stands in for MNIST.  Each check's expected value comes
from the world size; every rank prints one line:

    TUTORIAL OK rank R size N backend B torch G   (spmd's backend, torch.distributed's)

Flags: --expect-uninitialized checks instead that spmd.init() left
torch.distributed alone (SPMD_TORCH_GROUP=0), and prints TUTORIAL SKIPPED.
"""

import math
import os
import sys

import torch
import torch._dynamo  # noqa: F401 (see below)
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import spmd

# The optimizer's first step imports torch._dynamo; imported while a gloo group
# lives, it keeps two of the group's pt_gloo_runloop threads past
# destroy_process_group (torch 2.13, with or without spmd). Imported first, it
# does not, so the check after finalize sees only what spmd itself keeps.


def blocking_p2p(rank, size):
    """Rank 0 sends a tensor to rank 1 (dist.send / dist.recv)."""
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)
    elif rank == 1:
        dist.recv(tensor=tensor, src=0)
    expected = 1.0 if rank in (0, 1) else 0.0
    assert tensor[0].item() == expected, ("blocking p2p", rank, tensor)


def immediate_p2p(rank, size):
    """The same with dist.isend / dist.irecv and wait()."""
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        req = dist.isend(tensor=tensor, dst=1)
    elif rank == 1:
        req = dist.irecv(tensor=tensor, src=0)
    if req is not None:
        req.wait()
    expected = 1.0 if rank in (0, 1) else 0.0
    assert tensor[0].item() == expected, ("immediate p2p", rank, tensor)


def group_all_reduce(rank, size):
    """all_reduce of ones on a group of ranks 0 and 1."""
    group = dist.new_group([0, 1])  # collective: every rank calls it
    tensor = torch.ones(1)
    if rank in (0, 1):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    expected = 2.0 if rank in (0, 1) else 1.0
    assert tensor[0].item() == expected, ("group all_reduce", rank, tensor)


class Net(nn.Module):
    """A small classifier: the tutorial's stands in for MNIST's."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def partition_dataset(rank, size, samples=64):
    """Every rank's equal share of one synthetic data set (the same on every rank)."""
    g = torch.Generator().manual_seed(1234)
    data = torch.randn(samples, 20, generator=g)
    target = torch.randint(0, 4, (samples,), generator=g)
    per = samples // size
    lo = rank * per
    return data[lo:lo + per], target[lo:lo + per]


def average_gradients(model):
    """The tutorial's gradient averaging: all_reduce each gradient, divide by the size."""
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def synchronous_sgd(rank, size, epochs=3):
    """Hand-written distributed SGD: ranks start equal, so they must stay equal."""
    torch.manual_seed(1234)
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    data, target = partition_dataset(rank, size)
    losses = []
    for _ in range(epochs):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        average_gradients(model)
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses), losses
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat)
    for other in gathered:
        assert torch.equal(other, flat), ("synchronous SGD: ranks diverged", rank)


def ring_all_reduce(send, rank, size):
    """The tutorial's hand-written ring all-reduce: isend right, recv from the left."""
    accum = send.clone()
    recv_buff = torch.zeros_like(send)
    left = (rank - 1) % size
    right = (rank + 1) % size
    for i in range(size - 1):
        if i % 2 == 0:
            send_req = dist.isend(send, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            send_req = dist.isend(recv_buff, right)
            dist.recv(send, left)
            accum[:] += send[:]
        send_req.wait()
    return accum


def ring(rank, size):
    send = torch.full((3,), float(rank + 1))
    result = ring_all_reduce(send, rank, size)
    expected = size * (size + 1) / 2
    assert torch.equal(result, torch.full((3,), expected)), ("ring all-reduce", rank, result)


def main():
    spmd.init()
    if "--expect-uninitialized" in sys.argv:
        assert not dist.is_initialized(), "torch.distributed was started although asked not to"
        print(f"TUTORIAL SKIPPED rank {spmd.comm.rank} size {spmd.comm.size}", flush=True)
        return
    assert dist.is_initialized(), "spmd.init() left torch.distributed uninitialised"
    rank, size = dist.get_rank(), dist.get_world_size()
    assert (rank, size) == (spmd.comm.rank, spmd.comm.size), (rank, size, spmd.comm)
    for run in (blocking_p2p, immediate_p2p, group_all_reduce, synchronous_sgd, ring):
        run(rank, size)
    # spmd's own comm still works beside it.
    x = torch.ones(1)
    spmd.comm.all_reduce(x)
    assert x.item() == size, x
    backend, torch_backend = spmd.comm.backend, dist.get_backend()
    spmd.finalize()
    # finalize destroyed the group and dropped it: gloo's threads ended now, not at teardown.
    assert not dist.is_initialized(), "torch.distributed still initialised after finalize"
    left = [t for t in gloo_threads() if t.startswith("pt_gloo")]
    assert not left, f"gloo worker threads after finalize: {left}"
    print(f"TUTORIAL OK rank {rank} size {size} backend {backend} torch {torch_backend}", flush=True)


def gloo_threads():
    """Names of this process's threads (Linux), native ones included."""
    names = []
    if os.path.isdir("/proc/self/task"):
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    names.append(f.read().strip())
            except OSError:
                pass
    return names


if __name__ == "__main__":
    main()
