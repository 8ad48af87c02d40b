"""Rank functions and shared data for lesson 13's streaming tests (test_streaming.py).

The model: ``BLOCKS`` = 6 blocks of ``Linear(6, 6)`` + ReLU (42 parameters each, 252 in all),
float64, so that every comparison holds to 1e-10. F = 3 fragments of 84 values, H = 6 inner
steps per round: one fragment every 2 steps, 24 steps = 4 rounds. Inner AdamW (lr 1e-2, weight
decay .01), outer Nesterov SGD (lr .7, momentum .9) per fragment, batches of 8 per rank from
seeded generators, computed alike by the ranks and by the test's one-process simulator.

One launch, three parts in this order, each on its own (``rank_part``); 13.1, 13.3 and 13.5
are the references throughout (those tasks are graded elsewhere):

- ``schedule``: the student's 13.6 on 3 ranks, ``sync_fragment`` replaced by a recorder (no
  collective): which fragment each rank syncs at which step;
- ``stream``: the student's 13.7 (13.6's reference): the weights after every step, the
  bytes of every collective, and each sync's effect on the other fragments' snapshots;
- ``diloco``: F = 1 against ``diloco.DiLoCo`` (references 13.2, 13.4, 13.6, 13.7): given code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import rank_part
from tests.lessons import load
from tests.references import put

LESSON = "13_local_sgd"
N = 3
BLOCKS = 6
WIDTH = 6
FRAGMENTS = 3
H = 6
STEPS = 24
PER_RANK = 8
INNER_LR, WEIGHT_DECAY = 1e-2, 0.01
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
                           for _ in range(BLOCKS)]).double()


def inner(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=INNER_LR, weight_decay=WEIGHT_DECAY)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    x = torch.randn(PER_RANK, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(PER_RANK, WIDTH, generator=g, dtype=torch.float64)


def inner_step(m: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    opt.zero_grad(set_to_none=True)
    F.mse_loss(m(x), y).backward()
    opt.step()


def flat_weights(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def _schedule(rank: int) -> dict:
    st = load(LESSON, "streaming")

    class Recorder(st.StreamingDiLoCo):
        def sync_fragment(self, p):
            self.seen.append((self.inner_steps, p))
            return 0

    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)  # nothing moves: only the schedule counts
    rec = Recorder(m, opt, H, FRAGMENTS)
    rec.seen = []
    with rec:
        for _step in range(2 * H):
            opt.step()
    return {"seen": rec.seen}


def _stream(rank: int) -> dict:
    st = load(LESSON, "streaming")
    ls = load(LESSON, "local_sgd")
    touched = []  # (step, p, q): fragment p's sync changed fragment q's snapshot

    class Watched(st.StreamingDiLoCo):
        def sync_fragment(self, p):
            before = [[s.clone() for s in snap] for snap in self.snapshots]
            sent = super().sync_fragment(p)
            for q, (old, new) in enumerate(zip(before, self.snapshots)):
                if q != p and not all(torch.equal(a, b) for a, b in zip(old, new)):
                    touched.append((self.inner_steps, p, q))
            return sent

    m = model()
    opt = inner(m)
    weights = []
    with ls.CommCounter() as counter, Watched(m, opt, H, FRAGMENTS, outer_lr=OUTER_LR,
                                               outer_momentum=OUTER_MOMENTUM) as stream:
        for step in range(STEPS):
            inner_step(m, opt, rank, step)
            weights.append(flat_weights(m))
    return {"weights": torch.stack(weights), "records": [(op, str(dt), b) for op, dt, b
                                                        in counter.records],
            "peak": counter.peak, "bytes": counter.bytes, "history": stream.history,
            "touched": touched}


def _diloco(rank: int) -> dict:
    st = load(LESSON, "streaming")
    dl = load(LESSON, "diloco")
    out = {}
    for kind in ("streaming", "diloco"):
        m = model()
        opt = inner(m)
        if kind == "streaming":
            sync = st.StreamingDiLoCo(m, opt, H, 1, outer_lr=OUTER_LR,
                                      outer_momentum=OUTER_MOMENTUM)
        else:
            outer = torch.optim.SGD(m.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                                    nesterov=True)
            sync = dl.DiLoCo(m, opt, H, outer_optimizer=outer)
        with sync:
            for step in range(STEPS):
                inner_step(m, opt, rank, step)
        out[kind] = flat_weights(m)
    return out


def streaming_checks(rank: int, world_size: int) -> dict:
    put(LESSON, ("13.1", "13.3", "13.5"))
    out = {"schedule": rank_part(_schedule, rank)}
    put(LESSON, ("13.6",))
    out["stream"] = rank_part(_stream, rank)
    put(LESSON, ("13.2", "13.4", "13.7"))
    out["diloco"] = rank_part(_diloco, rank)
    return out
