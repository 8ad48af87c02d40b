"""Lesson 13: DiLoCo, LocalSGD with an optimizer on the averaged drift.

LocalSGD (``local_sgd.py``) replaces the weights by their average every H steps. DiLoCo
(Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105) treats what the ranks learned in those H *inner* steps as a gradient and
gives it to a second, *outer* optimizer. With θ the weights every rank held at the start of
the round (the snapshot) and θ_r rank r's weights after its H inner steps::

    Δ_r = θ − θ_r                    the pseudo-gradient (a step of lr 1 along −Δ_r lands on θ_r)
    Δ̄  = (1/N) Σ_r Δ_r              one all-reduce of P values per round, as LocalSGD
    θ  ← OuterOpt(θ, grad = Δ̄)      every rank starts from the snapshot θ, not from θ_r
    every rank: θ_r ← θ, new snapshot θ

With an outer SGD of lr 1 and no momentum this is LocalSGD exactly: θ − Δ̄ is the average of
the θ_r. The paper's outer optimizer is SGD with Nesterov momentum (lr 0.7, momentum 0.9; the
same defaults as OpenDiLoCo, arXiv 2407.07852, and torchft's DiLoCo trainer), the inner one
AdamW, with H = 500 inner steps: "communicating 500 times less" than DDP, at about the same
loss for its language models. The outer momentum carries what the previous rounds agreed on.

No communication for the outer optimizer's state: every rank steps it on the SAME Δ̄ from the
SAME θ, so its momentum buffers stay identical on every rank (bitwise) without ever being
sent. Step it on a rank's own Δ_r instead, and the ranks' outer states drift apart for good.
The inner optimizer's state (AdamW's moments) stays each rank's own, as in LocalSGD.

torchft's ``torchft.local_sgd.DiLoCo`` does the same (per fragment of the model, the snapshot
kept on the CPU as ``original_parameters``, Δ all-reduced then ``p.grad = Δ̄`` and
``outer_optimizer.step()``), and adds fault tolerance (a quorum before each sync, the
snapshot and outer state sent to a joining replica); ``streaming.py`` adds the fragments.

Your tasks:

- 13.3 :func:`pseudo_gradients`: Δ = snapshot − current weights, as new tensors;
- 13.4 :meth:`DiLoCo.sync`: the outer step on the averaged Δ, and the new snapshot.

Given: :class:`DiLoCo`'s constructor (the snapshot, the default outer Nesterov SGD), and the
CLI: on ``--nproc`` ranks it checks DiLoCo with outer SGD(lr 1) at H = 1 against DDP, then
trains the MLP with AdamW inner steps under DDP, LocalSGD and DiLoCo at H = 16 and prints the
loss, the bytes and whether the outer momentum is the same on every rank::

    .venv/bin/python solutions/13_local_sgd/diloco.py --nproc 3
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import sys
import time
from collections.abc import Sequence

import local_sgd
import torch
import torch.distributed as dist
from local_sgd import CommCounter, LocalSGD, PeriodicSync
from torch import nn

from dpt.cli import check_averaging_ranks

OUTER_LR = 0.7  # DiLoCo's outer Nesterov SGD (arXiv 2311.08105; OpenDiLoCo, torchft)
OUTER_MOMENTUM = 0.9


# --- 13.3 the pseudo-gradient --------------------------------------------------------------------

def pseudo_gradients(snapshot: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
                     ) -> list[torch.Tensor]:
    """Δ_i = snapshot_i − params_i for each pair: how far the inner steps moved this rank,
    pointing back to the start (a gradient's direction: an SGD step of lr 1 on Δ returns to
    ``params``). New tensors, not views of either input, outside autograd (no ``grad_fn``),
    so that changing the parameters afterwards leaves them as they are."""
    if len(snapshot) != len(params):
        raise ValueError(f"the snapshot has {len(snapshot)} tensors, the parameters "
                         f"{len(params)}")
    for i, (s, p) in enumerate(zip(snapshot, params)):
        if s.shape != p.shape:
            raise ValueError(f"tensor {i}: the snapshot's shape {tuple(s.shape)} is not the "
                             f"parameter's {tuple(p.shape)}")
    # BEGIN SOLUTION 13.3: Δ = start-of-round weights − current weights (an SGD step of lr 1 on Δ lands on the average); new tensors, no autograd
    with torch.no_grad():
        return [s.detach() - p.detach() for s, p in zip(snapshot, params)]
    # END SOLUTION


# --- 13.4 the outer step ---------------------------------------------------------------------------

class DiLoCo(PeriodicSync):
    """DiLoCo's round: every ``sync_every`` steps of the inner ``optimizer``, :meth:`sync` runs
    the outer step. ``outer_optimizer`` must step the model's trainable parameters (the same
    tensors the inner optimizer steps); None builds the paper's SGD(lr 0.7, momentum 0.9,
    Nesterov). ``snapshot`` holds the weights at the start of the round (a copy, taken here and
    after every outer step)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int,
                 outer_optimizer: torch.optim.Optimizer | None = None, group=None):
        super().__init__(model, optimizer, sync_every, group)
        if outer_optimizer is None:
            outer_optimizer = torch.optim.SGD(self.params, lr=OUTER_LR,
                                              momentum=OUTER_MOMENTUM, nesterov=True)
        stepped = {id(p) for g in outer_optimizer.param_groups for p in g["params"]}
        if stepped != {id(p) for p in self.params}:
            raise ValueError("the outer optimizer must step exactly the model's trainable "
                             "parameters (build it on model.parameters())")
        self.outer_optimizer = outer_optimizer
        self.snapshot = [p.detach().clone() for p in self.params]

    def sync(self) -> int:
        """The outer step: Δ of this rank (13.3), averaged over the ranks (13.1's
        ``local_sgd.average_``); the parameters put back to the snapshot; ``p.grad = Δ̄`` and one step
        of the outer optimizer, then its ``zero_grad``; the snapshot becomes the parameters
        as they are after that step (the start of the next round). Returns the bytes sent."""
        # BEGIN SOLUTION 13.4: Δ (13.3); average Δ (13.1); restore the params to the snapshot; p.grad = Δ̄; outer step and zero_grad; new snapshot = the params AFTER the outer step
        deltas = pseudo_gradients(self.snapshot, self.params)
        sent = local_sgd.average_(deltas, self.group)
        with torch.no_grad():
            for p, s, d in zip(self.params, self.snapshot, deltas):
                p.copy_(s)
                p.grad = d
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        self.snapshot = [p.detach().clone() for p in self.params]
        return sent
        # END SOLUTION


# --- given: the CLI ------------------------------------------------------------------------------

def _run(rank: int, kind: str, steps: int, per_rank: int, h: int, inner: str, lr: float,
         outer_lr: float = OUTER_LR, outer_momentum: float = OUTER_MOMENTUM,
         test_x: torch.Tensor | None = None, test_y: torch.Tensor | None = None) -> dict:
    """One run of ``dpt.models.MLP`` on this rank's batches (``local_sgd.batches``) under
    torch's DDP, LocalSGD or DiLoCo; the final weights, the bytes, the test loss and the
    outer momentum buffers."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpt.models import MLP

    torch.manual_seed(0)
    model = MLP()
    net = DDP(model) if kind == "ddp" else model
    opt = local_sgd.make_optimizer(inner, model.parameters(), lr)
    if kind == "local_sgd":
        sync = LocalSGD(model, opt, h)
    elif kind == "diloco":
        outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum,
                                nesterov=outer_momentum > 0)
        sync = DiLoCo(model, opt, h, outer_optimizer=outer)
    else:
        sync = None
    counter = CommCounter()
    with counter:
        if sync is not None:
            sync.__enter__()
        for x, y in local_sgd.batches(steps, per_rank, rank):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()
        if sync is not None:
            sync.__exit__(None, None, None)
    out = {"weights": [p.detach().clone() for p in model.parameters()],
           "bytes": counter.bytes, "calls": counter.calls}
    if test_x is not None:
        with torch.no_grad():
            out["loss"] = F.cross_entropy(model(test_x), test_y).item()
    if kind == "diloco":
        out["momentum"] = [sync.outer_optimizer.state[p].get("momentum_buffer")
                           for p in sync.params]
    return out


def compare_worker(rank: int, world_size: int, steps: int, per_rank: int, h: int,
                   lr: float) -> dict:
    test_x, test_y = next(iter(local_sgd.batches(1, 2000, rank=999, seed=0)))
    ddp1 = _run(rank, "ddp", 12, per_rank, 1, "sgd", lr)["weights"]
    dil1 = _run(rank, "diloco", 12, per_rank, 1, "sgd", lr, outer_lr=1.0,
                outer_momentum=0.0)["weights"]
    out = {"h1": max((a - b).abs().max().item() for a, b in zip(ddp1, dil1))}
    common = {"steps": steps, "per_rank": per_rank, "inner": "adamw", "lr": lr,
              "test_x": test_x, "test_y": test_y}
    for kind, hh in (("ddp", 1), ("local_sgd", h), ("diloco", h)):
        run = _run(rank, kind, h=hh, **common)
        out[kind] = {"loss": run["loss"], "bytes": run["bytes"], "calls": run["calls"]}
        if kind == "diloco":
            flat_m = torch.cat([m.reshape(-1) for m in run["momentum"]])
            gathered = [torch.empty_like(flat_m) for _ in range(world_size)]
            dist.all_gather(gathered, flat_m)
            out["same_momentum"] = all(torch.equal(g, gathered[0]) for g in gathered)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=3, help="ranks (gloo on the CPU)")
    ap.add_argument("--steps", type=int, default=96, help="inner steps per run")
    ap.add_argument("--per-rank", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--sync-every", type=int, default=16, help="H, inner steps per round")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD's lr (AdamW's is a tenth)")
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args(argv)
    try:
        check_averaging_ranks(args.nproc)
        if args.steps < 1 or args.per_rank < 1 or args.sync_every < 1:
            raise ValueError("--steps, --per-rank and --sync-every must be at least 1")
        if args.steps % args.sync_every:
            raise ValueError(f"--steps ({args.steps}) must be a multiple of --sync-every "
                             f"({args.sync_every}): the run ends on a sync")
        if not args.lr > 0:
            raise ValueError(f"--lr must be positive, got {args.lr}")
        from dpt.ranks import run_distributed

        t0 = time.perf_counter()
        ranks = run_distributed(compare_worker, world_size=args.nproc, timeout=args.timeout,
                                backend="gloo", echo=False,
                                kwargs={"steps": args.steps, "per_rank": args.per_rank,
                                        "h": args.sync_every, "lr": args.lr})
    except (ValueError, RuntimeError, OSError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    res = ranks[0]
    h = args.sync_every
    print(f"DiLoCo on {args.nproc} ranks, dpt.models.MLP, {args.per_rank} samples per rank "
          f"per step ({time.perf_counter() - t0:.1f} s)")
    print(f"H=1, inner SGD, outer SGD(lr 1, no momentum), 12 steps: largest weight difference "
          f"from DDP {res['h1']:.1e} (float32 rounding: it is DDP)")
    print(f"{args.steps} AdamW inner steps (lr {args.lr / 10:g}), test loss on 2,000 held-out "
          f"samples:")
    print(f"  {'run':<34} {'test loss':>9} {'syncs':>6} {'payload bytes':>14}")
    names = {"ddp": "DDP (its reducer: not counted)",
             "local_sgd": f"LocalSGD, H={h}",
             "diloco": f"DiLoCo, H={h}, outer Nesterov {OUTER_LR}/{OUTER_MOMENTUM}"}
    for kind, name in names.items():
        r = res[kind]
        calls = "every" if kind == "ddp" else r["calls"]
        nbytes = "-" if kind == "ddp" else f"{r['bytes']:,}"
        print(f"  {name:<34} {r['loss']:>9.4f} {calls:>6} {nbytes:>14}")
    print(f"outer momentum bitwise equal on all {args.nproc} ranks: {res['same_momentum']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
