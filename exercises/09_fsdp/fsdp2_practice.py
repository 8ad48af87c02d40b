# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 09: FSDP2 as practitioners use it, on the lesson's TinyTransformer.

What a real FSDP2 job does, and what the hand-written FSDP of this lesson does by hand:

- the model is built on the **meta device** (shapes, no memory), sharded, and only then
  given memory: ``to_empty`` allocates this rank's shards, and an initialisation fills them.
  No rank ever holds the whole model;
- ``fully_shard`` per block, then the root, with a ``MixedPrecisionPolicy``: bf16 parameters
  in compute (the all-gathers move half the bytes), gradients reduced in fp32;
- ``reshard_after_forward``: free each block's gathered parameters after its forward (and
  gather them again in backward), or keep them until backward: memory against time;
- explicit prefetch: each block starts the all-gather of the next ones before it computes.

Every rank trains on its slice of one **global** batch per step, so the losses are the same
whatever the number of ranks (what lets ``dcp_checkpoint.py`` resume at another world size).

    .venv/bin/python exercises/09_fsdp/fsdp2_practice.py                  # 2 CPU ranks, gloo
    .venv/bin/python exercises/09_fsdp/fsdp2_practice.py --bf16 --no-reshard
    .venv/bin/python exercises/09_fsdp/fsdp2_practice.py --compare        # FSDP2 and by hand
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import math
import statistics
import sys
import time
import zlib

import torch
import torch.distributed as dist
from fsdp_by_hand import loss_fn  # noqa: F401 (the lesson's loss, for the callers here)
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dpt.dist import device_mesh, get_rank, get_world_size, rank_device
from dpt.lessons import load
from dpt.models import TinyTransformer, token_batch

measure_bytes = load("08_sharding", "zero_accounting", __file__).measure_bytes  # lesson 08

CONFIG = {"vocab": 256, "dim": 64, "heads": 4, "layers": 4, "seq_len": 64}
GLOBAL_BATCH = 8  # sequences per step, over all ranks: a multiple of 1, 2 and 4
LR = 3e-3
INIT_STD = 0.02


# --- a seeded initialisation that any rank can compute for its own rows --------------------

def fill_rows(out: torch.Tensor, name: str, full_shape: torch.Size | tuple, start: int,
              seed: int = 0) -> torch.Tensor:
    """Fill ``out`` in place with rows ``start .. start + len(out)`` of parameter ``name``'s
    initial value (full shape ``full_shape``), the same rows whoever computes them.

    Biases start at 0, norm weights (1-D) at 1, matrices and embeddings from N(0, 0.02^2),
    each row from its own generator seeded by (seed, name, row): a rank holding rows 32-63
    draws exactly what a single process initialising the whole tensor draws for them.
    """
    if name.endswith("bias"):
        return out.fill_(0.0)
    if len(full_shape) == 1:
        return out.fill_(1.0)
    # drawn on the CPU, whose generator gives the same numbers on every machine
    rows = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
    g = torch.Generator()
    key = zlib.crc32(name.encode())
    for i, row in enumerate(rows):
        g.manual_seed((seed * 1_000_003 + key) * 65_537 + start + i)
        row.normal_(0.0, INIT_STD, generator=g)
    return out if rows is out else out.copy_(rows)


@torch.no_grad()
def init_full(model: nn.Module, seed: int = 0) -> nn.Module:
    """The same initialisation on a whole, unsharded model (the reference, and the by-hand
    FSDP's starting point)."""
    for name, p in model.named_parameters():
        fill_rows(p, name, p.shape, 0, seed)
    return model


def shard_rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows ``(start, stop)`` of the full parameter that this rank's shard holds.

    ``fully_shard`` splits dim 0 as ``torch.chunk`` does: ceil(rows / N) rows per rank, the
    last ranks fewer, or none. A plain tensor holds all its rows.
    """
    rows = param.shape[0]
    if not isinstance(param, DTensor):
        return 0, rows
    mesh = param.device_mesh
    chunk = math.ceil(rows / mesh.size())
    start = min(mesh.get_local_rank() * chunk, rows)
    stop = min(start + chunk, rows)
    if param.to_local().shape[0] != stop - start:
        raise RuntimeError(f"a shard of {tuple(param.shape)} holds {param.to_local().shape[0]} "
                           f"rows, not the {stop - start} of dim-0 sharding")
    return start, stop


# --- the tasks --------------------------------------------------------------------------

def shard_transformer(model: TinyTransformer, mesh=None, bf16: bool = False,
                      reshard_after_forward: bool = True) -> TinyTransformer:
    """``fully_shard`` each block, then the root; returns the same, now sharded, model.

    ``reshard_after_forward`` is the blocks' choice. The root's parameters (embeddings, final
    norm, head) stay gathered from its forward to its backward, which starts with the head.
    """
    # On the device the rank computes on (the CPU under gloo), not the machine's accelerator.
    mesh = device_mesh() if mesh is None else mesh
    raise NotImplementedError("Task 09.17: bf16 compute with gradients reduced in fp32 (else the default policy); a unit per block, resharded as asked; the root last, kept gathered")
    return model


def set_prefetch(blocks: list, ahead: int = 1) -> bool:
    """Each block, before it computes, starts the all-gathers of the ``ahead`` blocks that run
    after it: the next ones in forward, the previous ones (nearest first) in backward.

    Returns False, with one line, on a torch without explicit prefetch (FSDP2 then prefetches
    one block ahead by itself in backward).
    """
    if not hasattr(FSDPModule, "set_modules_to_forward_prefetch"):
        print("note: this torch has no explicit FSDP2 prefetch; using its implicit one",
              file=sys.stderr)
        return False
    if ahead < 1:
        return True
    raise NotImplementedError("Task 09.18: each block names the (at most `ahead`) blocks that run right after it: forward climbs the stack, backward comes down it")
    return True


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str = "cpu", seed: int = 0) -> nn.Module:
    """Give a model sharded on the meta device its memory, this rank's shards only, and its
    initial values: those :func:`init_full` gives the whole model with the same seed."""
    raise NotImplementedError("Task 09.19: allocate only what this rank holds, then fill each local shard with its own rows of the seeded initialisation")
    return model


def rank_slice(inputs: torch.Tensor, targets: torch.Tensor, rank: int, world_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of one global batch: the math of a step must not depend on how many
    ranks share it."""
    if len(inputs) % world_size:
        raise ValueError(f"a global batch of {len(inputs)} does not split over {world_size} "
                         "ranks; use a multiple of the world size")
    raise NotImplementedError("Task 09.20: equal, disjoint pieces of the global batch, in rank order, that together are all of it")


# --- building and training ------------------------------------------------------------------

def build_sharded(seed: int = 0, bf16: bool = False, reshard_after_forward: bool = True,
                  prefetch: int = 1, config: dict | None = None, mesh=None) -> TinyTransformer:
    """The practitioner's recipe: meta device, shard, prefetch, then memory and values."""
    with torch.device("meta"):  # shapes only: building the model allocates nothing
        model = TinyTransformer(**(config or CONFIG))
    shard_transformer(model, mesh=mesh, bf16=bf16, reshard_after_forward=reshard_after_forward)
    set_prefetch(list(model.blocks), ahead=prefetch)
    return materialize(model, rank_device(), seed)


def global_batch(step: int, seed: int = 0, config: dict | None = None,
                 batch: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: the same tokens whatever the world size."""
    cfg = config or CONFIG
    return token_batch(batch, cfg["seq_len"], cfg["vocab"], seed=seed * 100_003 + step)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def unsharded_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds whole right now (FSDP2 registers a unit's
    gathered parameters as plain tensors while it is unsharded, its shards as DTensors)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if not isinstance(p, DTensor))


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range | int,
                seed: int = 0, finish=None, record: dict | None = None) -> list[float]:
    """Train on the global batches of ``steps``; return each step's loss over the global batch.

    ``finish`` (the by-hand FSDP's ``finish_grad_sync``) runs between backward and the step.
    ``record`` (a dict) receives the step times in seconds and, on the first step, the bytes
    of parameters held whole between forward and backward.
    """
    rank, world_size = get_rank(), get_world_size()
    device = rank_device()
    steps = range(steps) if isinstance(steps, int) else steps
    losses = []
    for step in steps:
        start = time.perf_counter()
        x, y = (t.to(device) for t in rank_slice(*global_batch(step, seed), rank, world_size))
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        if record is not None and "held_after_forward" not in record:
            record["held_after_forward"] = unsharded_bytes(model)
        loss = loss_fn(logits, y)
        loss.backward()
        if finish is not None:
            finish()
        optimizer.step()
        loss = loss.detach().clone()
        if world_size > 1:  # equal slices: the mean of the ranks' means is the global mean
            dist.all_reduce(loss)
            loss /= world_size
        losses.append(loss.item())
        if record is not None:
            record.setdefault("step_s", []).append(time.perf_counter() - start)
    return losses


def measured_run(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 0,
                 finish=None, peak: bool = True) -> dict:
    """Train ``steps`` steps: the losses, the bytes kept between steps, the bytes held whole
    after a forward, the peak bytes of the first step (under ``dpt.memory.MemoryTracker``,
    untimed) and the median time of the other steps."""
    from dpt.memory import MemoryTracker

    record: dict = {}
    losses = []
    if peak:
        with MemoryTracker(rank_device().type) as mem:
            mem.track(model, optimizer)
            losses += train_steps(model, optimizer, range(1), seed, finish=finish)
        record["peak"] = mem.peak
    losses += train_steps(model, optimizer, range(len(losses), steps), seed, finish=finish,
                          record=record)
    times = record.get("step_s", [0.0])
    return {"rank": get_rank(), "losses": losses, "memory": measure_bytes(model, optimizer),
            "held_after_forward": record.get("held_after_forward"), "peak": record.get("peak"),
            "step_s": statistics.median(times[1:] or times)}


def practice_worker(rank: int, world_size: int, steps: int = 6, seed: int = 0,
                    bf16: bool = False, reshard_after_forward: bool = True, prefetch: int = 1,
                    peak: bool = True) -> dict:
    """Build with :func:`build_sharded` and train: see :func:`measured_run`."""
    model = build_sharded(seed, bf16=bf16, reshard_after_forward=reshard_after_forward,
                          prefetch=prefetch)
    return measured_run(model, make_optimizer(model.parameters()), steps, seed, peak=peak)


def by_hand_worker(rank: int, world_size: int, steps: int = 6, seed: int = 0,
                   bf16: bool = False, prefetch: bool = True, peak: bool = True) -> dict:
    """The same training with this lesson's hand-written FSDP (``fsdp_by_hand.FSDP``)."""
    from fsdp_by_hand import FSDP

    model = init_full(TinyTransformer(**CONFIG), seed).to(rank_device())
    fsdp = FSDP(model, compute_dtype=torch.bfloat16 if bf16 else None, prefetch=prefetch)
    del model  # the FSDP keeps its shards; the whole model's tensors are freed
    result = measured_run(fsdp, make_optimizer(fsdp.parameters()), steps, seed,
                          finish=fsdp.finish_grad_sync, peak=peak)
    result["held_after_forward"] = None  # its gathered units are not registered parameters
    return result


def plain_losses(steps: int = 6, seed: int = 0) -> list[float]:
    """The reference: the whole model in this process, on the whole global batch."""
    model = init_full(TinyTransformer(**CONFIG), seed)
    optimizer = make_optimizer(model.parameters())
    return train_steps(model, optimizer, steps, seed)


def compare(world_size: int = 2, steps: int = 6, seed: int = 0, by_hand: bool = True,
            timeout: float = 300) -> list[dict]:
    """One row per way of training the same model on the same batches: FSDP2 in fp32 and in
    bf16, with reshard_after_forward off, and the hand-written FSDP (fp32, bf16). Each row:
    its losses, the largest gap from the fp32 FSDP2 run's, rank 0's bytes, its step time."""
    from dpt.ranks import run_distributed

    runs = [("FSDP2 fp32", practice_worker, {}),
            ("FSDP2 bf16", practice_worker, {"bf16": True}),
            ("FSDP2 fp32, no reshard", practice_worker, {"reshard_after_forward": False}),
            ("FSDP2 fp32, no prefetch", practice_worker, {"prefetch": 0})]
    if by_hand:
        runs += [("by hand fp32", by_hand_worker, {}),
                 ("by hand bf16", by_hand_worker, {"bf16": True})]
    rows = []
    for name, fn, kwargs in runs:
        results = run_distributed(fn, world_size=world_size, timeout=timeout, echo=False,
                                  kwargs={"steps": steps, "seed": seed, **kwargs})
        r0 = results[0]
        rows.append({"run": name, "losses": r0["losses"], **r0["memory"],
                     "held_after_forward": r0["held_after_forward"], "peak": r0["peak"],
                     "step_ms": 1000 * max(r["step_s"] for r in results)})
    base = rows[0]["losses"]
    for row in rows:
        row["max_gap"] = max(abs(a - b) for a, b in zip(row["losses"], base))
    return rows


def format_rows(rows: list[dict]) -> str:
    def kib(v):
        return "-" if v is None else f"{v / 1024:.0f}"

    lines = [f"{'run':<24} {'loss first->last':>17} {'gap':>8} {'params':>7} {'grads':>6} "
             f"{'Adam':>6} {'held':>6} {'peak':>6} {'ms/step':>8}   (KiB, rank 0)"]
    for r in rows:
        lines.append(f"{r['run']:<24} {r['losses'][0]:>8.4f}->{r['losses'][-1]:<8.4f} "
                     f"{r['max_gap']:>8.1e} {kib(r['params']):>7} {kib(r['grads']):>6} "
                     f"{kib(r['optimizer']):>6} {kib(r['held_after_forward']):>6} "
                     f"{kib(r['peak']):>6} {r['step_ms']:>8.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (1, 2 or 4: the global batch "
                    f"of {GLOBAL_BATCH} splits evenly)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 reduction")
    ap.add_argument("--no-reshard", action="store_true",
                    help="keep each block gathered from its forward to its backward")
    ap.add_argument("--prefetch", type=int, default=1, help="blocks gathered ahead (0: none)")
    ap.add_argument("--compare", action="store_true",
                    help="FSDP2's variants and the hand-written FSDP, side by side")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    try:
        if args.nproc < 1 or GLOBAL_BATCH % args.nproc:
            raise ValueError(f"--nproc must divide the global batch of {GLOBAL_BATCH}")
        if not 1 <= args.steps <= 10_000 or args.prefetch < 0:
            raise ValueError("--steps must be 1..10000 and --prefetch at least 0")
        from dpt.precision import compute_format
        from dpt.ranks import placement, run_distributed

        if args.bf16 or args.compare:  # task 09.17's policy is bf16: say where it is emulated
            _, note = compute_format("bf16", placement(args.nproc).device)
            if note:
                print(note, file=sys.stderr)
        if args.compare:
            print(format_rows(compare(args.nproc, args.steps, timeout=args.timeout)))
            return 0

        results = run_distributed(
            practice_worker, world_size=args.nproc, timeout=args.timeout, echo=False,
            kwargs={"steps": args.steps, "bf16": args.bf16, "prefetch": args.prefetch,
                    "reshard_after_forward": not args.no_reshard})
    except (ValueError, RuntimeError, OSError, ImportError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    losses = results[0]["losses"]
    print(f"FSDP2 on {args.nproc} rank(s){', bf16' if args.bf16 else ''}"
          f"{', no reshard' if args.no_reshard else ''}: loss {losses[0]:.4f} -> "
          f"{losses[-1]:.4f} in {len(losses)} steps")
    for r in results:
        m = r["memory"]
        print(f"rank {r['rank']}: params {m['params'] / 1024:.0f} KiB, grads "
              f"{m['grads'] / 1024:.0f} KiB, Adam {m['optimizer'] / 1024:.0f} KiB, held whole "
              f"after forward {r['held_after_forward'] / 1024:.0f} KiB, peak "
              f"{r['peak'] / 1024:.0f} KiB, {1000 * r['step_s']:.1f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
