"""Lesson 09: a rank's memory during one training step, predicted and measured.

Lesson 08 counted what a rank keeps *between* steps. A step needs more for a moment, and the
largest moment, the peak, is what must fit on the device. With P parameters (fp32, Adam) on
N ranks and A bytes of activations (``activation_checkpointing``), per rank:

=======  =====================  ===============================  ===========================
method   kept all step          buffers                          the step's largest moment
=======  =====================  ===============================  ===========================
DDP      4P + 8P (Adam)         4P: DDP's gradient buckets       max(A, 4P): backward trades
                                                                 activations for gradients
ZeRO-1   4P + 8P/N              4P: the buckets                  max(A, 4P + 4P/N): then the
                                                                 owners' broadcast buffer
ZeRO-2   4P + 8P/N              none                             max(A, 4P + 4P/N): all the
                                                                 gradients, then one owner's
                                                                 reduce buffer
FSDP     4P/N + 8P/N            the root unit and the block in   when backward starts: every
                                use, gathered, plus the next     activation, and the full
                                one when prefetching             gradients of the root and of
                                                                 the block in backward
=======  =====================  ===============================  ===========================

(``zero_grad`` frees the gradients, so under FSDP the sharded gradients are not there yet
when backward starts.) :func:`predict_peak` writes this down; :func:`measure_worker` runs one
step of each method and counts the bytes its tensors really hold (``dpt.memory``).

What the prediction leaves out: the gradients of the logits and of the log-probabilities at
the start of backward (2 x batch x tokens x vocab x 4 bytes), the backward's and Adam's
temporaries, the padding of shards to a multiple of N, ZeRO's whole-tensor shards (one rank
may own a tensor more), buffers that outlive their use (lesson 08's loop builds the next
owner's buffer before the previous one is freed), and what no tensor owns (gloo's staging
copies, the allocator's rounding and cache).

    .venv/bin/python solutions/09_fsdp/memory_table.py              # every method, N = 2
    .venv/bin/python solutions/09_fsdp/memory_table.py --nproc 2 4
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import sys

import torch
import torch.nn.functional as F
from fsdp2_practice import CONFIG  # the lesson's model

from dpt.lessons import load
from dpt.memory import MemoryTracker, allocator_peak, reset_allocator_peak
from dpt.models import TinyTransformer, token_batch

zero_accounting = load("08_sharding", "zero_accounting", __file__)  # lesson 08, this tree's
measure_bytes, predict_bytes = zero_accounting.measure_bytes, zero_accounting.predict_bytes

METHODS = ("ddp", "zero1", "zero2", "fsdp", "fsdp2")
LABELS = {"ddp": "DDP", "zero1": "ZeRO-1 (lesson 08)", "zero2": "ZeRO-2 (lesson 08)",
          "fsdp": "FSDP by hand", "fsdp2": "FSDP2 (fully_shard)"}
STAGE = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "fsdp": "zero3", "fsdp2": "zero3"}
KINDS = ("params", "grads", "optimizer", "buffers", "activations", "peak")


def units_of(model: TinyTransformer) -> list[int]:
    """Parameter counts of the sharding units: the root (everything outside the blocks) first,
    then each block."""
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return [sum(p.numel() for p in model.parameters()) - sum(blocks), *blocks]


def predict_peak(method: str, units: list[int], world_size: int, activation_bytes: float,
                 prefetch: bool = True, param_bytes: int = 4, grad_bytes: int = 4,
                 state_bytes: int = 8) -> dict[str, float]:
    """Predicted bytes on one rank: what it keeps between steps (lesson 08), the buffers of
    the step, the activations, and the peak of one step.

    ``units``: parameter counts, the root unit first then the blocks (:func:`units_of`).
    ``params``, ``grads`` and ``optimizer`` are lesson 08's resting state; ``buffers`` what
    the method allocates besides (gradient buckets, gathered units and their full gradients);
    ``peak`` the largest moment of the step, as the module's table says.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    n, total = world_size, sum(units)
    rest = predict_bytes(total, n, STAGE[method], param_bytes, grad_bytes, state_bytes)
    params, state = rest["params"], rest["optimizer"]
    grads = total * grad_bytes  # every gradient, before any reduction
    if method in ("ddp", "zero1"):
        buffers = grads  # DDP's buckets, as large as the gradients, allocated once
        after_backward = grads + (0 if method == "ddp" else grads / n)
        peak = params + state + buffers + max(activation_bytes, after_backward)
    elif method == "zero2":
        buffers = grads / n  # one owner's gradients, flattened for its reduce
        peak = params + state + max(activation_bytes, grads + buffers)
    else:
        # BEGIN SOLUTION 09.13: when backward starts: shards and state, the root and the largest block gathered (plus the next largest when prefetching), the full gradients of the root and the largest block, every activation
        root, blocks = units[0], sorted(units[1:], reverse=True)
        gathered = root + blocks[0] + (blocks[1] if prefetch and len(blocks) > 1 else 0)
        buffers = gathered * param_bytes + (root + blocks[0]) * grad_bytes
        peak = params + state + buffers + activation_bytes
        # END SOLUTION
    return {**{k: rest[k] for k in ("params", "grads", "optimizer")}, "buffers": buffers,
            "activations": activation_bytes, "peak": peak}


def predicted_activations(batch: int, config: dict | None = None) -> int:
    """The TinyTransformer's activations for ``batch`` sequences (``activation_checkpointing``)."""
    from activation_checkpointing import model_activation_bytes

    c = {**CONFIG, **(config or {})}
    return model_activation_bytes(batch, c["seq_len"], c["dim"], c["heads"], c["layers"],
                                  c["vocab"])


# --- measuring ------------------------------------------------------------------------------

def wrap(method: str, model: torch.nn.Module, lr: float = 1e-3):
    """(model, optimizer, after_backward) for ``method`` on this rank's process group."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpt.dist import device_mesh, rank_device

    device = rank_device()
    ids = [device.index] if device.type == "cuda" else None
    if method == "ddp":
        model = DDP(model, device_ids=ids)
        return model, torch.optim.Adam(model.parameters(), lr=lr), None
    if method in ("zero1", "zero2"):
        ShardedOptimizer = load("08_sharding", "zero_optimizer", __file__).ShardedOptimizer
        if method == "zero1":
            model = DDP(model, device_ids=ids)
        opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=lr)
        return model, opt, (opt.reduce_gradients if method == "zero2" else None)
    if method == "fsdp":
        from fsdp_by_hand import FSDP

        model = FSDP(model)
        return model, torch.optim.Adam(model.parameters(), lr=lr), model.finish_grad_sync
    if method == "fsdp2":  # lesson 08's shard_model, written out: this table needs no Task 08.4
        from torch.distributed.fsdp import fully_shard

        mesh = device_mesh()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=lr), None
    raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")


def measure_worker(rank: int, world_size: int, method: str = "fsdp2", batch: int = 1,
                   seed: int = 0, config: dict | None = None) -> dict:
    """One rank: a warm-up step (Adam's state exists from then on), then one measured step.

    Returns what the rank keeps after the step (``params``, ``grads``, ``optimizer``), the
    activations of its batch (a plain copy's forward), and the peak of the step, in bytes
    (on a GPU also ``allocator_peak``: what CUDA's caching allocator saw, rounding included).
    """
    from dpt.dist import rank_device

    device = rank_device()
    config = {**CONFIG, **(config or {})}
    inputs, targets = token_batch(batch, config["seq_len"], config["vocab"],
                                  seed=seed * 1000 + rank, device=device)

    def loss_of(model):
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    with MemoryTracker(device.type) as mem:
        torch.manual_seed(seed)
        model = TinyTransformer(**config).to(device)
        units = units_of(model)
        before = mem.current
        loss = loss_of(model)  # the activations, on a plain model: the same for every method
        activations = mem.current - before
        del loss
        model, opt, after_backward = wrap(method, model)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_of(model).backward()
            if after_backward is not None:
                after_backward()
            opt.step()

        step()
        mem.reset_peak()
        reset_allocator_peak(device)
        step()
        peak = mem.peak
    return {"rank": rank, "method": method, "world_size": world_size, "units": units,
            **measure_bytes(model, opt), "activations": activations, "peak": peak,
            "allocator_peak": allocator_peak(device)}


def table_rows(measured: dict[tuple[str, int], list[dict]], batch: int,
               config: dict | None = None) -> list[dict]:
    """One row per (method, N): predicted and measured bytes side by side (measured: the
    fullest rank). ``measured`` maps (method, N) to the ranks' :func:`measure_worker` results."""
    acts = predicted_activations(batch, config)
    rows = []
    for (method, n), ranks in measured.items():
        pred = predict_peak(method, ranks[0]["units"], n, acts)
        meas = {k: max(r[k] for r in ranks) for k in ("params", "grads", "optimizer",
                                                      "activations", "peak")}
        rows.append({"method": method, "world_size": n, "predicted": pred, "measured": meas})
    return rows


def format_rows(rows: list[dict], unit: float = 2**20) -> str:
    """The rows as a text table, MiB, "predicted / measured"."""
    head = f"{'method':<22}{'N':>3}" + "".join(f"{k:>20}" for k in KINDS)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for k in KINDS:
            pred = r["predicted"][k] / unit
            meas = r["measured"].get(k)
            cells.append(f"{pred:9.2f} / {meas / unit:6.2f}" if meas is not None
                         else f"{pred:9.2f} /    -  ")
        lines.append(f"{LABELS[r['method']]:<22}{r['world_size']:>3}" + "".join(
            f"{c:>20}" for c in cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, nargs="+", default=[2], help="numbers of ranks")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank")
    args = ap.parse_args(argv)
    try:
        if min(args.nproc) < 1 or args.batch < 1:
            raise ValueError("--nproc and --batch must be at least 1")
        from dpt.ranks import run_distributed

        measured = {(m, n): run_distributed(measure_worker, world_size=n, timeout=300,
                                            kwargs={"method": m, "batch": args.batch},
                                            echo=False)
                    for n in args.nproc for m in args.methods}
    except (ValueError, RuntimeError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    print(f"TinyTransformer {CONFIG}, Adam fp32, {args.batch} sequence(s) per rank; "
          "MiB per rank, predicted / measured")
    print(format_rows(table_rows(measured, args.batch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
