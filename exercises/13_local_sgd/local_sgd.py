# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 13: LocalSGD, data parallel that talks to the other ranks once every H steps.

DDP all-reduces the gradients at every step: with P fp32 parameters each rank sends and
receives about 2·(N−1)/N · 4P bytes per step (lesson 12's ring). On a slow network (1 Gb/s
Ethernet between two sites, 0.125 GB/s) that is 4.3 ms per step for the lesson's 407 KB MLP
at N = 3, and 43 s per step for a 1-billion-parameter model: the ranks would wait far longer
than they compute. **LocalSGD** (periodic parameter averaging; Stich, "Local SGD converges fast
and communicates little", arXiv 1805.09767) lets every rank take H optimizer steps on its own
data, then averages the *weights*::

    w_r ← w_r − lr·∇L_r(w_r)          (H times, on each rank r, no communication)
    w_r ← (1/N) Σ_s w_s              (one all-reduce of P values every H steps)

so the bytes per step fall by H exactly. At H = 1 with plain SGD it *is* DDP: the average of
N SGD steps taken from the same weights is one SGD step with the average gradient. It stays
so with heavy-ball or Nesterov momentum (the buffers are linear in the gradients, so their
average follows DDP's buffer), but not with Adam: each rank divides its step by the root of
its OWN second moment, and the average of g_r/√v_r is not mean(g)/√mean(v). Those optimizer
states stay local and are never averaged (torchft's ``LocalSGD`` does the same); the README
shows the difference. Above H = 1 the ranks' weights drift apart between syncs, and the
average of H local steps is not H steps of DDP: fewer bytes, a different (usually slower per
sample) optimisation. DiLoCo (``diloco.py``) puts an optimizer on that drift.

The hook is torchft-shaped (``torchft.local_sgd.LocalSGD``): a context manager that registers
an optimizer step *post-hook*; the training loop is untouched::

    with LocalSGD(model, optimizer, sync_every=H):
        for x, y in batches:
            optimizer.zero_grad(); loss(model(x), y).backward(); optimizer.step()

Your tasks:

- 13.1 :func:`average_`: average a list of tensors over the ranks in place, with ONE flat
  buffer and ONE all-reduce, and return the bytes sent;
- 13.2 :meth:`PeriodicSync._after_step`: count the inner steps and call ``sync()`` at every
  H-th one.

Given: :class:`CommCounter` (counts the bytes of every collective, as lesson 10's 10.10 did
for DDP's hook), :func:`flat`/:func:`unflat_`, :class:`PeriodicSync`'s hook plumbing,
:class:`LocalSGD`, and the CLI: on ``--nproc`` ranks it compares LocalSGD at H = 1 with
torch's DDP (plain SGD and AdamW) and counts the bytes at H = 1, 4 and 16::

    .venv/bin/python exercises/13_local_sgd/local_sgd.py --nproc 3
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import sys
import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dpt.cli import check_averaging_ranks, positive_ints

# --- given: counting the bytes of the collectives --------------------------------------------------

_COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CommCounter:
    """Counts every ``torch.distributed`` collective called through ``dist.<name>`` while it is
    open: ``all_reduce``, ``all_gather``, ``all_gather_into_tensor`` and ``broadcast``.

    Each call is recorded in ``records`` as ``(op, dtype, payload bytes)``, the payload being
    what THIS rank puts in: the tensor of an all-reduce or a broadcast, the input of an
    all-gather (one rank's share, not the gathered whole). ``bytes`` is their sum, ``calls``
    their number, ``peak`` the largest one. :meth:`wire` turns them into the bytes each rank
    sends on a ring of ``n`` ranks. Counting only: the collective runs as it would.

    It patches the functions of ``torch.distributed`` for its duration, so it sees code that
    calls ``dist.all_reduce(...)`` (the lesson's), not torch's DDP, whose reducer calls the
    process group directly (lesson 10's comm hook is the way to count DDP)."""

    def __init__(self):
        self.records: list[tuple[str, torch.dtype, int]] = []
        self._saved: dict[str, object] = {}

    def _wrap(self, name: str, fn):
        def counted(*args, **kwargs):
            if name == "all_gather":
                tensor = args[1] if len(args) > 1 else kwargs["tensor"]
            elif name == "all_gather_into_tensor":
                tensor = args[1] if len(args) > 1 else kwargs["input_tensor"]
            else:
                tensor = args[0] if args else kwargs["tensor"]
            self.records.append((name, tensor.dtype, _nbytes(tensor)))
            return fn(*args, **kwargs)
        return counted

    def __enter__(self) -> CommCounter:
        for name in _COUNTED:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    @property
    def bytes(self) -> int:
        return sum(r[2] for r in self.records)

    @property
    def calls(self) -> int:
        return len(self.records)

    @property
    def peak(self) -> int:
        return max((r[2] for r in self.records), default=0)

    def wire(self, n: int) -> float:
        """Bytes each rank sends for the recorded calls on a ring of ``n`` ranks: an
        all-reduce 2(n−1)/n·B (reduce-scatter then all-gather), an all-gather (n−1)·B (every
        other rank's share passes through), a broadcast B (pipelined)."""
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1,
                  "all_gather_into_tensor": n - 1, "broadcast": 1}
        return sum(factor[op] * b for op, _, b in self.records)


# --- given: one buffer for many tensors ---------------------------------------------------------------

def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' values one after the other in ONE new 1-D tensor (a copy, no autograd), so
    one collective moves them all. They must share a dtype and a device."""
    if not tensors:
        raise ValueError("flat() needs at least one tensor")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"flat() needs tensors of one dtype, got {sorted(map(str, dtypes))}")
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflat_(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``buffer`` (as made by :func:`flat`) back into ``tensors``, in place, without
    autograd (the tensors may be parameters)."""
    total = sum(t.numel() for t in tensors)
    if buffer.numel() != total:
        raise ValueError(f"the buffer holds {buffer.numel()} values, the tensors {total}")
    with torch.no_grad():
        start = 0
        for t in tensors:
            t.copy_(buffer[start:start + t.numel()].view_as(t))
            start += t.numel()


# --- 13.1 averaging over the ranks ------------------------------------------------------------------

def average_(tensors: Sequence[torch.Tensor], group=None) -> int:
    """Replace each tensor by its mean over the ranks of ``group`` (None: every rank), in
    place, with ONE all-reduce of one flat buffer (:func:`flat`, :func:`unflat_`).

    Returns the bytes this rank put into the collective: numel × element size of the buffer
    (what :class:`CommCounter` records for it). An empty list sends nothing and returns 0.
    """
    if not tensors:
        return 0
    raise NotImplementedError("Task 13.1: one flat buffer, one all_reduce(SUM), divide by the group's size, copy back into the tensors; return the bytes sent (numel·element_size)")


# --- 13.2 when to synchronise -------------------------------------------------------------------------

class PeriodicSync:
    """Calls :meth:`sync` after every ``sync_every``-th step of ``optimizer`` (H, the inner
    steps per round), through an optimizer step post-hook registered while the object is
    open as a context manager. Every rank counts the same steps, so every rank reaches the
    sync (and its collective) at the same step: no rank waits on a peer that is not coming.

    ``local_step`` is the number of steps since the last sync (0 right after one), ``syncs``
    the number of syncs so far. Subclasses define :meth:`sync`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int,
                 group=None):
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every (H, inner steps per sync) must be an integer of at "
                             f"least 1, got {sync_every!r}")
        self.model = model
        self.optimizer = optimizer
        self.sync_every = sync_every
        self.group = group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.local_step = 0
        self.syncs = 0
        self._handle = None

    def __enter__(self):
        self._handle = self.optimizer.register_step_post_hook(self._after_step)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def sync(self) -> int:
        """Synchronise the ranks; return the bytes this rank sent."""
        raise NotImplementedError(f"{type(self).__name__} must define sync()")

    def _after_step(self, optimizer, args, kwargs) -> None:
        """Runs after each ``optimizer.step()`` (torch passes the optimizer and the step's
        arguments). Counts the step in ``local_step``; at the ``sync_every``-th one since the
        last sync, calls :meth:`sync`, counts it in ``syncs`` and starts counting again from 0."""
        raise NotImplementedError("Task 13.2: count inner steps after each optimizer step; at the H-th call self.sync() and reset the count to 0 (every rank counts the same, so every rank syncs at the same step)")


class LocalSGD(PeriodicSync):
    """Periodic parameter averaging: every ``sync_every`` optimizer steps, the model's
    trainable parameters become their mean over the ranks (13.1). The optimizer's state
    (momentum, Adam's moments) stays each rank's own, as in torchft's ``LocalSGD``."""

    def sync(self) -> int:
        return average_(self.params, self.group)


# --- given: the CLI ---------------------------------------------------------------------------------

def batches(steps: int, per_rank: int, rank: int, seed: int = 0
            ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s ``steps`` batches of ``per_rank`` fake 28×28 images labelled by a fixed
    random teacher (so there is something to learn), the same on every run."""
    teacher = torch.randn(784, 10, generator=torch.Generator().manual_seed(seed))
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1000 + rank + 1)
        x = torch.randn(per_rank, 1, 28, 28, generator=g)
        yield x, (x.flatten(1) @ teacher).argmax(1)


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr / 10)
    raise ValueError(f"unknown optimizer {name!r}: sgd or adamw")


def train(rank: int, kind: str, opt_name: str, steps: int, per_rank: int, lr: float,
          sync_every: int = 1, counter: CommCounter | None = None) -> list[torch.Tensor]:
    """``steps`` steps of ``dpt.models.MLP`` on this rank's batches: under torch's DDP
    (``kind="ddp"``) or LocalSGD (``"local_sgd"``); returns the final weights."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpt.models import MLP

    torch.manual_seed(0)
    model = MLP()
    net = DDP(model) if kind == "ddp" else model
    opt = make_optimizer(opt_name, model.parameters(), lr)
    sync = LocalSGD(model, opt, sync_every) if kind == "local_sgd" else None
    with sync or _nothing(), counter or _nothing():
        for x, y in batches(steps, per_rank, rank):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def compare_worker(rank: int, world_size: int, steps: int, per_rank: int, lr: float,
                   hs: Sequence[int]) -> dict:
    out = {}
    for opt_name in ("sgd", "adamw"):
        ddp = train(rank, "ddp", opt_name, steps, per_rank, lr)
        local = train(rank, "local_sgd", opt_name, steps, per_rank, lr, sync_every=1)
        out[opt_name] = max((a - b).abs().max().item() for a, b in zip(ddp, local))
    out["bytes"] = {}
    for h in hs:
        counter = CommCounter()
        train(rank, "local_sgd", "sgd", steps, per_rank, lr, sync_every=h, counter=counter)
        out["bytes"][h] = (counter.bytes, counter.calls, counter.wire(world_size))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=3, help="ranks (gloo on the CPU)")
    ap.add_argument("--steps", type=int, default=48, help="optimizer steps per run")
    ap.add_argument("--per-rank", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD's lr (AdamW's is a tenth)")
    ap.add_argument("--hs", type=positive_ints, default=[1, 4, 16],
                    help="inner steps per sync to count the bytes of (comma-separated)")
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args(argv)
    try:
        check_averaging_ranks(args.nproc)
        if args.steps < 1 or args.per_rank < 1:
            raise ValueError("--steps and --per-rank must be at least 1")
        if not args.lr > 0:
            raise ValueError(f"--lr must be positive, got {args.lr}")
        from dpt.ranks import run_distributed

        t0 = time.perf_counter()
        ranks = run_distributed(compare_worker, world_size=args.nproc, timeout=args.timeout,
                                backend="gloo", echo=False,
                                kwargs={"steps": args.steps, "per_rank": args.per_rank,
                                        "lr": args.lr, "hs": args.hs})
    except (ValueError, RuntimeError, OSError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    from dpt.models import MLP, count_parameters

    params = count_parameters(MLP())
    res = ranks[0]
    print(f"LocalSGD against torch's DDP, dpt.models.MLP ({params:,} parameters), "
          f"{args.nproc} ranks, {args.steps} steps of {args.per_rank} samples per rank "
          f"({time.perf_counter() - t0:.1f} s)")
    print("H=1, largest weight difference from DDP after the run:")
    print(f"  SGD   (lr {args.lr:g}):  {res['sgd']:.1e}   (float32 rounding: H=1 is DDP)")
    print(f"  AdamW (lr {args.lr / 10:g}): {res['adamw']:.1e}   (each rank's own Adam "
          f"moments: not DDP)")
    ddp_bytes = args.steps * params * 4
    print(f"bytes each rank puts into all-reduces in {args.steps} steps "
          f"(DDP: {ddp_bytes:,} = {args.steps} x {params * 4:,}):")
    print(f"  {'H':>4} {'syncs':>6} {'payload bytes':>14} {'DDP / this':>11} "
          f"{'ring bytes sent':>16}")
    for h, (nbytes, calls, wire) in res["bytes"].items():
        ratio = f"{ddp_bytes / nbytes:.1f}" if nbytes else "-"
        print(f"  {h:>4} {calls:>6} {nbytes:>14,} {ratio:>11} {wire:>16,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
