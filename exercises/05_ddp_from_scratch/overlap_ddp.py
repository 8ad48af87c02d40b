# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Step 3 of lesson 05: overlap communication with the backward pass.

The naive wrapper waits until backward is over, then sends every gradient. But the gradient
of the last layer is ready long before backward reaches the first one. Here each parameter
gets a hook that fires the moment its gradient is accumulated
(``Tensor.register_post_accumulate_grad_hook``) and launches an *asynchronous* all-reduce of
that gradient (``async_op=True`` returns a handle at once). Backward goes on computing while
the network works. ``finish_gradient_synchronization()`` waits on every handle, then divides.

Without the wait, ``optimizer.step()`` could read a gradient the network has not finished
summing. Frozen parameters get no hook (``register_post_accumulate_grad_hook`` refuses them);
a tied parameter gets one hook, which fires once per backward after both uses are summed.

A parameter that gets no gradient in a step never fires its hook; the finish call then raises
a ``RuntimeError`` naming it instead of leaving ranks waiting on each other.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from naive_ddp import broadcast_state, trainable_parameters
from torch import nn


class OverlapDDP(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True
        broadcast_state(self.module)
        self.params = trainable_parameters(self.module)
        self.names = {id(p): n for n, p in self.module.named_parameters()}
        self.pending: list[tuple[dist.Work, nn.Parameter]] = []  # filled by the hooks
        self.hook_handles = []
        self._register_hooks()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        previous = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = previous

    def _register_hooks(self) -> None:
        """One hook per parameter in ``self.params``: launch an async all-reduce of its grad."""
        raise NotImplementedError("Task 05.4: register_post_accumulate_grad_hook on each p in self.params; if self.require_sync, append (dist.all_reduce(p.grad, async_op=True), p) to self.pending")

    def finish_gradient_synchronization(self) -> None:
        """Wait for every launched all-reduce, then divide each gradient by the world size."""
        if not self.require_sync:
            return
        raise NotImplementedError("Task 05.5: raise RuntimeError if a param in self.params launched nothing; else wait each handle in self.pending, divide its grad, clear the list")
