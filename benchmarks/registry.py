"""The method registry every lesson plugs into.

A *method* is one way of running a training step on N ranks (plain DDP, a hand-written DDP,
bf16 autocast, FSDP2, ...). Lessons register theirs in ``benchmarks/methods_lNN.py``::

    from benchmarks.registry import BenchContext, method

    @method("ddp_naive", "hand-written DDP: all-reduce every gradient after backward")
    def ddp_naive(ctx: BenchContext):
        model = ctx.model().to(ctx.device)
        ...
        def step() -> float:            # one full training step on ctx.batch()
            ...
            return loss.item()
        return step                     # or (step, extras): see below

The harness (``benchmarks/run.py``) starts the ranks, initializes the process group
(gloo on CPU, NCCL on GPUs), calls the method on every rank, runs warm-up steps, then timed
steps with device synchronization around each, and records throughput, peak memory and the
final loss. ``timers`` lets a method report, per step, seconds spent in communication
(key ``"comm"``); the harness resets it before each timed step. Return
``(step, {"timers": timers})``, or ``(step, {"compute_step": fn})`` where ``fn`` does the same
step without communication (``ddp.no_sync()``): the harness times both, and the difference is
communication plus waiting. ``{"notes": [...]}`` adds lines to the record (a dtype the
method chose for this device, say). ``{"inner_steps": H}`` says that one call of ``step`` is
a round of H optimizer steps and one synchronisation (lesson 13's LocalSGD and DiLoCo, which
communicate once every H steps): the harness divides every time by H, so samples per second
still count one batch per rank per optimizer step, and ``compute_step`` is the same round
without its sync.

A method must not fake work it does not do: ``requires`` says when it cannot run
("cuda", "cuda>=2", "apex", "compiler"; "bf16": left out on a CPU without bf16 instructions
unless ``--methods`` names it), and the harness records it as skipped with that reason.

``quick=False`` leaves a method out of ``--quick`` (``QUICK=1 make benchmark``) unless
``--methods`` names it: the quick run must fit 5 minutes on 8 GPUs, so lessons from 10 on
(whose methods compile graphs or compress gradients, variations of DDP that the quick run
already times) are in the full run only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dpt.models import build_model


@dataclass
class BenchContext:
    rank: int
    world_size: int
    device: torch.device
    batch_size: int  # per rank
    model_name: str = "convnet"
    seed: int = 0
    options: dict = field(default_factory=dict)

    def model(self) -> torch.nn.Module:
        """The benchmark model, with the same initial weights on every rank."""
        torch.manual_seed(self.seed)
        return build_model(self.model_name)

    def batch(self, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A synthetic MNIST-shaped batch for this rank (different data on each rank)."""
        g = torch.Generator().manual_seed(self.seed * 100003 + self.rank * 1009 + step)
        x = torch.randn(self.batch_size, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (self.batch_size,), generator=g)
        return x.to(self.device), y.to(self.device)


def slowest_rank_seconds(fn: Callable[[], object], n: int, device: torch.device) -> float:
    """Seconds per call of ``fn`` over ``n`` calls, as the slowest rank saw them.

    The ranks start together (barrier), the device's queue is drained before each clock read,
    and the per-rank means are reduced with MAX: a data-parallel step is as slow as its slowest
    rank. Every rank must call it.
    """
    import time

    import torch.distributed as dist

    from dpt.device import synchronize

    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    synchronize(device)
    t = torch.tensor([(time.perf_counter() - start) / n], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> float:
    """The plain training step most methods time: zero, forward, cross-entropy, backward, step."""
    import torch.nn.functional as F

    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def ddp_steps(ddp, optimizer: torch.optim.Optimizer, batch) -> tuple[Callable, dict]:
    """What a method built on a DDP-like model returns: its :func:`optimizer_step`, and the
    same step under ``ddp.no_sync()`` as ``compute_step`` (no gradient communication)."""

    def compute_only() -> float:
        with ddp.no_sync():
            return optimizer_step(ddp, optimizer, batch)

    return lambda: optimizer_step(ddp, optimizer, batch), {"compute_step": compute_only}


@dataclass
class Method:
    name: str
    description: str
    factory: Callable
    requires: tuple[str, ...] = ()
    min_procs: int = 1
    lesson: str = ""
    max_procs: int | None = None
    launcher: str = "spawn"  # "spawn": dpt.ranks.run_distributed; "torchrun": torchrun
    quick: bool = True  # part of --quick when --methods is not given
    # A method that trains a model of its own (not --model): the model FLOPs of one step at a
    # per-rank batch, for its MFU (benchmarks.run.add_mfu), and the model's name
    step_flops: Callable[[int], int] | None = None
    flops_model: str | None = None


REGISTRY: dict[str, Method] = {}


def method(name: str, description: str, requires: tuple[str, ...] = (), min_procs: int = 1,
           max_procs: int | None = None, launcher: str = "spawn", quick: bool = True,
           step_flops: Callable[[int], int] | None = None, flops_model: str | None = None):
    """Register a benchmark method (see the module docstring).

    ``launcher="torchrun"`` starts the ranks with torchrun (``benchmarks/torchrun_worker.py``)
    instead of the harness's own process starter; the timing is the same code either way.
    ``step_flops(per_rank_batch)`` and ``flops_model``: for a method that trains its own model
    instead of ``--model``, that model's FLOPs a step and its name, so its MFU counts them.
    """
    if (step_flops is None) != (flops_model is None):
        raise ValueError("give step_flops and flops_model together")
    if launcher not in ("spawn", "torchrun"):
        raise ValueError(f"launcher must be 'spawn' or 'torchrun', not {launcher!r}")

    def wrap(fn: Callable) -> Callable:
        if name in REGISTRY:
            raise ValueError(f"benchmark method {name!r} is registered twice")
        REGISTRY[name] = Method(name, description, fn, tuple(requires), min_procs,
                                fn.__module__.rsplit("_", 1)[-1], max_procs, launcher, quick,
                                step_flops, flops_model)
        return fn

    return wrap


def load_all() -> dict[str, Method]:
    """Import every ``benchmarks/methods_*.py`` so their methods register."""
    import importlib
    import pkgutil
    from pathlib import Path

    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith("methods_"):
            importlib.import_module(f"benchmarks.{info.name}")
    # Extra method modules (the harness's own tests register failing methods this way).
    for extra in filter(None, os.environ.get("DPT_BENCH_EXTRA", "").split(",")):
        importlib.import_module(extra)
    return REGISTRY
