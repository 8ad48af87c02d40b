# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 09: activation checkpointing: keep each block's input, recompute the rest in backward.

Sharding (lesson 08, FSDP) divides the model state by N; it does nothing for the
*activations*, the tensors autograd keeps from the forward so that backward can use them.
They grow with the batch and the sequence, and in a transformer they soon outweigh the model.

For one pre-norm :class:`dpt.models.Block` (width d, h heads, MLP ratio r) on b sequences of
t tokens, backward needs, per token:

==========================================  ==============================================
kept by                                      elements per token
==========================================  ==============================================
``norm1`` (its input x, mean and 1/std)      d + 2
``qkv`` (its input: the normed x)            d
the attention (q, k, v; its output; the      3d + d + h
log-sum-exp per head)
``proj`` (its input: the attention output)   shares the attention output's memory
``norm2`` (its input x1, mean and 1/std)     d + 2
``fc1`` (its input: the normed x1)           d
GELU (its input: fc1's output)               r d
``fc2`` (its input: GELU's output)           r d
==========================================  ==============================================

Checkpointing a block (``torch.utils.checkpoint.checkpoint``) keeps only its input; backward
runs the block's forward again to rebuild the rest, one block at a time. Memory falls from
``layers`` blocks' worth to ``layers`` inputs plus one block; the price is a second forward of
every block, about a third more compute per step.

    .venv/bin/python exercises/09_fsdp/activation_checkpointing.py            # both, one rank
    .venv/bin/python exercises/09_fsdp/activation_checkpointing.py --nproc 2  # per rank, DDP
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dpt.memory import MemoryTracker
from dpt.models import TinyTransformer, token_batch


def block_activation_bytes(batch: int, seq_len: int, dim: int, heads: int, mlp_ratio: int = 4,
                           bytes_per_element: int = 4) -> int:
    """Bytes one :class:`~dpt.models.Block` keeps from its forward for its backward.

    Counts the block's input too (``norm1`` keeps it); not the block's output, which the
    next layer keeps as its own input.
    """
    raise NotImplementedError("Task 09.14: add up, per token, what each layer of the table in the docstring keeps")


def stack_activation_bytes(block_bytes: int, input_bytes: int, layers: int,
                           checkpointed: bool) -> int:
    """The most activation memory a stack of ``layers`` equal blocks holds during a step.

    ``block_bytes``: what one block keeps (:func:`block_activation_bytes`, its input
    included); ``input_bytes``: its input alone. Without checkpointing every block's
    activations are alive when backward starts; with it, what is alive at once?
    """
    raise NotImplementedError("Task 09.15: with checkpointing, every block keeps its input, and backward rebuilds one block at a time")


def model_activation_bytes(batch: int, seq_len: int, dim: int = 64, heads: int = 4,
                           layers: int = 4, vocab: int = 256, mlp_ratio: int = 4,
                           checkpointed: bool = False, bytes_per_element: int = 4) -> int:
    """The whole :class:`~dpt.models.TinyTransformer` with the lesson's loss: the blocks'
    stack, plus what the final norm (its input, mean and 1/std), the head (its input) and
    cross-entropy (the log-probabilities, ``vocab`` per token) keep."""
    tokens = batch * seq_len
    block = block_activation_bytes(batch, seq_len, dim, heads, mlp_ratio, bytes_per_element)
    stack = stack_activation_bytes(block, tokens * dim * bytes_per_element, layers, checkpointed)
    return stack + tokens * (2 * dim + 2 + vocab) * bytes_per_element


class CheckpointedTransformer(TinyTransformer):
    """:class:`~dpt.models.TinyTransformer` whose blocks keep only their inputs for backward.

    Same parameters, same names, same results: load one's state dict into the other.
    """

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.seq_len}")
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            raise NotImplementedError("Task 09.16: run the block so that backward recomputes its forward instead of keeping its activations (non-reentrant)")
        return self.head(self.norm(x))


def build(checkpointed: bool, seed: int = 0, **model_kwargs) -> TinyTransformer:
    """The same initial weights with or without checkpointing."""
    torch.manual_seed(seed)
    model = TinyTransformer(**model_kwargs)
    if not checkpointed:
        return model
    twin = CheckpointedTransformer(**model_kwargs)
    twin.load_state_dict(model.state_dict())
    return twin


def loss_of(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


def measure_step(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
    """Bytes of one forward + backward (no optimizer): the activations alive after the forward,
    and the peak above what was alive before it (activations, gradients, temporaries)."""
    device = inputs.device
    with MemoryTracker(device.type) as mem:
        mem.track(model, inputs, targets)
        start = mem.reset_peak()
        loss = loss_of(model, inputs, targets)
        after_forward = mem.current - start
        loss.backward()
        peak = mem.peak - start
    return {"after_forward": after_forward, "peak": peak, "loss": loss.item()}


def time_steps(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
               steps: int = 5, warmup: int = 1) -> list[float]:
    """Seconds of each of ``steps`` forward + backward passes (no memory tracking)."""
    times = []
    for i in range(warmup + steps):
        if inputs.device.type == "cuda":
            torch.cuda.synchronize(inputs.device)
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss_of(model, inputs, targets).backward()
        if inputs.device.type == "cuda":
            torch.cuda.synchronize(inputs.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def compare_worker(rank: int, world_size: int, batch: int = 8, seq_len: int = 256,
                   layers: int = 8, dim: int = 64, heads: int = 4, steps: int = 5,
                   seed: int = 0) -> dict:
    """On this rank: peak memory and step time of one forward + backward, with and without
    checkpointing (:func:`measure_step`, :func:`time_steps`). Under a process group the models
    are wrapped in DDP: each rank's activations are those of its own batch."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpt.dist import rank_device

    device = rank_device()
    sizes = {"dim": dim, "heads": heads, "layers": layers, "seq_len": seq_len}
    inputs, targets = token_batch(batch, seq_len, seed=seed * 1000 + rank, device=device)
    out = {"rank": rank, "batch": batch, **sizes}
    for checkpointed in (False, True):
        model = build(checkpointed, seed, **sizes).to(device)
        if dist.is_initialized() and world_size > 1:
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        key = "checkpointed" if checkpointed else "plain"
        times = time_steps(model, inputs, targets, steps)
        out[key] = {**measure_step(model, inputs, targets),
                    "step_s": statistics.median(times), "step_s_all": times}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=1, help="ranks (DDP when more than 1)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        if min(args.nproc, args.batch, args.seq_len, args.layers, args.steps) < 1:
            raise ValueError("--nproc, --batch, --seq-len, --layers and --steps must be at least 1")
        kwargs = {"batch": args.batch, "seq_len": args.seq_len, "layers": args.layers,
                  "steps": args.steps}
        from dpt.ranks import run_distributed

        results = run_distributed(compare_worker, world_size=args.nproc, kwargs=kwargs,
                                  timeout=600, echo=False)
    except (ValueError, RuntimeError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    mib = 2**20
    print(f"TinyTransformer, {args.layers} blocks, {args.batch} x {args.seq_len} tokens per rank")
    for r in results:
        for key in ("plain", "checkpointed"):
            m = r[key]
            predicted = model_activation_bytes(args.batch, args.seq_len, layers=args.layers,
                                               checkpointed=key == "checkpointed")
            print(f"rank {r['rank']} {key:>12}: activations predicted {predicted / mib:6.1f} "
                  f"MiB, measured after forward {m['after_forward'] / mib:6.1f} MiB, peak of "
                  f"the step {m['peak'] / mib:6.1f} MiB, {m['step_s'] * 1e3:6.1f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
