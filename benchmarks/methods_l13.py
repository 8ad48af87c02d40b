"""Lesson 13's methods: data parallel that synchronises once every H = 8 steps.

- ``local_sgd_h8``: LocalSGD (tasks 13.1-13.2), SGD (lr 0.01, momentum 0.9) as ``ddp_spawn``
  trains, the parameters averaged every 8 steps;
- ``diloco_h8``: DiLoCo (13.3-13.4), AdamW inside (lr 1e-3), SGD with Nesterov momentum
  (lr 0.7, momentum 0.9) outside, on the pseudo-gradients averaged every 8 steps;
- ``diloco_h8_int8``: the same, the pseudo-gradients sent as int8 with a scale per block of
  256 (13.9-13.10: gathered, then averaged in fp32).

A step of the registry is one optimizer step, so a method whose sync comes every H steps
times a *round* (H inner steps, then the sync) per call and says so with the extras key
``inner_steps`` (``benchmarks/run.py`` divides by H); its ``compute_step`` is the same round
with the sync's hook removed, so the difference is the sync's cost spread over the round. Each
is paired with ``ddp_spawn`` at the same N (``RATIO_PAIRS``): on this machine's shared memory
the all-reduce is cheap, so the ratio is mostly what fewer collectives save in latency and
waiting; what a slow network makes of it is the lesson's projection
(``local_steps_sweep.py``). H = 8, not more: a round of the ConvNet at batch 256 takes
seconds on a CPU, and warm-up and repeats must fit the full run. Full run only
(``quick=False``).
"""

from __future__ import annotations

import torch

from benchmarks.registry import BenchContext, method, optimizer_step
from dpt.lessons import load

LESSON = "13_local_sgd"
H = 8


def _rounds(ctx: BenchContext, model, optimizer, sync):
    """The round (H steps with the sync's hook on) and the same round without the sync."""
    batch = ctx.batch()

    def round_() -> float:
        for _ in range(H):
            loss = optimizer_step(model, optimizer, batch)
        return loss

    def compute_only() -> float:
        sync.__exit__(None, None, None)  # the hook removed: H local steps, no sync
        try:
            return round_()
        finally:
            sync.__enter__()

    sync.__enter__()
    return round_, {"inner_steps": H, "compute_step": compute_only}


@method("local_sgd_h8", f"lesson 13: LocalSGD, SGD on each rank, parameters averaged every "
        f"{H} steps (one all-reduce of one flat buffer)", quick=False)
def local_sgd_h8(ctx: BenchContext):
    lesson = load(LESSON, "local_sgd", "solutions")
    model = ctx.model().to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return _rounds(ctx, model, opt, lesson.LocalSGD(model, opt, sync_every=H))


def _diloco(ctx: BenchContext, diloco_class):
    model = ctx.model().to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _rounds(ctx, model, opt, diloco_class(model, opt, sync_every=H))


@method("diloco_h8", f"lesson 13: DiLoCo, AdamW inside, Nesterov SGD outside on the "
        f"pseudo-gradients averaged every {H} steps", quick=False)
def diloco_h8(ctx: BenchContext):
    return _diloco(ctx, load(LESSON, "diloco", "solutions").DiLoCo)


@method("diloco_h8_int8", f"lesson 13: DiLoCo every {H} steps, the pseudo-gradients sent as "
        "int8 with a scale per block of 256 (gathered, averaged in fp32)", quick=False)
def diloco_h8_int8(ctx: BenchContext):
    diloco = load(LESSON, "diloco", "solutions")
    compress = load(LESSON, "compress", "solutions")
    local_sgd = load(LESSON, "local_sgd", "solutions")

    class Int8DiLoCo(diloco.DiLoCo):
        """DiLoCo whose sync averages with 13.10's int8 path instead of 13.1's fp32 one."""

        def sync(self) -> int:
            fp32 = local_sgd.average_
            local_sgd.average_ = lambda tensors, group=None: compress.average_int8_(tensors,
                                                                                    group)
            try:
                return super().sync()
            finally:
                local_sgd.average_ = fp32

    return _diloco(ctx, Int8DiLoCo)
