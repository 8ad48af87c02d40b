# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 06: where the casts happen, and what DDP all-reduces under autocast.

Two instruments for ``ddp_amp.py``'s training, which leave it unchanged:

- :func:`cast_map`: one training step of lesson 06's ``Trainer`` (your ``_run_batch``), and
  per layer the dtype of its weights, of its input and of its output in the forward. The
  weights stay fp32; a conv or a linear layer computes in bf16/fp16 on *copies* of them.
- :func:`recording_allreduce_hook`: a DDP communication hook that notes the dtype of every
  gradient bucket, then all-reduces it as DDP does by default. Under autocast the buckets
  are fp32: they hold the fp32 parameters' gradients.

:func:`ddp_dtypes` runs a few steps of lesson 06's ``Trainer`` with the hook on every rank;
the notebook starts it with ``dpt.ranks.run_distributed``::

    .venv/bin/python exercises/06_mixed_precision/amp_inspect.py --precision bf16
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import sys

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from dpt import cli
from dpt.dist import group_of_one, rank_device
from dpt.models import build_model
from dpt.precision import add_precision_argument, choose_precision


class DtypeRecorder:
    """State for :func:`recording_allreduce_hook`: the dtype of each bucket all-reduced."""

    def __init__(self, group=None):
        self.group = group
        self.dtypes: list[torch.dtype] = []


def recording_allreduce_hook(state, bucket):
    """A DDP comm hook: note the bucket's dtype, then do exactly what DDP does by default.

    (No type annotations: DDP checks them, and ``from __future__ import annotations`` would
    turn them into strings it rejects.)
    """
    raise NotImplementedError("Task 06.3: record the bucket's dtype, then do DDP's default all-reduce")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def cast_map(trainer, source: torch.Tensor, targets: torch.Tensor) -> list[dict]:
    """One step of ``trainer`` on a batch and, per leaf module, the dtypes its forward saw.

    Rows: module name, type, parameter dtype, input dtype, output dtype. Under bf16 autocast
    the parameters stay fp32 while conv/linear outputs are bf16: the cast happens inside
    the op, on a copy of the weight. (The step is a real one: the weights move.)
    """
    rows, handles = [], []
    for name, mod in getattr(trainer.model, "module", trainer.model).named_modules():
        if list(mod.children()):
            continue

        def hook(m, inp, out, name=name):
            p = next(m.parameters(), None)
            rows.append({"module": name, "type": type(m).__name__,
                         "param": _name(p.dtype) if p is not None else "-",
                         "input": _name(inp[0].dtype), "output": _name(out.dtype)})

        handles.append(mod.register_forward_hook(hook))
    try:
        trainer._run_batch(source.to(trainer.device), targets.to(trainer.device))
    finally:
        for h in handles:
            h.remove()
    return rows


def synthetic_data(n: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def ddp_dtypes(rank: int, world_size: int, precision: str = "bf16", steps: int = 3,
               batch_size: int = 8, seed: int = 0) -> dict:
    """One rank, inside a process group: ``steps`` steps of lesson 06's ``Trainer`` on
    synthetic data (rank ``r`` takes the ``r``-th slice of each batch), with the recording
    hook on its DDP model.

    Returns the losses, the dtypes DDP all-reduced, those of the parameters and gradients,
    and a flat copy of the final parameters (equal on every rank when DDP did its job).
    """
    from ddp_amp import Trainer  # this lesson's script, from the same tree

    device = rank_device()
    torch.manual_seed(seed)  # the same initial weights everywhere (DDP broadcasts them too)
    model = build_model("convnet")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    trainer = Trainer(model, None, optimizer, device, precision=precision)
    recorder = DtypeRecorder()
    trainer.model.register_comm_hook(recorder, recording_allreduce_hook)
    x, y = synthetic_data(batch_size * world_size * steps, seed)
    losses = []
    for step in range(steps):
        lo = (step * world_size + rank) * batch_size
        losses.append(trainer._run_batch(x[lo:lo + batch_size].to(device),
                                         y[lo:lo + batch_size].to(device)))
    params = list(trainer.model.module.parameters())
    return {"rank": rank, "losses": losses,
            "allreduce_dtypes": sorted({str(d) for d in recorder.dtypes}),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in params if p.grad is not None}),
            "params": torch.cat([p.detach().float().flatten().cpu() for p in params])}


def main(args: argparse.Namespace) -> None:
    from ddp_amp import Trainer

    from dpt.ranks import run_distributed

    device = torch.device("cpu")  # the CPU and gloo, on any machine
    choose_precision(device, args.precision)  # refuse fp16 here, in one line
    torch.manual_seed(0)
    model = build_model("convnet")
    with group_of_one(device):
        trainer = Trainer(model, None, torch.optim.SGD(model.parameters(), lr=0.01), device,
                          precision=args.precision)
        rows = cast_map(trainer, *synthetic_data(2))
    print(f"one step of the ConvNet under {args.precision} autocast, on the CPU:")
    for row in rows:
        print(f"  {row['module']:10} {row['type']:12} weights {row['param']:8} "
              f"in {row['input']:9} out {row['output']}")
    results = run_distributed(ddp_dtypes, world_size=2, backend="gloo", timeout=300,
                              kwargs={"precision": args.precision, "steps": args.steps,
                                      "batch_size": args.batch_size})
    r = results[0]
    print(f"DDP on 2 CPU ranks: all-reduced {r['allreduce_dtypes']}, parameters "
          f"{r['param_dtypes']}, gradients {r['grad_dtypes']}; ranks in sync: "
          f"{torch.equal(results[0]['params'], results[1]['params'])}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="training steps per rank")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    return add_precision_argument(p, default="bf16")


if __name__ == "__main__":
    sys.exit(cli.main(main, build_parser()))
