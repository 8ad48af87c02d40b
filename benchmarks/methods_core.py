"""Reference methods the harness itself provides.

- ``single``: lesson 01's loop on the fast path (whole dataset as tensors), one rank only.
- ``single_dataloader``: the loop of the 'Distributed data parallel training in PyTorch' tutorial: torchvision dataset, per-sample transform, DataLoader.
- ``independent``: N ranks each training its own model, no communication at all. The ceiling
  data parallelism could reach on this machine: whatever it loses to ideal is the hardware
  (cores, memory bandwidth), not communication.
- ``ddp_no_buffer_broadcast``: torch DDP without the per-forward broadcast of batch-norm buffers
  (``forward_sync_buffers=False`` from torch 2.15, ``broadcast_buffers=False`` before), to show
  what that broadcast costs.
"""

from __future__ import annotations

import inspect
import itertools

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.registry import BenchContext, ddp_steps, method, optimizer_step


def _real_batches(ctx: BenchContext, fast: bool):
    from dpt.data import make_loader, prepare

    prepare("fashion-mnist", quiet=True)
    loader = make_loader("fashion-mnist", train=True, batch_size=ctx.batch_size, fast=fast,
                         seed=ctx.seed)
    return (tuple(t.to(ctx.device) for t in b) for epoch in itertools.count()
            for b in loader)


@method("single", "one rank, lesson 01's loop over Fashion-MNIST held as tensors (fast path)",
        requires=("data",), max_procs=1)
def single(ctx: BenchContext):
    model = ctx.model().to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = _real_batches(ctx, fast=True)
    return lambda: optimizer_step(model, opt, next(batches))


@method("single_dataloader",
        "one rank, the loop of the 'Distributed data parallel training in PyTorch' tutorial: torchvision dataset + per-sample transform + DataLoader",
        requires=("data",), max_procs=1)
def single_dataloader(ctx: BenchContext):
    model = ctx.model().to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = _real_batches(ctx, fast=False)
    return lambda: optimizer_step(model, opt, next(batches))


@method("independent", "N ranks training separate models, no communication (the ceiling)")
def independent(ctx: BenchContext):
    model = ctx.model().to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = ctx.batch()
    return lambda: optimizer_step(model, opt, batch)


def no_forward_buffer_sync() -> dict:
    """DDP's keyword that turns off the buffer broadcast at every forward.

    torch 2.15 renamed ``broadcast_buffers`` to ``forward_sync_buffers`` and warns on the old
    name. The new one still syncs the buffers once at construction, which changes nothing
    here: every rank builds the model from the same seed.
    """
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


@method("ddp_no_buffer_broadcast",
        "torch DDP without the per-forward batch-norm buffer broadcast")
def ddp_no_buffer_broadcast(ctx: BenchContext):
    model = ctx.model().to(ctx.device)
    ddp = DDP(model, **no_forward_buffer_sync())
    return ddp_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), ctx.batch())
