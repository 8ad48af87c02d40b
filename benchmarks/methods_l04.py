"""Lesson 04's benchmark methods: DDP launched by torchrun, and the snapshots of fault tolerance.

``ddp_torchrun`` has torchrun start the ranks (``launcher="torchrun"``), which join the group
with lesson 04's own code. Launching with torchrun does not change a training step, so its
step time should match ``ddp_spawn``'s at the same N; the record's ``wall_s`` (start-up
included) shows the launcher's fixed cost. What lesson 04 adds to the cost of training is the
snapshot: a gather of every rank's RNG state, rank 0's atomic write (serialize, fsync, rename)
and a barrier. ``ddp_snapshot`` times DDP steps with a snapshot every ``snapshot_every`` steps
(option, default 10: one in every window of 10 timed steps), so that against plain DDP it
shows what fault tolerance costs per step at that frequency.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.registry import BenchContext, method, optimizer_step
from dpt.lessons import load


@method("ddp_snapshot",
        "torch DDP (the step torchrun launches in lesson 04) + a rank-0 atomic snapshot of "
        "model, optimizer and RNG every 10 steps")
def ddp_snapshot(ctx: BenchContext):
    Trainer = load("04_ddp_torchrun", "ddp_torchrun", "solutions").Trainer  # lesson 04's module

    model = ctx.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    every = int(ctx.options.get("snapshot_every", 10))
    folder = Path(tempfile.mkdtemp(prefix=f"dpt-l04-bench-r{ctx.rank}-"))
    weakref.finalize(opt, shutil.rmtree, folder, True)
    # no data loader: a snapshot only reads the sampler's seed from it
    data = SimpleNamespace(sampler=SimpleNamespace(seed=ctx.seed))
    trainer = Trainer(model, data, opt, ctx.device, snapshot_path=folder / "snapshot.pt")
    batch = ctx.batch()
    count = {"steps": 0}

    def step() -> float:
        loss = optimizer_step(trainer.model, opt, batch)
        count["steps"] += 1
        if count["steps"] % every == 0:
            trainer._save_snapshot(count["steps"])
        return loss

    return step


@method("ddp_torchrun",
        "torch DDP launched by torchrun, joined as lesson 04 does (torchrun_env + setup), "
        "stepping lesson 04's Trainer.model", launcher="torchrun")
def ddp_torchrun(ctx: BenchContext):
    Trainer = load("04_ddp_torchrun", "ddp_torchrun", "solutions").Trainer  # lesson 04

    model = ctx.model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = Trainer(model, None, opt, ctx.device)  # wraps in DDP; no data loader needed
    batch = ctx.batch()

    def step() -> float:
        return optimizer_step(trainer.model, opt, batch)

    def compute_only() -> float:
        with trainer.model.no_sync():
            return optimizer_step(trainer.model, opt, batch)

    return step, {"compute_step": compute_only}
