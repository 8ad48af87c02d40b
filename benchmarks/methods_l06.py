"""Lesson 06's methods: torch DDP with autocast (bf16 anywhere, fp16 + GradScaler on CUDA).

Both wrap the model in DDP when there is more than one rank (the plain model otherwise), run
forward and loss under ``torch.autocast`` and the rest in fp32, through lesson 06's
``amp_train_step``, on one synthetic batch that stays on the device (as every fp32 method
does, so the comparison times the step and not a host-to-device copy). Compare them with
``ddp_spawn`` (fp32) at the same N.
``benchmarks/bench_l06_precision.py`` measures the fp32/bf16 ratio in one run.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.registry import BenchContext, method


def _amp_method(ctx: BenchContext, dtype: torch.dtype, use_scaler: bool):
    from amp_train import amp_train_step, make_scaler  # lesson 06, on sys.path via load_all

    model = ctx.model().to(ctx.device)
    if ctx.world_size > 1:
        model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = make_scaler(ctx.device, use_scaler)
    batch = ctx.batch()  # one batch, already on the device, as the fp32 methods time it

    def step() -> float:
        out = amp_train_step(model, batch, opt, ctx.device, dtype, scaler)
        return out["loss"]

    return step


@method("amp_bf16", "DDP (or one rank) with bf16 autocast for forward+loss, fp32 weights, "
        "no scaler")
def amp_bf16(ctx: BenchContext):
    return _amp_method(ctx, torch.bfloat16, use_scaler=False)


@method("amp_fp16", "DDP (or one rank) with fp16 autocast + GradScaler (CUDA's AMP recipe)",
        requires=("cuda",))
def amp_fp16(ctx: BenchContext):
    return _amp_method(ctx, torch.float16, use_scaler=True)
