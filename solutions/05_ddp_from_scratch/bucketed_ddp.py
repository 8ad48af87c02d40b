"""Step 4 of lesson 05: buckets, as torch DDP does.

One all-reduce per parameter pays a fixed cost (latency) per call, and a model has many small
tensors (biases, norms). Torch DDP groups gradients into *buckets* of at most
``bucket_cap_mb`` megabytes (25 by default), in **reverse** order of registration, since
backward produces the last layer's gradients first. When every gradient of a bucket is ready,
the bucket is flattened into one tensor and all-reduced asynchronously; at the end the summed
bucket is divided and copied back (unflattened) into each ``.grad``.

- ``assign_buckets`` (task 05.6) decides the groups: a parameter larger than the cap gets a
  bucket of its own, and a cap larger than the model gives one bucket.
- the hooks (task 05.7) count ready gradients per bucket and launch the full ones;
- ``finish_gradient_synchronization`` (task 05.8) waits, divides and unflattens. A bucket that
  never became ready (a parameter unused in this step) raises a ``RuntimeError`` naming the
  parameters, rather than leaving ranks waiting for each other.

A megabyte here is 2**20 bytes, as in torch DDP (whose first bucket is also capped at 1 MB;
we skip that detail).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from naive_ddp import broadcast_state, trainable_parameters
from torch import nn

MB = 2**20


def assign_buckets(params: list[torch.Tensor], bucket_cap_mb: float) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_cap_mb``, last parameter first.

    Walk ``params`` from the last to the first; start a new bucket when adding the next one
    would push a non-empty bucket past the cap. Returns lists of indices into ``params``.
    """
    cap = bucket_cap_mb * MB
    # BEGIN SOLUTION 05.6: walk reversed(range(len(params))); close the bucket when size + p.numel() * p.element_size() > cap and it is not empty
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
    # END SOLUTION


class BucketedDDP(nn.Module):
    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_sync = True
        broadcast_state(self.module)
        params = trainable_parameters(self.module)
        self.buckets: list[list[nn.Parameter]] = [
            [params[i] for i in idx] for idx in assign_buckets(params, bucket_cap_mb)]
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.names = {id(p): n for n, p in self.module.named_parameters()}
        self.ready = [0] * len(self.buckets)  # gradients ready so far, per bucket
        self.pending: dict[int, tuple[dist.Work, torch.Tensor]] = {}  # bucket -> (work, flat)
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
        """A hook per bucketed parameter: count it ready; when its bucket is full, launch it."""
        # BEGIN SOLUTION 05.7: hook: if self.require_sync, b = self.bucket_of[id(p)], self.ready[b] += 1; when it equals len(self.buckets[b]), flat = torch.cat of the grads (reshape(-1)), self.pending[b] = (dist.all_reduce(flat, async_op=True), flat)
        def hook(param: torch.Tensor) -> None:
            if not self.require_sync:
                return
            b = self.bucket_of[id(param)]
            self.ready[b] += 1
            if self.ready[b] == len(self.buckets[b]):
                flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]])
                self.pending[b] = (dist.all_reduce(flat, async_op=True), flat)

        for bucket in self.buckets:
            for p in bucket:
                self.hook_handles.append(p.register_post_accumulate_grad_hook(hook))
        # END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Wait for each bucket, divide it, copy it back into the grads; reset for next step."""
        if not self.require_sync:
            return
        # BEGIN SOLUTION 05.8: raise RuntimeError if a bucket is missing from self.pending; else wait, divide flat, copy its slices into each p.grad (view_as); reset self.ready and self.pending
        missing = [self.names.get(id(p), "?") for b, bucket in enumerate(self.buckets)
                   if b not in self.pending for p in bucket if p.grad is None]
        if len(self.pending) != len(self.buckets):
            self.pending.clear()
            self.ready = [0] * len(self.buckets)
            raise RuntimeError(f"a bucket never became ready: parameters got no gradient in "
                               f"this step (unused in forward?): {missing}; every rank must "
                               f"use every trainable parameter")
        for b, (work, flat) in sorted(self.pending.items()):
            work.wait()
            flat.div_(self.world_size)
            offset = 0
            for p in self.buckets[b]:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p))
                offset += n
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
        # END SOLUTION
