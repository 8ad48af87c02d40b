"""Lesson 03's method: plain torch DDP, one process per device, as ``ddp_spawn.py`` trains.

The harness has already joined the process group, so the method only wraps the model the way
the lesson does (``ddp_spawn.wrap_model``) and runs the lesson's step. ``compute_step`` is the
same step under ``no_sync()`` (no gradient all-reduce), so the harness can split the time into
compute and communication.
"""

from __future__ import annotations

import torch

from benchmarks.registry import BenchContext, method


@method("ddp_spawn", "torch DDP as in lesson 03 (mp.spawn): all-reduce of gradients in backward")
def ddp_spawn(ctx: BenchContext):
    import ddp_spawn as lesson

    model = lesson.wrap_model(ctx.model(), ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = ctx.batch()

    def step() -> float:
        return lesson.train_step(model, batch, opt, ctx.device)

    def compute_only() -> float:
        with model.no_sync():
            return lesson.train_step(model, batch, opt, ctx.device)

    return step, {"compute_step": compute_only}
