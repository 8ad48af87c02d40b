"""Rank functions for lesson 11's sharded-norm tests (test_large_batch.py, tasks 11.12-11.14).

One run per world size does every check; each part comes back on its own
(:func:`tests.helpers.rank_part`), so a task is graded on its own. The parts that need other
tasks (11.13 needs LAMB's direction and the sharded norms) put the references in place, after
the parts that test those tasks themselves. Tensor sizes (35, 7, 35, 5) are multiples of
neither 2 nor 3, so every shard set is padded. Everything is float64 on the CPU (gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.helpers import rank_part
from tests.lessons import load
from tests.references import put

LESSON = "11_time_to_accuracy"
SIZES = ((7, 5), (7,), (5, 7), (5,))  # the shapes of Linear(5, 7) and Linear(7, 5)
STEPS = 20
LAMB_GROUPS = ({"weight_decay": 0.1, "max_weight_norm": 1.0},  # weights: clamped (norm ~1.4)
               {"weight_decay": 0.0, "max_weight_norm": 1.0})  # biases: no decay
LAMB_OPTS = {"lr": 0.02, "betas": (0.9, 0.99), "eps": 1e-6}


def tensors(seed: int) -> list[torch.Tensor]:
    """Tensors of :data:`SIZES`, the same on every rank (and in the test) for a seed."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SIZES]


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 5)).double()


def batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(12, 5, generator=gen, dtype=torch.float64),
            torch.randint(0, 5, (12,), generator=gen))


def loss_of(model, step):
    x, y = batch(step)
    return F.cross_entropy(model(x), y) * 1e-2  # small gradients: eps shows


def groups(params):
    """LAMB's groups over ``params`` (in SIZES order): matrices, then vectors."""
    mats = [p for p in params if p.dim() > 1]
    vecs = [p for p in params if p.dim() <= 1]
    return [{"params": mats, **LAMB_GROUPS[0]}, {"params": vecs, **LAMB_GROUPS[1]}]


# --- the parts -----------------------------------------------------------------------------------

def norms_part(lb, rank, world):
    """11.12 on :data:`SIZES`, counting the all-reduces it makes."""
    shards = [lb.shard_of(t, rank, world) for t in tensors(1)]
    real, calls = dist.all_reduce, []

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        norms = lb.shard_square_norms(shards, None)
    finally:
        dist.all_reduce = real
    return {"norms": [float(n) for n in norms], "calls": len(calls)}


def clip_part(lb, rank, world, factor):
    """11.14: clip this rank's gradient shards at ``factor`` times their total norm."""
    grads = tensors(2)
    total = torch.sqrt(sum((g ** 2).sum() for g in grads))
    shards = [lb.shard_of(g, rank, world) for g in grads]
    got = lb.sharded_clip_grad_norm_(shards, float(factor * total), None)
    return {"total": float(got), "shards": shards}


def train_sharded(lb):
    model = net()
    opt = lb.ShardedLAMB(groups(list(model.parameters())), **LAMB_OPTS)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
    state = sum(t.numel() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
                and t.dim() > 0)
    return [p.detach().clone() for p in model.parameters()], state


def train_plain(lb):
    model = net()
    opt = lb.LAMB(groups(list(model.parameters())), **LAMB_OPTS)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_local_trust(lb, world):
    """The mistake 11.13 must not make, computed here: each rank's shard of each tensor
    stepped by plain LAMB as a tensor of its own, so its trust ratio comes from the shard's
    norms (the padding zeros stay zero and add nothing)."""
    model = net()
    params = list(model.parameters())
    shards = [[nn.Parameter(lb.shard_of(p, r, world)) for r in range(world)] for p in params]
    # (shards are 1-D: each goes in the group of its tensor, by hand)
    opt = lb.LAMB([{"params": [s for p, ss in zip(params, shards) if p.dim() > 1 for s in ss],
                    **LAMB_GROUPS[0]},
                   {"params": [s for p, ss in zip(params, shards) if p.dim() <= 1 for s in ss],
                    **LAMB_GROUPS[1]}], **LAMB_OPTS)
    for step in range(STEPS):
        for p, ss in zip(params, shards):
            with torch.no_grad():
                p.copy_(torch.cat([s.detach() for s in ss])[:p.numel()].view_as(p))
        model.zero_grad()
        loss_of(model, step).backward()
        for p, ss in zip(params, shards):
            for r, s in enumerate(ss):
                s.grad = lb.shard_of(p.grad, r, world)
        opt.step()
    return [torch.cat([s.detach() for s in ss])[:p.numel()].view_as(p)
            for p, ss in zip(params, shards)]


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def lamb_part(lb, rank, world):
    """11.13 against LAMB (both with the references of 11.11 and 11.12 in place)."""
    sharded, state = train_sharded(lb)
    plain = train_plain(lb)
    local = train_local_trust(lb, world)
    return {"diff": max_diff(sharded, plain), "local_diff": max_diff(sharded, local),
            "local_vs_plain": max_diff(local, plain), "state": state,
            "shard_state": 2 * sum(-(-p.numel() // world) for p in plain)}


def sharded_checks(rank: int, world: int) -> dict:
    torch.set_default_dtype(torch.float32)
    lb = load(LESSON, "large_batch")
    out = {"norms": rank_part(norms_part, lb, rank, world),
           "clip_down": rank_part(clip_part, lb, rank, world, 1 / 3),
           "clip_up": rank_part(clip_part, lb, rank, world, 3.0)}
    put(LESSON, ("11.11", "11.12"))  # 11.13 alone is graded below
    out["lamb"] = rank_part(lamb_part, lb, rank, world)
    return out
