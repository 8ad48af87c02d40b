"""Lesson 03's method: plain torch DDP, one process per device, as ``ddp_spawn.py`` trains.

The harness has already joined the process group, so the method builds the lesson's
``Trainer`` (which moves the model to the device and wraps it in DDP) and times its
``_run_batch``. ``compute_step`` is the same step under ``no_sync()`` (no gradient
all-reduce), so the harness can split the time into compute and communication.
"""

from __future__ import annotations

import torch

from benchmarks.registry import BenchContext, method
from dpt.lessons import load


@method("ddp_spawn", "torch DDP as in lesson 03 (mp.spawn): all-reduce of gradients in backward")
def ddp_spawn(ctx: BenchContext):
    lesson = load("03_ddp_spawn", "ddp_spawn", "solutions")

    model = ctx.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = lesson.Trainer(model, None, opt, ctx.device)  # to the device, wrapped in DDP
    x, y = ctx.batch()

    def step() -> float:
        return trainer._run_batch(x, y)

    def compute_only() -> float:
        with trainer.model.no_sync():
            return trainer._run_batch(x, y)

    return step, {"compute_step": compute_only}
