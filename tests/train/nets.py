"""Small models and data the tests of spmd.train share (imported as ``from tests.train.nets import ...``)."""

import torch
from torch import nn


class Branchy(nn.Module):
    """A trunk, one head per rank, a head no rank uses and a frozen layer."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.heads = nn.ModuleList([nn.Linear(6, 3), nn.Linear(6, 3)])
        self.never = nn.Linear(6, 3)

    def forward(self, x, head):
        return self.heads[head](torch.tanh(self.frozen(torch.tanh(self.trunk(x)))))


class Stem(nn.Module):
    """A trunk and a head, and below the trunk a stem that only some steps use."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.trunk = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x, stem=False):
        return self.head(torch.tanh(self.trunk(torch.tanh(self.stem(x)) if stem else x)))


def data(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


def loss_of(model, x, y, head=0):
    return ((model(x, head) - y) ** 2).mean()


def grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
