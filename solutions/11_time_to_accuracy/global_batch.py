"""Lesson 11: the global batch, three ways: N ranks, N micro-batches, or one big batch.

Data parallelism does not change *what* a step computes, only where. With N ranks of b samples
each, DDP averages the N gradients, and the average of N means over b samples is the mean over
the N·b samples: the step is the step of **one process on the global batch** B = N·b::

    g = 1/N · Σ_r  ∇ L_r          L_r = 1/b · Σ_{i in rank r's share} loss_i
      = 1/(N·b) · Σ_i ∇ loss_i     = ∇ of the mean loss over the global batch

So what decides how training goes (the learning rate to use, the steps to reach an accuracy,
the samples it costs) is B, not N. The same holds inside one process: **gradient
accumulation** runs K micro-batches of b samples, adds their gradients in ``.grad`` (backward
adds, it does not overwrite) and steps once. Dividing each micro-batch's loss by K makes the
sum the mean over the K·b samples; without it the gradient is K times too large (SGD feels it;
Adam and AdamW, which divide by the gradient's own size, do not).

With DDP and accumulation together, each ``backward()`` would all-reduce its gradients: K
all-reduces per step, K−1 of them wasted, since only the sum is used. ``ddp.no_sync()`` turns
the all-reduce off for the backwards inside it; the last micro-batch's backward, outside it,
all-reduces the accumulated sum, once. Forget it on the last one too and the ranks never
synchronise: each steps with its own gradient and the replicas drift apart.

Your tasks:

- 11.1 :func:`micro_batches`: rank r's share of a global batch, cut into K micro-batches;
- 11.2 :func:`accumulation_step`: one optimizer step over K micro-batches (zero once, divide,
  ``no_sync`` on all but the last, step once).

Given: :func:`whole_batch_step` (one process, one batch: the reference),
:func:`ddp_worker` (N ranks under DDP, counting the all-reduces with a communication hook and
the optimizer steps with a step hook) and the CLI, which trains ``dpt.models.MLP`` the three
ways on the same stream of random batches and prints how far apart the weights end up::

    .venv/bin/python solutions/11_time_to_accuracy/global_batch.py --nproc 2
    .venv/bin/python solutions/11_time_to_accuracy/global_batch.py --nproc 2 --accum 2 --optimizer adamw
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

OPTIMIZERS = ("sgd", "adamw")

Batch = tuple[torch.Tensor, torch.Tensor]


# --- 11.1 who takes which samples ---------------------------------------------------------------

def micro_batches(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int,
                  accum: int) -> list[Batch]:
    """Rank ``rank``'s micro-batches of the global batch ``(x, y)``.

    The global batch of G rows is cut into ``world_size`` contiguous shares of G/N rows, rank
    r taking the r-th; its share is cut into ``accum`` contiguous micro-batches of G/(N·K)
    rows, in order. Every row goes to exactly one micro-batch of one rank, and ``x`` and ``y``
    are cut alike. G must be a multiple of N·K (else ValueError: the micro-batches would
    differ in size, and their mean would weigh samples unequally).
    """
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} rows and y {len(y)}: one target per sample")
    if world_size < 1 or accum < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 1, accum >= 1 and 0 <= rank < world_size; got "
                         f"rank {rank}, world_size {world_size}, accum {accum}")
    if len(x) % (world_size * accum):
        raise ValueError(f"a global batch of {len(x)} does not split into {world_size} rank(s) "
                         f"x {accum} equal micro-batch(es): use a multiple of "
                         f"{world_size * accum}")
    # BEGIN SOLUTION 11.1: rank r takes the r-th contiguous share of the global batch, cut into `accum` equal micro-batches (slice x and y alike)
    share = len(x) // world_size
    xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    size = share // accum
    return [(xs[i * size:(i + 1) * size], ys[i * size:(i + 1) * size]) for i in range(accum)]
    # END SOLUTION


# --- 11.2 one step over K micro-batches ---------------------------------------------------------

def accumulation_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                      micro: Sequence[Batch],
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
    """One optimizer step on the micro-batches ``micro``, as if they were one batch.

    ``model`` is a plain module or a DDP-wrapped one (it has ``no_sync``). ``loss_fn(out,
    y)`` is a mean over the micro-batch (``F.cross_entropy``). Zero the gradients once; for
    each micro-batch run forward and backward on its loss divided by ``len(micro)``, the
    backward of every micro-batch but the last inside ``model.no_sync()`` when the model has
    it; then step once. The gradients are then those of the mean loss over all the
    micro-batches, all-reduced once per step under DDP. Returns that mean loss (a float).
    """
    if not micro:
        raise ValueError("no micro-batches: accumulation needs at least one")
    # BEGIN SOLUTION 11.2: zero once; each micro-batch's loss divided by their count; no_sync() around all but the last backward (if the model has it); one optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i, (xb, yb) in enumerate(micro):
        last = i == len(micro) - 1
        quiet = model.no_sync() if hasattr(model, "no_sync") and not last \
            else contextlib.nullcontext()
        with quiet:
            loss = loss_fn(model(xb), yb) / len(micro)
            loss.backward()
        total += loss.item()
    optimizer.step()
    return total
    # END SOLUTION


# --- given: the reference, the ranks, the CLI --------------------------------------------------

def whole_batch_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                     y: torch.Tensor,
                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
    """One process, one batch, one step: what the other two ways must reproduce."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def make_optimizer(name: str, params, lr: float | None = None) -> torch.optim.Optimizer:
    """SGD with momentum 0.9 (lr 0.1) or AdamW (lr 1e-3, weight decay 0.01)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1 if lr is None else lr, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3 if lr is None else lr, weight_decay=0.01)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def make_batches(steps: int, global_batch: int, seed: int = 0) -> list[Batch]:
    """``steps`` global batches of random 28x28 "images" and class ids, the same on every rank
    and in every process (a generator seeded with ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, 1, 28, 28, generator=g),
             torch.randint(0, 10, (global_batch,), generator=g)) for _ in range(steps)]


def new_model(seed: int = 0) -> nn.Module:
    from dpt.models import MLP

    torch.manual_seed(seed)
    return MLP()


def ddp_worker(rank: int, world_size: int, optimizer: str = "sgd", steps: int = 10,
               global_batch: int = 32, accum: int = 1, seed: int = 0) -> dict:
    """Train with DDP on ``world_size`` ranks, ``accum`` micro-batches per rank per step.

    Counts what a step costs: every all-reduce DDP makes goes through a communication hook
    that counts it (one per bucket and synchronised backward), every ``optimizer.step()``
    through a step post-hook. Returns the final weights and the counts.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpt.dist import rank_device

    device = rank_device()
    model = new_model(seed).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    counts = {"all_reduces": 0, "steps": 0}

    def counting_hook(state, bucket):
        counts["all_reduces"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    opt = make_optimizer(optimizer, ddp.parameters())
    opt.register_step_post_hook(lambda *_: counts.__setitem__("steps", counts["steps"] + 1))
    losses = []
    for x, y in make_batches(steps, global_batch, seed):
        micro = [(xb.to(device), yb.to(device))
                 for xb, yb in micro_batches(x, y, rank, world_size, accum)]
        losses.append(accumulation_step(ddp, opt, micro, F.cross_entropy))
    return {"params": [p.detach().cpu().clone() for p in model.parameters()],
            "losses": losses, **counts}


def max_difference(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The largest absolute difference between two lists of weights."""
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def one_process(optimizer: str, steps: int, global_batch: int, accum: int, seed: int = 0
                ) -> list[torch.Tensor]:
    """One process, ``accum`` micro-batches per step (1: the whole batch, no accumulation)."""
    model = new_model(seed)
    opt = make_optimizer(optimizer, model.parameters())
    for x, y in make_batches(steps, global_batch, seed):
        if accum == 1:
            whole_batch_step(model, opt, x, y, F.cross_entropy)
        else:
            accumulation_step(model, opt, micro_batches(x, y, 0, 1, accum), F.cross_entropy)
    return [p.detach().clone() for p in model.parameters()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (N)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per rank per step (K)")
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32, help="the global batch, B = N x K x b")
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args(argv)
    try:
        if args.nproc < 1 or args.accum < 1 or args.steps < 1:
            raise ValueError("--nproc, --accum and --steps must be at least 1")
        if args.batch < 1 or args.batch % (args.nproc * args.accum):
            raise ValueError(f"--batch {args.batch} must be a positive multiple of --nproc x "
                             f"--accum = {args.nproc * args.accum}")
        from dpt.ranks import placement, run_distributed

        t0 = time.perf_counter()
        ranks = run_distributed(ddp_worker, world_size=args.nproc, timeout=args.timeout,
                                echo=False, kwargs={
                                    "optimizer": args.optimizer, "steps": args.steps,
                                    "global_batch": args.batch, "accum": args.accum})
        accumulated = one_process(args.optimizer, args.steps, args.batch,
                                  args.nproc * args.accum)
        whole = one_process(args.optimizer, args.steps, args.batch, 1)
    except (ValueError, RuntimeError, OSError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    n, k, b = args.nproc, args.accum, args.batch
    r0 = ranks[0]
    print(f"global batch {b}, {args.steps} {args.optimizer} steps of the MLP "
          f"({sum(p.numel() for p in whole):,} weights), {placement(n).label}, "
          f"{time.perf_counter() - t0:.1f} s:")
    print(f"  A  {n} rank(s) x {k} micro-batch(es) of {b // (n * k)} (DDP): "
          f"{r0['all_reduces'] / args.steps:g} all-reduce(s) and {r0['steps'] / args.steps:g} "
          "optimizer step(s) per global batch")
    print(f"  B  1 process x {n * k} micro-batches of {b // (n * k)} (accumulation)")
    print(f"  C  1 process x 1 batch of {b}")
    between = max(max_difference(r["params"], r0["params"]) for r in ranks)
    print(f"largest weight difference: A-C {max_difference(r0['params'], whole):.1e}, "
          f"B-C {max_difference(accumulated, whole):.1e}, between A's ranks {between:.1e}")
    worst = max(max_difference(r0["params"], whole), max_difference(accumulated, whole))
    print("the three ways take the same steps (float32 rounding apart)" if worst < 1e-4 else
          "the three ways DIFFER: see tasks 11.1 and 11.2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
