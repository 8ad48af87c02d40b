# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Step 4 of lesson 05: buckets, kept as torch DDP keeps them.

One all-reduce per parameter pays a fixed cost (latency) per call, and a model has many small
tensors (biases, norms). Torch DDP groups gradients into *buckets* of at most
``bucket_cap_mb`` megabytes (25 by default), in **reverse** order of registration, since
backward produces the last layer's gradients first. A megabyte here is 2**20 bytes, as in
torch DDP (whose first bucket is also capped at 1 MB; we skip that detail).

Each bucket owns one flat buffer, allocated **once**, at construction, with a view into it
per parameter (``self.views[b][i]`` has the shape of ``self.buckets[b][i]``). A gradient
reaches its bucket in one of two ways, as in torch DDP:

- **copy in** (``gradient_as_bucket_view=False``, torch DDP's default): when a gradient is
  ready, it is copied into its view; after the all-reduce the averaged view is copied back
  into ``.grad``. Two copies of every gradient per step, no allocation.
- **gradients as views** (``gradient_as_bucket_view=True``): each ``.grad`` *is* its view,
  so autograd accumulates straight into the bucket. No copy, no allocation, and the memory of
  one copy of the gradients saved. Only when ``.grad`` was replaced (``zero_grad()`` sets it
  to None by default, and the next backward allocates a fresh one) is the gradient copied in
  once and ``.grad`` pointed back at its view.

When every gradient of a bucket is in, the buffer itself is all-reduced asynchronously, one
call per bucket; ``finish_gradient_synchronization`` waits and divides. (Torch DDP divides
while copying in, saving a pass over the bucket; dividing after the wait keeps one rule for
both ways.) The alternative, a
new ``torch.cat`` of the gradients on every step, allocates a bucket-sized tensor per bucket
per step and still copies twice; ``benchmarks/bench_l05_bucket_buffers.py`` measures both.

- ``assign_buckets`` (task 05.6) decides the groups: a parameter larger than the cap gets a
  bucket of its own, and a cap larger than the model gives one bucket.
- the hooks (task 05.7) put each ready gradient in its bucket and launch full buckets;
- ``finish_gradient_synchronization`` (task 05.8) waits, divides and, when copying, copies
  back. A bucket that never became ready (a parameter unused in this step) raises a
  ``RuntimeError`` naming its parameters, rather than leaving ranks waiting for each other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from overlap_ddp import OverlapDDP
from torch import nn

MB = 2**20


def assign_buckets(params: list[torch.Tensor], bucket_cap_mb: float) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``bucket_cap_mb`` MB, last first.

    Every index appears exactly once. The first bucket starts at the last parameter; indices
    go down within and across buckets. A bucket is closed when the next parameter would take
    it past the cap, so only a parameter larger than the cap is ever alone over it.
    """
    cap = bucket_cap_mb * MB
    raise NotImplementedError("Task 05.6: walk the parameters from last to first, closing a bucket before it overflows")


class BucketedDDP(OverlapDDP):
    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0,
                 gradient_as_bucket_view: bool = False):
        self.bucket_cap_mb = bucket_cap_mb  # read by _register_hooks, which
        self.gradient_as_bucket_view = gradient_as_bucket_view  # OverlapDDP.__init__ calls
        super().__init__(module)
        # self.pending now holds (handle, bucket index) per launched bucket

    def _build_buckets(self) -> None:
        """Buckets of parameters, one flat buffer each (allocated here, once), views into it."""
        index = assign_buckets(self.params, self.bucket_cap_mb)
        self.buckets: list[list[nn.Parameter]] = [[self.params[i] for i in b] for b in index]
        self.bucket_buffers: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor]] = []
        self.bucket_of: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position)
        for b, bucket in enumerate(self.buckets):
            if len({(p.dtype, p.device) for p in bucket}) > 1:
                raise ValueError("a bucket would mix dtypes or devices; this lesson's buckets "
                                 "hold one (torch DDP also buckets by dtype and device)")
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype,
                               device=bucket[0].device)
            views, offset = [], 0
            for i, p in enumerate(bucket):
                views.append(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
                self.bucket_of[id(p)] = (b, i)
            self.bucket_buffers.append(flat)
            self.views.append(views)
        self.ready = [0] * len(self.buckets)  # gradients in the bucket so far, this step
        if self.gradient_as_bucket_view:
            for bucket, views in zip(self.buckets, self.views):
                for p, view in zip(bucket, views):
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view  # autograd accumulates into the bucket from now on

    def _register_hooks(self) -> None:
        """Build the buckets, then hook every bucketed parameter: when ``self.require_sync``
        is True and its gradient is ready, the gradient ends up in its view (copied, or as
        ``.grad`` itself with ``gradient_as_bucket_view``); the moment the last gradient of a
        bucket is in, one async all-reduce of that bucket's buffer is launched and recorded in
        ``self.pending`` as ``(handle, bucket index)``."""
        self._build_buckets()
        raise NotImplementedError("Task 05.7: put each ready gradient in its view; all-reduce a bucket's buffer once it is full")

    def finish_gradient_synchronization(self) -> None:
        """Once it returns, every ``.grad`` of ``self.params`` is the mean over the ranks (a
        view into its bucket when ``gradient_as_bucket_view``), ``self.pending`` is empty and
        ``self.ready`` is all zeros. A bucket that never launched raises a RuntimeError naming
        its parameters. Does nothing when ``self.require_sync`` is False."""
        if not self.require_sync:
            return
        raise NotImplementedError("Task 05.8: check every bucket launched; finish each, average it, give the grads their values; reset")
