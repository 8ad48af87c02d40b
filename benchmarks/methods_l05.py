"""Lesson 05's hand-written DDPs as benchmark methods (``solutions/05_ddp_from_scratch``).

Each returns ``(step, {"compute_step": fn})``: ``fn`` is the same step under ``no_sync()``,
so the harness can split a step into compute and communication, as it does for torch DDP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.registry import BenchContext, method
from dpt.lessons import load


def _methods(ctx: BenchContext, wrapper):
    model = wrapper(ctx.model().to(ctx.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = ctx.batch()

    def step() -> float:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.finish_gradient_synchronization()
        opt.step()
        return loss.item()

    def compute_only() -> float:
        with model.no_sync():
            return step()

    return step, {"compute_step": compute_only}


@method("ddp_naive", "lesson 05: hand-written DDP, all-reduce of every gradient after backward")
def ddp_naive(ctx: BenchContext):
    NaiveDDP = load("05_ddp_from_scratch", "naive_ddp", "solutions").NaiveDDP

    return _methods(ctx, NaiveDDP)


@method("ddp_overlap", "lesson 05: hand-written DDP, one async all-reduce per gradient from hooks")
def ddp_overlap(ctx: BenchContext):
    OverlapDDP = load("05_ddp_from_scratch", "overlap_ddp", "solutions").OverlapDDP

    return _methods(ctx, OverlapDDP)


@method("ddp_bucketed", "lesson 05: hand-written DDP, 25 MB buckets all-reduced from hooks")
def ddp_bucketed(ctx: BenchContext):
    BucketedDDP = load("05_ddp_from_scratch", "bucketed_ddp", "solutions").BucketedDDP

    cap = float(ctx.options.get("bucket_cap_mb", 25.0))
    return _methods(ctx, lambda m: BucketedDDP(m, bucket_cap_mb=cap))
