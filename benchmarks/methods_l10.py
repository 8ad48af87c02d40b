"""Lesson 10's methods: torch DDP with the model compiled first (``DDP(torch.compile(m))``, as
nanoGPT does), and torch DDP sending compressed gradients through a communication hook (the
bf16 hook written in lesson 10, and PowerSGD).

All three train the benchmark's model (``--model``) on its synthetic batches with SGD, as
``ddp_spawn`` does, so each compares with ``ddp_spawn`` at the same N: that ratio is what
compiling, or sending half (bf16) or a low-rank sketch (PowerSGD) of the gradients, buys or
costs here. They are in the full run only (``quick=False``): ``--quick`` must fit 5 minutes on
8 GPUs, and a compiled method's first launch compiles for minutes on a CPU (inductor caches
the code on disk, so later launches are quicker). Accuracy after a fixed number of epochs, and
bytes per step, with their intervals over seeds: ``bench_l10_comm_hooks.py``.
"""

from __future__ import annotations

import torch

from benchmarks.registry import BenchContext, ddp_steps, method
from dpt.lessons import load

POWERSGD = {"rank": 2, "start_iter": 2, "error_feedback": True}  # compressed from step 2 on


def _ddp(ctx: BenchContext):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = ctx.model().to(ctx.device)
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(model, device_ids=ids)


def _timed(ctx: BenchContext, ddp):
    return ddp_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), ctx.batch())


@method("ddp_compiled", "lesson 10: torch DDP around torch.compile(model) (inductor); the "
        "graph split at DDP's buckets", requires=("compiler",), quick=False)
def ddp_compiled(ctx: BenchContext):
    build_compiled_ddp = load("10_inside_a_step", "compile_ddp", "solutions").build_compiled_ddp

    # a module on one device needs no device_ids: DDP uses the device its parameters are on
    return _timed(ctx, build_compiled_ddp(ctx.model().to(ctx.device), backend="inductor"))


@method("ddp_bf16_hook", "lesson 10: torch DDP with the bf16 compression hook written by hand "
        "(half the bytes on the wire)", quick=False)
def ddp_bf16_hook(ctx: BenchContext):
    attach_hook = load("10_inside_a_step", "comm_hooks", "solutions").attach_hook

    ddp = _ddp(ctx)
    attach_hook(ddp, "bf16_by_hand")
    return _timed(ctx, ddp)


@method("ddp_powersgd", f"lesson 10: torch DDP with PowerSGD (rank {POWERSGD['rank']}, error "
        f"feedback, compressed from step {POWERSGD['start_iter']})", quick=False)
def ddp_powersgd(ctx: BenchContext):
    attach_hook = load("10_inside_a_step", "comm_hooks", "solutions").attach_hook

    ddp = _ddp(ctx)
    attach_hook(ddp, "powersgd", **POWERSGD)
    return _timed(ctx, ddp)
