"""Lesson 02's methods: DataParallel, one process driving several devices.

Both run as ONE rank (``max_procs=1``): DataParallel is a single process that splits each
batch over devices itself, so the harness's N (processes) is not its N (devices). The rank's
batch is the global batch; compare its samples/s with ``single`` at N = 1.

- ``dp``: ``nn.DataParallel`` over every visible GPU (needs at least 2).
- ``dp_by_hand``: lesson 02's ``DataParallelByHand``: on GPUs over every GPU with torch's
  primitives; on the CPU with one replica per core, 1 intra-op thread each (the CPU
  parallelizes the forward only; backward runs on one thread).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.registry import BenchContext, method
from dpt.lessons import load


def _step_fn(model, params, batch):
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    x, y = batch

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return step


@method("dp", "nn.DataParallel, one process over every GPU (compare with `single`)",
        requires=("cuda>=2",), max_procs=1)
def dp(ctx: BenchContext):
    ids = list(range(torch.cuda.device_count()))
    model = ctx.model().to(torch.device("cuda", ids[0]))
    wrapped = nn.DataParallel(model, device_ids=ids)
    return _step_fn(wrapped, model.parameters(), ctx.batch())


@method("dp_by_hand", "lesson 02's DataParallel by hand: one process, a replica per GPU "
        "(torch primitives) or per CPU core (threads, 1 intra-op thread each)", max_procs=1)
def dp_by_hand(ctx: BenchContext):
    DataParallelByHand = load("02_data_parallel", "dp_by_hand", "solutions").DataParallelByHand

    from dpt.dist import cpu_budget

    model = ctx.model().to(ctx.device)
    if ctx.device.type == "cuda" and torch.cuda.device_count() >= 2:
        wrapped = DataParallelByHand(model, device_ids=list(range(torch.cuda.device_count())))
    else:
        n = int(ctx.options.get("replicas", cpu_budget()))
        wrapped = DataParallelByHand(model, n_replicas=n, threads_per_replica=1)
    return _step_fn(wrapped, model.parameters(), ctx.batch())
