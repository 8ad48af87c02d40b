"""Rank functions, data and one-process simulators for lesson 13's LocalSGD and DiLoCo tests
(test_local_sgd.py, test_diloco.py).

The model is ``S = Sequential(Linear(10, 7), ReLU, Linear(7, 3))`` in float64 (P = 101
parameters in 4 tensors), the same initial weights on every rank; rank r's batch at step t is
8 samples drawn from a generator seeded by (seed, r, t), so the test's simulators, which run
the N replicas one after the other in ONE process with no collective, see the same batches.
Every comparison is to 1e-10.

A test grades one task: a part runs the student's code of that task and the reference of the
others (``tests.references``), put in place for that part only (:func:`using`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import rank_part
from tests.lessons import load
from tests.references import put

LESSON = "13_local_sgd"
N = 3
PER_RANK = 8
LR = 0.1
H1_STEPS = 50  # LocalSGD at H = 1 against DDP
BYTES_STEPS = 60  # divisible by 1, 4 and 6, not by 5 or 7: an off-by-one changes the count
BYTES_HS = (1, 4, 6)
SPY_H, SPY_STEPS = 4, 12
DILOCO_H1_STEPS = 30
DILOCO_H, DILOCO_ROUNDS = 5, 4
ADAM_LR, ADAM_WD = 1e-2, 0.01
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


# --- shared by the ranks and the simulators ---------------------------------------------------

def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3)).double()


def batch(rank: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_000 * (seed + 1) + 1000 * rank + step)
    return (torch.randn(PER_RANK, 10, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (PER_RANK,), generator=g))


def loss(net: nn.Module, rank: int, step: int, seed: int = 0) -> torch.Tensor:
    x, y = batch(rank, step, seed)
    return F.cross_entropy(net(x), y)


def flat_params(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


def inner_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=ADAM_LR, weight_decay=ADAM_WD)
    raise ValueError(kind)


def hand_tensors(rank: int) -> list[torch.Tensor]:
    """Three float64 tensors of odd shapes, different on every rank (13.1's direct check)."""
    g = torch.Generator().manual_seed(77 + rank)
    return [(rank + 1) * torch.randn(shape, generator=g, dtype=torch.float64)
            for shape in ((3, 4), (5,), (2, 1, 3))]


@contextlib.contextmanager
def using(tasks):
    """The references of ``tasks`` in place of the student's code, for the ``with`` only."""
    saved = []

    def set_attr(obj, attr, value):
        saved.append((obj, attr, obj.__dict__[attr] if isinstance(obj, type)
                      else getattr(obj, attr)))
        setattr(obj, attr, value)

    put(LESSON, tasks, set_attr)
    try:
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


def train(sync_factory, steps: int, rank: int, opt_kind: str, seed: int = 0, record=None,
          counter=None) -> nn.Module:
    """``steps`` steps of S on this rank's batches under the periodic sync ``sync_factory``
    builds from (model, optimizer); ``record(net, step)`` after each step (1-based)."""
    net = model()
    opt = inner_optimizer(opt_kind, net.parameters())
    sync = sync_factory(net, opt)
    with sync, counter or contextlib.nullcontext():
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss(net, rank, step, seed).backward()
            opt.step()
            if record is not None:
                record(net, step + 1, sync)
    return net


# --- the parts: LocalSGD (13.1, 13.2) --------------------------------------------------------------

def average_part(rank: int, world_size: int) -> dict:
    """13.1 alone: average_ of three tensors; its return value and the collectives it made."""
    ls = load(LESSON, "local_sgd")
    tensors = hand_tensors(rank)
    with ls.CommCounter() as counter:
        sent = ls.average_(tensors)
    return {"tensors": tensors, "sent": sent, "records": counter.records}


def h1_part(rank: int, world_size: int, opt_kind: str) -> dict:
    """LocalSGD at H = 1; the weights after every step."""
    ls = load(LESSON, "local_sgd")
    history = []
    train(lambda net, opt: ls.LocalSGD(net, opt, 1), H1_STEPS, rank, opt_kind,
          record=lambda net, step, sync: history.append(flat_params(net)))
    return {"history": history}


def bytes_part(rank: int, world_size: int) -> dict:
    """LocalSGD at each H of BYTES_HS for BYTES_STEPS steps, counted; and SPY_STEPS steps at
    SPY_H with the weights after every step (the test finds the steps the ranks agree at)."""
    ls = load(LESSON, "local_sgd")
    out = {"counts": {}}
    for h in BYTES_HS:
        counter = ls.CommCounter()
        train(lambda net, opt, h=h: ls.LocalSGD(net, opt, h), BYTES_STEPS, rank, "sgd",
              counter=counter)
        out["counts"][h] = {"calls": counter.calls, "bytes": counter.bytes}
    history = []
    train(lambda net, opt: ls.LocalSGD(net, opt, SPY_H), SPY_STEPS, rank, "sgd", seed=1,
          record=lambda net, step, sync: history.append(flat_params(net)))
    out["history"] = history
    return out


def local_sgd_checks(rank: int, world_size: int) -> dict:
    res = {"average": rank_part(average_part, rank, world_size)}
    with using(["13.2"]):
        res["h1"] = rank_part(h1_part, rank, world_size, "sgd")
    with using(["13.1"]):
        res["bytes"] = rank_part(bytes_part, rank, world_size)
    with using(["13.1", "13.2"]):
        res["momentum"] = rank_part(h1_part, rank, world_size, "momentum")
        res["adamw"] = rank_part(h1_part, rank, world_size, "adamw")
    return res


# --- the parts: DiLoCo (13.4; 13.3 is checked in the test's own process) ----------------------------

def diloco_h1_part(rank: int, world_size: int) -> dict:
    """DiLoCo at H = 1, inner SGD(lr LR), outer SGD(lr 1, no momentum): the weights after
    every step."""
    dl = load(LESSON, "diloco")
    history = []

    def factory(net, opt):
        return dl.DiLoCo(net, opt, 1, outer_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))

    train(factory, DILOCO_H1_STEPS, rank, "sgd",
          record=lambda net, step, sync: history.append(flat_params(net)))
    return {"history": history}


def diloco_part(rank: int, world_size: int) -> dict:
    """DiLoCo at H = DILOCO_H, inner AdamW, outer Nesterov SGD, DILOCO_ROUNDS rounds: after
    every round, the weights and the outer momentum buffers."""
    dl = load(LESSON, "diloco")
    rounds = []

    def factory(net, opt):
        outer = torch.optim.SGD(net.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                                nesterov=True)
        return dl.DiLoCo(net, opt, DILOCO_H, outer_optimizer=outer)

    def record(net, step, sync):
        if step % DILOCO_H == 0:
            state = sync.outer_optimizer.state
            momentum = [state[p]["momentum_buffer"].clone() if "momentum_buffer" in state[p]
                        else None for p in net.parameters()]
            rounds.append({"weights": flat_params(net), "momentum": momentum})

    train(factory, DILOCO_H * DILOCO_ROUNDS, rank, "adamw", seed=2, record=record)
    return {"rounds": rounds}


def diloco_checks(rank: int, world_size: int) -> dict:
    with using(["13.1", "13.2", "13.3"]):
        return {"h1": rank_part(diloco_h1_part, rank, world_size),
                "rounds": rank_part(diloco_part, rank, world_size)}


# --- the simulators (the test's process, no collectives) -----------------------------------------

def ddp_history(steps: int, opt_kind: str, n: int = N, seed: int = 0) -> list[torch.Tensor]:
    """DDP by hand: one model, its gradient the mean of the n ranks' gradients."""
    net = model()
    opt = inner_optimizer(opt_kind, net.parameters())
    history = []
    for step in range(steps):
        grads = [torch.autograd.grad(loss(net, r, step, seed), list(net.parameters()))
                 for r in range(n)]
        for i, p in enumerate(net.parameters()):
            p.grad = sum(g[i] for g in grads) / n
        opt.step()
        history.append(flat_params(net))
    return history


def diloco_rounds(h: int, rounds: int, inner: str, outer_lr: float, outer_momentum: float,
                  n: int = N, seed: int = 0, restore: bool = True,
                  snapshot_after: bool = True) -> list[torch.Tensor]:
    """DiLoCo by hand: n replicas (own model, own inner optimizer) one after the other; per
    round Δ_r = snapshot − θ_r, Δ̄ their mean, one outer SGD step on the snapshot's copy.
    Returns every replica's weights after each round, stacked (n, P).

    ``restore=False`` applies the outer step to each replica's own weights (not the
    snapshot), ``snapshot_after=False`` keeps the snapshot taken before the outer step:
    the two classic mistakes, so a test can name the one it sees."""
    replicas = [model() for _ in range(n)]
    opts = [inner_optimizer(inner, r.parameters()) for r in replicas]
    snapshots = [flat_params(replicas[0])] * n
    buf = None
    out = []
    for k in range(rounds):
        for r, (net, opt) in enumerate(zip(replicas, opts)):
            for step in range(k * h, (k + 1) * h):
                opt.zero_grad(set_to_none=True)
                loss(net, r, step, seed).backward()
                opt.step()
        local = [flat_params(net) for net in replicas]
        delta = sum(s - w for s, w in zip(snapshots, local)) / n
        if outer_momentum:
            buf = delta.clone() if buf is None else outer_momentum * buf + delta
            update = delta + outer_momentum * buf  # Nesterov, as torch's SGD
        else:
            update = delta
        new = [b - outer_lr * update for b in (snapshots if restore else local)]
        if snapshot_after:
            snapshots = new
        for net, w in zip(replicas, new):
            set_flat(net, w)
        out.append(torch.stack(new))
    return out


def set_flat(net: nn.Module, values: torch.Tensor) -> None:
    with torch.no_grad():
        start = 0
        for p in net.parameters():
            p.copy_(values[start:start + p.numel()].view_as(p))
            start += p.numel()
