"""Rank functions and shared data for lesson 11's global-batch tests (test_global_batch.py).

A tiny model (Linear(10, 7), ReLU, Linear(7, 3)) trained ``STEPS`` steps on global batches of
``GLOBAL`` random rows, the same in every process: under DDP on ``N`` ranks with 1 and with
``ACCUM`` micro-batches per rank, with SGD and with AdamW. A communication hook counts the
all-reduces (one bucket: one per synchronised backward) and a step post-hook the optimizer
steps, both per global batch. Task 11.1's reference cuts the batches, so the runs grade 11.2
alone; each run comes back on its own (``tests.helpers.rank_part``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import rank_part
from tests.lessons import load
from tests.references import put

LESSON = "11_time_to_accuracy"
N = 2
STEPS = 5
GLOBAL = 8
ACCUM = 2
OPTIMIZERS = ("sgd", "adamw")


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3))


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(GLOBAL, 10, generator=g), torch.randint(0, 3, (GLOBAL,), generator=g))
            for _ in range(STEPS)]


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in model.parameters()]


def ddp_run(rank: int, world_size: int, optimizer: str, accum: int) -> dict:
    """``STEPS`` steps of the lesson's accumulation_step under DDP: final weights, and the
    all-reduces and optimizer steps of each global batch."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    gb = load(LESSON, "global_batch")
    model = tiny_model()
    ddp = DDP(model)
    counts = {"all_reduces": 0, "steps": 0}

    def counting_hook(state, bucket):
        counts["all_reduces"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    opt = make_optimizer(optimizer, ddp.parameters())
    opt.register_step_post_hook(lambda *_: counts.__setitem__("steps", counts["steps"] + 1))
    per_step = []
    for x, y in global_batches():
        before = dict(counts)
        micro = gb.micro_batches(x, y, rank, world_size, accum)
        gb.accumulation_step(ddp, opt, micro, F.cross_entropy)
        per_step.append({k: counts[k] - before[k] for k in counts})
    return {"params": params_of(model), "per_step": per_step}


def accumulation_checks(rank: int, world_size: int) -> dict:
    """Task 11.2 under DDP: every optimizer, 1 and ``ACCUM`` micro-batches per rank."""
    put(LESSON, ["11.1"])
    return {f"{opt} x{accum}": rank_part(ddp_run, rank, world_size, opt, accum)
            for opt in OPTIMIZERS for accum in (1, ACCUM)}
