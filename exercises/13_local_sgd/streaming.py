# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 13: Streaming DiLoCo, the model synchronised one fragment at a time.

DiLoCo (``diloco.py``) sends the whole pseudo-gradient Δ̄ once per round of H inner steps: P
values in one burst, while the ranks wait, then nothing for H steps. The *total* is already H
times below DDP's; the *peak* is not: the network must carry all P values at once, and the
ranks sit idle while it does. Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with
overlapping communication", arXiv 2501.18512) cuts the model into F fragments and syncs them
in turn, one every H/F inner steps, each on its own schedule::

    fragment p is due after inner step s  when  s is a multiple of H/F
                                          and   (s / (H/F) − 1) mod F = p

    s:        1  2  3  4  5  6  7  8  9 10 11 12        (H = 6, F = 3: one every 2 steps)
    fragment: .  0  .  1  .  2  .  0  .  1  .  2

Each fragment is still synchronised once every H steps (its own round), with its OWN snapshot
(the weights it held after its last sync) and its OWN outer optimizer (Nesterov SGD, lr 0.7,
momentum 0.9, as DiLoCo's): Δ_p = snapshot_p − θ_p, averaged over the ranks, one outer step
from the snapshot, new snapshot. The other fragments keep training untouched. The bytes per
round are the same as DiLoCo's; the largest single all-reduce is 1/F of them (exactly, when the
fragments hold the same number of values). The paper's further steps are not tasks here: the
sync of a fragment overlapped with the next τ inner steps (torchft's ``fragment_sync_delay``),
the merged weights a mix α of the local and the averaged ones (``fragment_update_alpha``), and
the outer gradients sent as 4-bit floats (``compress.py`` does fp16, bf16 and int8).

Which layers make a fragment: the paper's *strided* pattern puts block i in fragment i mod F
(with 6 blocks and F = 3: {0, 3}, {1, 4}, {2, 5}), so every fragment holds layers from the
bottom to the top of the network, rather than contiguous slices ({0, 1}, {2, 3}, {4, 5}),
which the paper found worse. torchft's ``DiLoCo`` takes the fragments as a list of modules,
and picks the fragment to sync from a step count every replica shares
(``manager.current_step() % F``), never from a rank's own counter: every rank must average the
SAME fragment at the same step, or the all-reduce adds values of different layers (silently,
when the fragments are the same size). torchft also requires ``sync_every % F == 0``.

Your tasks:

- 13.5 :func:`strided_fragments`: block i to fragment i mod F;
- 13.6 :func:`fragment_due`: which fragment (if any) syncs after inner step s;
- 13.7 :meth:`StreamingDiLoCo.sync_fragment`: DiLoCo's outer step (13.3, 13.1, as in 13.4)
  for one fragment: its snapshot, its outer optimizer.

Given: :class:`StreamingDiLoCo`'s constructor and hook (it calls 13.6, then 13.7), the model
of blocks, and the CLI: on ``--nproc`` ranks it trains the model with F fragments and with
F = 1 (DiLoCo), prints the schedule and the bytes of every sync, the peak and the total::

    .venv/bin/python exercises/13_local_sgd/streaming.py --nproc 3
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import sys
import time
from collections.abc import Sequence

import diloco  # the lesson's siblings, by module name: 13.3's pseudo_gradients
import local_sgd  # 13.1's average_, CommCounter, PeriodicSync
import torch
from torch import nn

from dpt.cli import check_averaging_ranks

OUTER_LR = diloco.OUTER_LR
OUTER_MOMENTUM = diloco.OUTER_MOMENTUM


# --- 13.5 the fragments ----------------------------------------------------------------------------

def strided_fragments(blocks: Sequence[nn.Module], fragments: int) -> list[list[nn.Module]]:
    """Split ``blocks`` (the model's layers, bottom to top) into ``fragments`` lists, block i
    in list i mod F, in their order. Raises ValueError unless 1 <= F <= len(blocks) (an
    empty fragment would have nothing to sync)."""
    raise NotImplementedError("Task 13.5: block i goes to fragment i % F (Streaming DiLoCo's strided pattern); F < 1 or F > len(blocks): ValueError")


# --- 13.6 the schedule -----------------------------------------------------------------------------

def fragment_due(step: int, sync_every: int, fragments: int) -> int | None:
    """The fragment to sync after inner step ``step`` (1-based, counted from the start of
    training, the same on every rank), or None. One fragment every H/F steps, in the order
    0, 1, ..., F−1, 0, ...: each fragment once per H steps. Raises ValueError when
    ``sync_every`` (H) is not a multiple of ``fragments`` (F) (torchft's rule)."""
    raise NotImplementedError("Task 13.6: after inner step `step` (1-based), fragment ((step / (H/F)) − 1) % F is due every H/F steps, else None; H % F != 0: ValueError (torchft's rule)")


# --- 13.7 one fragment's outer step -----------------------------------------------------------------

class StreamingDiLoCo(local_sgd.PeriodicSync):
    """DiLoCo by fragments: ``blocks`` (default: the model's children) split by
    :func:`strided_fragments`; after every inner step, :func:`fragment_due` names the
    fragment to sync, if any, and :meth:`sync_fragment` syncs it.

    Per fragment p: ``fragment_params[p]`` (its trainable parameters), ``snapshots[p]`` (their
    values after its last sync) and ``outer_optimizers[p]`` (Nesterov SGD). ``inner_steps``
    counts the steps since the start (never reset: the schedule is one clock for all ranks),
    ``history`` lists ``(step, fragment, bytes)`` for every sync."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int,
                 fragments: int, blocks: Sequence[nn.Module] | None = None,
                 outer_lr: float = OUTER_LR, outer_momentum: float = OUTER_MOMENTUM,
                 group=None):
        super().__init__(model, optimizer, sync_every, group)
        if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
            raise ValueError(f"fragments must be an integer of at least 1, got {fragments!r}")
        if sync_every % fragments:
            raise ValueError(f"sync_every (H = {sync_every}) must be a multiple of the number "
                             f"of fragments (F = {fragments}): one fragment every H/F steps")
        self.num_fragments = fragments
        blocks = list(model.children()) if blocks is None else list(blocks)
        self.fragments = strided_fragments(blocks, fragments)
        self.fragment_params = [[p for m in frag for p in m.parameters() if p.requires_grad]
                                for frag in self.fragments]
        owned = [id(p) for ps in self.fragment_params for p in ps]
        if sorted(owned) != sorted(id(p) for p in self.params):
            raise ValueError("every trainable parameter must be in exactly one block: pass "
                             "blocks that cover the model once (default: model.children())")
        for p, ps in enumerate(self.fragment_params):
            if not ps:
                raise ValueError(f"fragment {p} holds no trainable parameters: use fewer "
                                 "fragments, or blocks that each hold parameters")
        self.snapshots = [[x.detach().clone() for x in ps] for ps in self.fragment_params]
        self.outer_optimizers = [
            torch.optim.SGD(ps, lr=outer_lr, momentum=outer_momentum,
                            nesterov=outer_momentum > 0) for ps in self.fragment_params]
        self.inner_steps = 0
        self.history: list[tuple[int, int, int]] = []

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.inner_steps += 1
        p = fragment_due(self.inner_steps, self.sync_every, self.num_fragments)
        if p is not None:
            sent = self.sync_fragment(p)
            self.history.append((self.inner_steps, p, sent))
            self.syncs += 1

    def sync(self) -> int:
        """Every fragment in turn (not used by the schedule; a last sync at the end)."""
        return sum(self.sync_fragment(p) for p in range(self.num_fragments))

    def sync_fragment(self, p: int) -> int:
        """DiLoCo's outer step for fragment ``p`` only: its Δ from ITS snapshot (13.3),
        averaged over the ranks (13.1), its parameters put back to its snapshot, ``grad = Δ̄``,
        one step of ITS outer optimizer and its ``zero_grad``, then its new snapshot. Other
        fragments' parameters, snapshots and outer states are left as they are. Returns the
        bytes this rank sent."""
        raise NotImplementedError("Task 13.7: 13.4 for fragment p only: its own snapshot, its own outer optimizer; the other fragments keep training untouched")


# --- given: the model and the CLI ------------------------------------------------------------------

def block_model(blocks: int = 6, width: int = 64, dtype: torch.dtype = torch.float32,
                seed: int = 0) -> nn.Sequential:
    """``blocks`` blocks of ``Linear(width, width)`` + ReLU, each block one child (so one
    unit of a fragment), the same weights on every rank for one ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                           for _ in range(blocks)]).to(dtype)


def batch(rank: int, step: int, per_rank: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: inputs and a fixed smooth target (a regression)."""
    g = torch.Generator().manual_seed(1000 * rank + step + 1)
    x = torch.randn(per_rank, width, generator=g)
    return x, torch.tanh(x.roll(1, dims=1))


def train_worker(rank: int, world_size: int, blocks: int, width: int, fragments: int,
                 sync_every: int, steps: int, per_rank: int, lr: float) -> dict:
    """One run with F = ``fragments`` and one with F = 1 (DiLoCo); each sync's step,
    fragment and bytes (counted by :class:`local_sgd.CommCounter`) and the final loss."""
    import torch.nn.functional as F

    out = {}
    for f in dict.fromkeys((fragments, 1)):
        model = block_model(blocks, width)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        with local_sgd.CommCounter() as counter, \
                StreamingDiLoCo(model, opt, sync_every, f) as stream:
            for step in range(steps):
                x, y = batch(rank, step, per_rank, width)
                opt.zero_grad(set_to_none=True)
                F.mse_loss(model(x), y).backward()
                opt.step()
        x, y = batch(999, 0, 512, width)
        with torch.no_grad():
            loss = F.mse_loss(model(x), y).item()
        out[f] = {"history": stream.history, "peak": counter.peak, "bytes": counter.bytes,
                  "calls": counter.calls, "loss": loss,
                  "members": [[blocks_of(model, m) for m in frag] for frag in stream.fragments]}
    return out


def blocks_of(model: nn.Module, module: nn.Module) -> int:
    return next(i for i, m in enumerate(model.children()) if m is module)


def timeline(history: Sequence[tuple[int, int, int]], steps: int, cols: int = 24) -> str:
    """Two lines: the steps, and the fragment synced after each (``.``: none)."""
    due = {s: p for s, p, _ in history}
    shown = range(1, min(steps, cols) + 1)
    return (f"  step:     {' '.join(f'{s:>2}' for s in shown)}\n"
            f"  fragment: {' '.join(f'{due[s]:>2}' if s in due else ' .' for s in shown)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=3, help="ranks (gloo on the CPU)")
    ap.add_argument("--blocks", type=int, default=6, help="blocks of Linear + ReLU")
    ap.add_argument("--width", type=int, default=64, help="features of each Linear")
    ap.add_argument("--fragments", type=int, default=3, help="F, fragments synced in turn")
    ap.add_argument("--sync-every", type=int, default=6,
                    help="H, inner steps per round (each fragment syncs once per H steps)")
    ap.add_argument("--steps", type=int, default=24, help="inner steps")
    ap.add_argument("--per-rank", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=1e-3, help="inner AdamW's lr")
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args(argv)
    try:
        check_averaging_ranks(args.nproc)
        for name in ("blocks", "width", "fragments", "sync_every", "steps", "per_rank"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(args, name)}")
        if args.fragments > args.blocks:
            raise ValueError(f"--fragments ({args.fragments}) cannot exceed --blocks "
                             f"({args.blocks}): a fragment needs at least one block")
        if args.sync_every % args.fragments:
            raise ValueError(f"--sync-every ({args.sync_every}) must be a multiple of "
                             f"--fragments ({args.fragments}): one fragment every H/F steps")
        if not args.lr > 0:
            raise ValueError(f"--lr must be positive, got {args.lr}")
        from dpt.ranks import run_distributed

        t0 = time.perf_counter()
        ranks = run_distributed(train_worker, world_size=args.nproc, timeout=args.timeout,
                                backend="gloo", echo=False, kwargs={
                                    "blocks": args.blocks, "width": args.width,
                                    "fragments": args.fragments, "sync_every": args.sync_every,
                                    "steps": args.steps, "per_rank": args.per_rank,
                                    "lr": args.lr})
    except (ValueError, RuntimeError, OSError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    res = ranks[0]
    params = sum(p.numel() for p in block_model(args.blocks, args.width).parameters())
    h, f = args.sync_every, args.fragments
    print(f"Streaming DiLoCo on {args.nproc} ranks: {args.blocks} blocks of Linear({args.width},"
          f" {args.width}) + ReLU ({params:,} fp32 parameters, {4 * params:,} bytes), "
          f"H={h}, {args.steps} inner steps ({time.perf_counter() - t0:.1f} s)")
    members = " | ".join(",".join(map(str, m)) for m in res[f]["members"])
    print(f"F={f} strided fragments (blocks): {members}; one fragment every H/F = {h // f} "
          f"steps:")
    print(timeline(res[f]["history"], args.steps))
    print(f"  {'run':<22} {'syncs':>6} {'peak bytes per sync':>20} {'total bytes':>12} "
          f"{'loss':>8}")
    for ff, name in ((f, f"Streaming, F={f}"), (1, "DiLoCo (F=1)")):
        r = res[ff]
        print(f"  {name:<22} {r['calls']:>6} {r['peak']:>20,} {r['bytes']:>12,} "
              f"{r['loss']:>8.4f}")
    if f > 1:
        print(f"peak per sync: DiLoCo's / streaming's = {res[1]['peak'] / res[f]['peak']:.2f} "
              f"(F = {f}); total bytes the same: {res[f]['bytes'] == res[1]['bytes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
