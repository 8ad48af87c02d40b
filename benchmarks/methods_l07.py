"""Lesson 07's method: Lightning's ``ddp`` strategy, through Fabric, around the same step.

The harness times one step at a time, and Lightning's ``Trainer`` owns its loop, so the
per-step method uses Lightning Fabric (the lesson's minimal-change path): Fabric's ``ddp``
strategy wraps the model in DDP and runs ``fabric.backward``; the step is otherwise
``optimizer_step``'s. Against ``ddp_spawn`` (lesson 03's torch DDP) at the same N it shows
what Lightning's wrapping costs per step. The Trainer's cost over a whole epoch (hooks,
logging, its data fetcher) is measured by ``benchmarks/bench_l07_lightning_vs_raw.py``.

The harness has already joined the process group. Fabric finds it (Lightning skips
``init_process_group`` when a group exists) and reads this rank from ``LOCAL_RANK``, which
the harness and torchrun set, so ``fabric.launch()`` starts no new processes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.registry import BenchContext, method


@method("lightning_ddp", "Lightning Fabric, strategy='ddp' (lesson 07): Lightning's DDP "
        "wrapper and fabric.backward around the plain step", requires=("lightning",))
def lightning_ddp(ctx: BenchContext):
    from lightning_fabric import Fabric

    threads = torch.get_num_threads()  # the harness's budget; kept through Fabric's set-up
    accelerator = "cuda" if ctx.device.type == "cuda" else "cpu"
    strategy = "ddp" if ctx.world_size > 1 else "auto"
    fabric = Fabric(accelerator=accelerator, devices=ctx.world_size, strategy=strategy,
                    num_nodes=1)
    fabric.launch()
    if fabric.world_size != ctx.world_size or fabric.global_rank != ctx.rank:
        raise RuntimeError(f"Fabric sees rank {fabric.global_rank} of {fabric.world_size}, "
                           f"the harness rank {ctx.rank} of {ctx.world_size}")
    torch.set_num_threads(threads)
    model = ctx.model()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    x, y = fabric.to_device(ctx.batch())

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss)  # DDP all-reduces the gradients here
        opt.step()
        return loss.item()

    def compute_only() -> float:
        with fabric.no_backward_sync(model, enabled=ctx.world_size > 1):
            return step()

    return step, {"compute_step": compute_only}
