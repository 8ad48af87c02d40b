"""Solution-independent stand-ins for the four DataParallel steps.

A test of one task patches these in for the other steps, so that against the generated stubs
it fails with its own task's message and not with the first stub it happens to call.
"""

from __future__ import annotations

import torch
from torch import nn


def scatter(x, n, devices=None):
    return list(torch.chunk(x, n, dim=0))


class _Replica(nn.Module):
    """Runs `root` with differentiable copies of its parameters (autograd sums their grads)."""

    def __init__(self, root):
        super().__init__()
        self.__dict__["root"] = root  # not a submodule: no second registration

    def forward(self, x):
        params = {n: p.clone() for n, p in self.root.named_parameters()}
        return torch.func.functional_call(self.root, params, (x,))


def replicate(module, n, devices=None):
    return [_Replica(module) for _ in range(n)]


def parallel_apply(replicas, inputs, devices=None):
    return [r(x) for r, x in zip(replicas, inputs)]


def gather(outputs, device=None):
    return torch.cat(list(outputs), dim=0)
