"""Rank functions for the GPU tests: each puts its tensors on ``dpt.dist.rank_device()``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpt.dist import rank_device
from tests.lessons import load


def all_reduce_on_rank_device(rank: int, world_size: int) -> dict:
    device = rank_device()
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    return {"device": str(device), "backend": dist.get_backend(), "sum": t.cpu().tolist()}


def fsdp2_worker(rank: int, world_size: int, mode: str) -> dict:
    ft = load("08_sharding", "fsdp2_train")
    out = ft.train_worker(rank, world_size, mode=mode, steps=3, batch_size=8)
    return {"losses": out["losses"], "device": str(rank_device()),
            "backend": dist.get_backend()}


def zero_demo(rank: int, world_size: int) -> dict:
    zo = load("08_sharding", "zero_optimizer")
    return zo.demo_worker(rank, world_size, steps=3)


def amp_ddp(rank: int, world_size: int, precision: str) -> dict:
    amp_inspect = load("06_mixed_precision", "amp_inspect")
    return amp_inspect.ddp_dtypes(rank, world_size, precision=precision, steps=3, batch_size=8)


def compiled_vs_eager(rank: int, world_size: int, backend: str) -> dict:
    cdp = load("10_inside_a_step", "compile_ddp")
    out = cdp.compare_losses(backend)
    return {"eager": out["eager"], "compiled": out["compiled"], "graphs": out["graphs"],
            "device": str(rank_device())}
