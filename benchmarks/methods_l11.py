"""Lesson 11's methods: torch DDP with synchronised batch norm, the hand-written one
(``convert_sync_by_hand``, tasks 11.3-11.5) and torch's ``nn.SyncBatchNorm`` (CUDA only: its
statistics kernels have no CPU version).

Both train the benchmark's model (``--model``; the default ConvNet has two batch norms) with
SGD on its synthetic batches, as ``ddp_spawn`` does, so their ratio to ``ddp_spawn`` at the
same N (``RATIO_PAIRS``) is what synchronising the statistics costs: one more all-reduce per
batch norm per forward, three numbers per channel. That all-reduce runs in the forward pass,
so the ``compute_step`` under ``no_sync()`` still contains it: the split into compute and
communication misses it, the ratio does not. Full run only (``quick=False``). What SyncBN
changes in training (accuracy at a small per-rank batch) is the lesson's tests' and
notebook's subject, not a timing.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from benchmarks.registry import BenchContext, ddp_steps, method
from dpt.lessons import load


def _ddp_of(ctx: BenchContext, model: torch.nn.Module):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DDP(model.to(ctx.device), device_ids=ids)
    step, extras = ddp_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9),
                             ctx.batch())
    if not any(isinstance(m, _BatchNorm) for m in model.modules()):
        extras["notes"] = [f"model {ctx.model_name!r} has no batch norm: nothing to synchronise"]
    return step, extras


@method("ddp_syncbn_by_hand", "lesson 11: torch DDP, batch norms replaced by the hand-written "
        "SyncBatchNormByHand (one all-reduce of sums per batch norm per forward)", quick=False)
def ddp_syncbn_by_hand(ctx: BenchContext):
    convert = load("11_time_to_accuracy", "sync_bn", "solutions").convert_sync_by_hand

    return _ddp_of(ctx, convert(ctx.model()))


@method("ddp_syncbn", "lesson 11: torch DDP with torch's nn.SyncBatchNorm", requires=("cuda",),
        quick=False)
def ddp_syncbn(ctx: BenchContext):
    return _ddp_of(ctx, torch.nn.SyncBatchNorm.convert_sync_batchnorm(ctx.model()))
