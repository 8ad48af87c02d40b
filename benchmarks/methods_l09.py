"""Lesson 09's methods, both with mixed precision: the hand-written FSDP (bf16 compute and
gathers over fp32 master shards, gradients reduced in fp32) and FSDP2 with a bf16
``MixedPrecisionPolicy``, meta-device initialisation and explicit prefetch.

The 16-bit format follows the course's rule (``dpt.precision.low_precision_for``): on a GPU
of compute capability below 8 (a T4, a V100) bf16 is emulated, so the hand-written FSDP
computes in fp16 there, and its record says so in a note. FSDP2 runs the policy task 09.17
writes (bf16 params, fp32 reduce) with its 16-bit format swapped the same way there
(:func:`sixteen_bit_policy`), noted too. Neither scales the loss: these are timings of a
step, not training runs (fp16 training would need a gradient scaler).

Both train lesson 09's ``TinyTransformer`` (4 blocks of width 128, 64 tokens; about 0.9 M
parameters) on synthetic tokens with AdamW, whatever ``--model`` says: its blocks are the
units FSDP gathers one at a time, and the convnet's batch norm has no bf16 kernel on the CPU.
So compare these two with each other, and each with itself from 1 to N ranks, not with the
convnet methods. Two methods only: ``--quick`` on 8 GPUs is planned to fit 5 minutes, and
every method costs two launches there. Peak memory per method: ``bench_l09_memory.py``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.registry import BenchContext, method
from dpt.lessons import load

CONFIG = {"vocab": 256, "dim": 128, "heads": 4, "layers": 4, "seq_len": 64}
LR = 1e-3


def _model(ctx: BenchContext) -> torch.nn.Module:
    from dpt.models import TinyTransformer

    torch.manual_seed(ctx.seed)  # the same initial weights on every rank
    return TinyTransformer(**CONFIG).to(ctx.device)


def _tokens(ctx: BenchContext):
    from dpt.models import token_batch

    return token_batch(ctx.batch_size, CONFIG["seq_len"], CONFIG["vocab"],
                       seed=ctx.seed * 100003 + ctx.rank, device=ctx.device)


def _step_flops(per_rank_batch: int) -> int:
    """The TinyTransformer's model FLOPs of one step at this batch (for the methods' MFU),
    counted on the meta device like the harness's own model."""
    from dpt.flops import step_flops
    from dpt.models import TinyTransformer, token_batch

    x, _ = token_batch(per_rank_batch, CONFIG["seq_len"], CONFIG["vocab"], seed=0)
    return step_flops(TinyTransformer(**CONFIG).to("meta"), x.to("meta"))


FLOPS = {"step_flops": _step_flops, "flops_model": "TinyTransformer"}


def _needs_group(name: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{name} needs a process group (the harness makes one)")


def _step(model, opt, batch, after_backward=None):
    x, y = batch

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        return loss.item()

    return step


def _notes(ctx: BenchContext, notes: list[str]) -> dict:
    """What a method adds to its record: rank 0's notes (the harness collects every rank's)."""
    return {"notes": notes} if ctx.rank == 0 and notes else {}


def compute_format(device: torch.device | str) -> tuple[torch.dtype, list[str]]:
    """The hand-written FSDP's 16-bit compute dtype on ``device`` by the course's rule, and
    the note its record carries when that is not the bf16 of the method's name."""
    from dpt.precision import DTYPES, low_precision_for

    name = low_precision_for(device)
    notes = [] if name == "bf16" else [
        f"computed in {name}, not bf16: bf16 is emulated on this GPU (compute capability "
        "below 8; dpt.precision.low_precision_for)"]
    return DTYPES[name], notes


def _hand_fsdp(ctx: BenchContext):
    FSDP = load("09_fsdp", "fsdp_by_hand", "solutions").FSDP

    _needs_group("the hand-written FSDP")
    compute_dtype, notes = compute_format(ctx.device)
    fsdp = FSDP(_model(ctx), compute_dtype=compute_dtype)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=LR)
    return (_step(fsdp, opt, _tokens(ctx), after_backward=fsdp.finish_grad_sync),
            _notes(ctx, notes))


@method("fsdp_by_hand_bf16", "lesson 09's FSDP by hand, bf16 compute and gathers (fp16 on a "
        "GPU of compute capability below 8, noted), fp32 master shards and gradient reduction",
        requires=("bf16",), **FLOPS)
def fsdp_by_hand_bf16(ctx: BenchContext):
    return _hand_fsdp(ctx)


@contextlib.contextmanager
def sixteen_bit_policy(dtype: torch.dtype):
    """While building, task 09.17's bf16 ``MixedPrecisionPolicy`` computes in ``dtype`` instead.

    The student's recipe stays as written (bf16 params, fp32 reduce); only the 16-bit format
    follows the course's rule, as the hand-written FSDP's does. The swap wraps the lesson's
    module from outside, for the duration of the build only.
    """
    fsdp2_practice = load("09_fsdp", "fsdp2_practice", "solutions")

    made = fsdp2_practice.MixedPrecisionPolicy
    if dtype == torch.bfloat16:
        yield
        return

    def policy(*args, **kwargs):
        if kwargs.get("param_dtype") == torch.bfloat16:
            kwargs["param_dtype"] = dtype
        return made(*args, **kwargs)

    fsdp2_practice.MixedPrecisionPolicy = policy
    try:
        yield
    finally:
        fsdp2_practice.MixedPrecisionPolicy = made


@method("fsdp2_bf16", "FSDP2 fully_shard per block, MixedPrecisionPolicy(bf16 params, fp32 "
        "reduce; fp16 params on a GPU of compute capability below 8, noted), explicit "
        "prefetch, meta-device init", requires=("bf16",), **FLOPS)
def fsdp2_bf16(ctx: BenchContext):
    build_sharded = load("09_fsdp", "fsdp2_practice", "solutions").build_sharded

    _needs_group("fsdp2_bf16")
    compute_dtype, notes = compute_format(ctx.device)
    with sixteen_bit_policy(compute_dtype):
        model = build_sharded(seed=ctx.seed, bf16=True, config=CONFIG)
    return (_step(model, torch.optim.AdamW(model.parameters(), lr=LR), _tokens(ctx)),
            _notes(ctx, notes))
