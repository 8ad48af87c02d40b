"""Lesson 08's methods: the hand-written ZeRO-1 optimizer and FSDP2, both with Adam.

``ddp_adam`` is their baseline (torch DDP with a plain Adam), so the three differ only in
how the model state is sharded. Peak memory and the accounting: ``bench_l08_memory.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.registry import BenchContext, method, optimizer_step
from dpt.lessons import load

LR = 1e-3


def _ddp(model):
    return DDP(model) if dist.is_initialized() and dist.get_world_size() > 1 else model


@method("ddp_adam", "torch DDP + plain Adam: every rank holds all parameters, grads, state")
def ddp_adam(ctx: BenchContext):
    model = _ddp(ctx.model().to(ctx.device))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    batch = ctx.batch()
    return lambda: optimizer_step(model, opt, batch)


@method("sharded_optimizer",
        "lesson 08's ZeRO-1 by hand: DDP + Adam state sharded, owners broadcast params")
def sharded_optimizer(ctx: BenchContext):
    ShardedOptimizer = load("08_sharding", "zero_optimizer", "solutions").ShardedOptimizer

    if not dist.is_initialized():
        raise RuntimeError("sharded_optimizer needs a process group (the harness makes one)")
    model = _ddp(ctx.model().to(ctx.device))
    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=LR)
    batch = ctx.batch()
    return lambda: optimizer_step(model, opt, batch)


@method("fsdp2", "FSDP2 fully_shard per block then root: params, grads and Adam state 1/N")
def fsdp2(ctx: BenchContext):
    shard_model = load("08_sharding", "fsdp2_train", "solutions").shard_model

    if not dist.is_initialized():
        raise RuntimeError("fsdp2 needs a process group (the harness makes one)")
    model = shard_model(ctx.model().to(ctx.device))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    batch = ctx.batch()
    return lambda: optimizer_step(model, opt, batch)
