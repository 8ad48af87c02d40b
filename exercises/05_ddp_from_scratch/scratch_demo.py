"""Rank functions the lesson 05 notebook launches (notebook code cannot be pickled for new
processes, so the code each rank runs lives here, in an importable file).

:func:`compare_rank` trains the course's small MLP (from PyTorch's MNIST example) for a few
SGD steps with every wrapper of this lesson and with torch DDP, each rank on its half of one
Fashion-MNIST batch, and returns the weights, so the notebook can compare them with one
process trained on the whole batch. Models and batches go to ``dpt.dist.rank_device()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bucketed_ddp import BucketedDDP
from naive_ddp import NaiveDDP
from overlap_ddp import OverlapDDP
from torch.nn.parallel import DistributedDataParallel

WRAPPERS = {
    "naive": NaiveDDP,
    "overlap": OverlapDDP,
    "bucketed": lambda m: BucketedDDP(m, bucket_cap_mb=0.1),
    "bucketed, grads as views": lambda m: BucketedDDP(m, bucket_cap_mb=0.1,
                                                     gradient_as_bucket_view=True),
    "torch DDP": DistributedDataParallel,
}


def make_model(seed: int, device: torch.device | str = "cpu"):
    from dpt.models import MLP

    torch.manual_seed(seed)
    return MLP().to(device)


def train(model, x, y, steps: int, sync=lambda: None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        sync()
        opt.step()
    return model


def compare_rank(rank: int, world_size: int, x, y, steps: int = 5) -> dict:
    """Train each wrapper from rank-dependent weights on this rank's slice; return states."""
    from dpt.dist import rank_device

    device = rank_device()
    per_rank = x.shape[0] // world_size
    xr = x[rank * per_rank:(rank + 1) * per_rank].to(device)
    yr = y[rank * per_rank:(rank + 1) * per_rank].to(device)
    states = {}
    for name, wrapper in WRAPPERS.items():
        model = wrapper(make_model(seed=rank, device=device))  # different start: broadcast fixes it
        sync = getattr(model, "finish_gradient_synchronization", lambda: None)
        train(model, xr, yr, steps, sync)
        states[name] = {k: v.detach().cpu().clone() for k, v in model.module.state_dict().items()}
    return states
