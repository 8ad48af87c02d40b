"""DDP from a blank file, as a student who finished lesson 03 would write it (torch only).

    python blank_file_ddp.py --port 29533 --world-size 2 --out runs/blank

Each rank saves its final weights and its mean loss per epoch to ``--out/rank<r>.pt``.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(0)  # the same data on every rank
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()  # two classes a small net can separate
    return TensorDataset(x, y)


def main(rank: int, world_size: int, args) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        sampler = DistributedSampler(make_data(), shuffle=True, seed=0)
        loader = DataLoader(sampler.dataset, batch_size=32, sampler=sampler)
        torch.manual_seed(rank)  # different initial weights: DDP must broadcast rank 0's
        model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            total = 0.0
            for x, y in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()  # DDP averages the gradients of all ranks here
                optimizer.step()
                total += loss.item()
            losses.append(total / len(loader))
        torch.save({"model": model.module.state_dict(), "losses": losses},
                   os.path.join(args.out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    mp.spawn(main, args=(args.world_size, args), nprocs=args.world_size)
