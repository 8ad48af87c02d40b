"""Rank functions for lesson 10's three-rank tests (test_at_three_ranks.py).

At 2 ranks dividing by the world size is exact in any precision (a power of two), so a hook
that divides by 2, divides after the sum, or divides in fp32 gives torch's bits; a counter of
the bytes a ring puts on the link (2 (N - 1) / N of the payload) counts the payload; and the
hang clinic's 7 samples give rank 0 the most. Three ranks and lengths where rank 0 is not the
longest tell each of these apart.

Each part of a run comes back on its own (``{"error": ...}`` when it raised, the stub's "Task
10.K" line first), so a task is graded on its own; ``dist.all_reduce`` is put back after every
part, so a counter left in place cannot change the next one.
"""

from __future__ import annotations

import contextlib
import copy
import io

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dpt.dist import rank_device
from tests.helpers import rank_part
from tests.l10_inside_a_step import rank_fns_hooks as rf
from tests.lessons import load

LESSON = "10_inside_a_step"
# 10.13: the lengths each rank holds (rank 1 the longest, rank 0 not) and the dtypes of what
# is gathered (class ids, and the float32 the clinic's case uses)
GATHER_LENGTHS = (2, 5, 3)
GATHER_DTYPES = (torch.int64, torch.float32)


def part(fn, *args, **kwargs):
    """:func:`tests.helpers.rank_part`, with ``dist.all_reduce`` put back afterwards (a part
    may replace it to count or check what is sent)."""
    real = dist.all_reduce
    try:
        return rank_part(fn, *args, **kwargs)
    finally:
        dist.all_reduce = real


# --- hooks (10.8, 10.10) and the bucket recorder (10.6) -----------------------------------------

def _ddp_grads(rank, world_size, hook):
    """The gradients DDP leaves after one step under ``hook`` (attached by the reference)."""
    res = rf.train_steps(rank, world_size, hook, steps=1)
    return {"grads": res["grads"], "local": res["local_grads"]}


def _bucket_recorder(rank, world_size):
    """Two steps of a small eager DDP with task 10.6's hook, beside DDP's own all-reduce."""
    cd = load(LESSON, "compile_ddp")
    device = rank_device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    twin = copy.deepcopy(model)
    hooked, plain = DDP(model), DDP(twin)
    hooked.register_comm_hook(None, cd.BucketRecorder(model).hook)
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(5, 8, generator=g).to(device), torch.randn(5, 4, generator=g).to(device)
        for m in (hooked, plain):
            m.zero_grad(set_to_none=True)
            F.mse_loss(m(x), y).backward()
    local = copy.deepcopy(twin)  # this rank's own gradients of the last step, without DDP
    local.zero_grad(set_to_none=True)
    F.mse_loss(local(x), y).backward()
    return {name: [p.grad.detach().cpu().clone() for p in m.parameters()]
            for name, m in (("hooked", model), ("plain", twin), ("local", local))}


def hook_checks(rank, world_size):
    """Tasks 10.8, 10.10 and 10.6 on ``world_size`` ranks, each part on its own."""
    return {
        "counter": part(rf.counter_on_known_calls, rank, world_size),
        "bucket_mine": part(rf.hook_on_a_bucket, rank, world_size, "by_hand"),
        "bucket_torch": rf.hook_on_a_bucket(rank, world_size, "torch"),
        "ddp_mine": part(_ddp_grads, rank, world_size, "bf16_by_hand"),
        "ddp_torch": _ddp_grads(rank, world_size, "bf16"),
        "bucket_recorder": part(_bucket_recorder, rank, world_size),
    }


# --- the hang clinic (10.12, 10.13): one run each, as a broken fix of either may hang -----------

def gather_values(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s predictions: ``GATHER_LENGTHS[rank]`` values, none 0, distinct over
    the ranks."""
    n = GATHER_LENGTHS[rank]
    return (torch.arange(1, n + 1) + 10 * rank).to(dtype)


def gather_checks(rank, world_size):
    """Task 10.13's gather_predictions on lengths where rank 0 is not the longest, per dtype."""
    hc = load(LESSON, "hang_clinic")
    return {str(dtype): part(hc.gather_predictions, gather_values(rank, dtype), world_size)
            for dtype in GATHER_DTYPES}


def rank0_prints(rank, world_size):
    """Task 10.12's fix on every rank: what it returned and what it printed."""
    hc = load(LESSON, "hang_clinic")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = part(hc.rank0_fixed, rank, world_size)
    return {"result": result, "printed": out.getvalue()}
