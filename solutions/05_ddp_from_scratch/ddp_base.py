"""What every DDP of lesson 05 shares: the same start, the same forward, ``no_sync()``.

Two things make N copies of a model train as one:

1. they start equal: rank 0's parameters *and buffers* are broadcast at construction
   (task 05.2);
2. they take the same step: after ``loss.backward()`` every gradient is summed over the ranks
   and divided by the world size, so each rank holds the gradient of the mean loss over the
   whole global batch, exactly what one process would compute on all of it.

:class:`DDPBase` does (1) and leaves (2) to its subclasses, which differ only in *when* and
*how* they talk: :class:`naive_ddp.NaiveDDP` (after backward, one gradient at a time),
:class:`overlap_ddp.OverlapDDP` (during backward, from hooks) and
:class:`bucketed_ddp.BucketedDDP` (during backward, a bucket of gradients at a time).

Usage mirrors ``torch.nn.parallel.DistributedDataParallel``, plus one explicit call::

    model = NaiveDDP(net)
    loss = loss_fn(model(x), y); loss.backward()
    model.finish_gradient_synchronization()      # <- torch DDP does this inside backward
    optimizer.step()

Under ``with model.no_sync():`` (task 05.9) a backward only accumulates gradients locally,
without communication, for gradient accumulation over several micro-batches.
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
    """Give every rank rank ``src``'s parameters and buffers, in place.

    Afterwards every parameter and every buffer of ``module`` (frozen ones included) holds on
    each rank the values it had on rank ``src``; no tensor object is replaced.
    """
    # BEGIN SOLUTION 05.2: make every parameter and buffer equal to rank src's, in place
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=src)
    # END SOLUTION


class DDPBase(nn.Module):
    """Wraps ``module``; starts every rank from rank 0's state; ``forward`` delegates.

    Subclasses implement :meth:`finish_gradient_synchronization` and read ``require_sync``:
    it is False inside :meth:`no_sync`, and then they must not communicate.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True
        broadcast_state(self.module)
        self.params = trainable_parameters(self.module)
        self.names = {id(p): n for n, p in self.module.named_parameters()}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside the block, ``require_sync`` is False; afterwards it is what it was before.

        It must be restored even when the block raises, and nesting must work.
        """
        # BEGIN SOLUTION 05.9: switch require_sync off for the block; restore it afterwards
        previous = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = previous
        # END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Make every trainable ``.grad`` the mean over ranks (a no-op when not syncing)."""
        raise NotImplementedError("a subclass decides how gradients are synchronized")
