"""Lesson 06's methods: torch DDP with autocast (bf16 anywhere, fp16 + GradScaler on CUDA).

Both time lesson 06's ``Trainer._run_batch``: lesson 03's Trainer (its model wrapped in DDP)
with forward and loss under ``torch.autocast`` and the rest in fp32, on one synthetic batch
that stays on the device (as every fp32 method does, so the comparison times the step and not
a host-to-device copy). Compare them with ``ddp_spawn`` (lesson 03's, fp32) at the same N.
``benchmarks/bench_l06_precision.py`` measures the fp32/bf16 ratio in one run.
"""

from __future__ import annotations

import torch

from benchmarks.registry import BenchContext, method
from dpt.lessons import load


def _amp_method(ctx: BenchContext, precision: str):
    Trainer = load("06_mixed_precision", "ddp_amp", "solutions").Trainer  # lesson 06

    model = ctx.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = Trainer(model, None, opt, ctx.device, precision=precision)  # wrapped in DDP
    x, y = ctx.batch()  # one batch, already on the device, as the fp32 methods time it

    def step() -> float:
        return trainer._run_batch(x, y)

    return step


@method("amp_bf16", "lesson 06's DDP Trainer with bf16 autocast for forward+loss, fp32 "
        "weights, no scaler", requires=("bf16",))
def amp_bf16(ctx: BenchContext):
    return _amp_method(ctx, "bf16")


@method("amp_fp16", "lesson 06's DDP Trainer with fp16 autocast + GradScaler (CUDA's AMP "
        "recipe)", requires=("cuda",))
def amp_fp16(ctx: BenchContext):
    return _amp_method(ctx, "fp16")
