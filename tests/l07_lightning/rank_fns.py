"""Rank functions for lesson 07's tests (run by dpt.ranks.run_distributed).

Only the raw loop runs this way: it uses no Lightning, so no strategy re-runs a script.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from dpt.models import MLP
from tests.lessons import load

LESSON = "07_lightning"


class RecordingDataset(Dataset):
    """MNIST-shaped samples that write down which index was asked for, in order."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 1, 28, 28, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.asked: list[int] = []

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        self.asked.append(int(i))
        return self.x[i], self.y[i]


def raw_epochs(rank: int, world_size: int, n: int = 48, batch_size: int = 4) -> dict:
    """Two epochs of ``raw_ddp_epoch``, then one cut short: what this rank saw and ended with."""
    fd = load(LESSON, "fabric_ddp")
    torch.manual_seed(0)
    model = DDP(MLP(16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dataset = RecordingDataset(n)
    orders, losses = [], []
    for epoch in (0, 1):
        dataset.asked = []
        losses.append(fd.raw_ddp_epoch(model, optimizer, dataset, batch_size,
                                       torch.device("cpu"), epoch=epoch))
        orders.append(dataset.asked)
    dataset.asked = []
    short = fd.raw_ddp_epoch(model, optimizer, dataset, batch_size, torch.device("cpu"),
                             epoch=2, max_batches=2)
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    return {"rank": rank, "orders": orders, "losses": losses, "short": short,
            "short_order": dataset.asked[:2 * batch_size], "checksum": checksum,
            "state": {k: v.detach().clone() for k, v in model.module.state_dict().items()}}
