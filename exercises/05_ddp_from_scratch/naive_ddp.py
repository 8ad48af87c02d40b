# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Step 2 of lesson 05: the smallest DDP that is correct.

Two things make N copies of a model train as one:

1. they start equal: rank 0's parameters *and buffers* are broadcast at construction
   (task 05.2);
2. they take the same step: after ``loss.backward()`` every gradient is summed over the ranks
   and divided by the world size (task 05.3), so each rank holds the gradient of the mean loss
   over the whole global batch, exactly what one process would compute on all of it.

Usage mirrors ``torch.nn.parallel.DistributedDataParallel``, plus one explicit call::

    model = NaiveDDP(net)
    loss = loss_fn(model(x), y); loss.backward()
    model.finish_gradient_synchronization()      # <- torch DDP does this inside backward
    optimizer.step()

Frozen parameters (``requires_grad=False``) are broadcast but never reduced. A parameter used
by two modules (tied weights) is one ``Parameter``: it is reduced once. A parameter that got
no gradient in this step is reduced as zeros, so every rank makes the same calls.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Each parameter that needs a gradient, once, in registration order.

    ``module.parameters()`` already skips a second occurrence of a tied ``Parameter``; a list
    built from ``module.modules()`` would hold it twice.
    """
    seen: set[int] = set()
    params = []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def broadcast_state(module: nn.Module, src: int = 0) -> None:
    """Overwrite every parameter and buffer with rank ``src``'s values, in place."""
    raise NotImplementedError("Task 05.2: dist.broadcast every parameter and every buffer from src (in place)")


class NaiveDDP(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True  # False inside no_sync()
        broadcast_state(self.module)
        self.params = trainable_parameters(self.module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the synchronization: gradients accumulate locally until the next synced step."""
        raise NotImplementedError("Task 05.9: set self.require_sync to False while the block runs, then restore it")

    def finish_gradient_synchronization(self) -> None:
        """All-reduce every trainable gradient and divide by the world size."""
        if not self.require_sync:
            return
        raise NotImplementedError("Task 05.3: for p in self.params: zeros if p.grad is None, dist.all_reduce, divide")
