# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 07: Lightning Fabric, the smallest change that makes a raw loop distributed.

``raw_ddp_epoch`` is lesson 03's shape: the process group is up, we build a
DistributedSampler, wrap the model in DDP, move every batch by hand. ``fabric_epoch`` is
the same loop after the Fabric conversion; the lines that changed are marked ``# Fabric``.
Fabric launches the processes, picks the device, adds the sampler and wraps the model.

    .venv/bin/python exercises/07_lightning/fabric_ddp.py --devices 2            # ddp on 2 GPUs, or 2 CPU processes
    .venv/bin/python exercises/07_lightning/fabric_ddp.py --devices 2 --limit 2048 --epochs 2
    .venv/bin/python exercises/07_lightning/fabric_ddp.py --devices 2 --accelerator cpu  # the CPU, GPUs or not

``--accelerator auto`` (the default) takes the GPUs when there is one for each of
``--devices``, else the CPU (Apple's MPS serves one process only): NCCL refuses two
processes on one GPU.
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from lit_train import UsageError, check_choices, resolve_accelerator
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dpt.data import DataError, check_batch_size, load_tensors, prepare
from dpt.device import mps_available
from dpt.models import MLP


def fashion_train_set(limit: int | None = None, name: str = "fashion-mnist") -> TensorDataset:
    x, y = load_tensors(name, train=True, limit=limit)
    return TensorDataset(x, y)


def raw_ddp_epoch(model, optimizer, dataset, batch_size: int, device, epoch: int = 0,
                  max_batches: int | None = None) -> list[float]:
    """Lesson 03's loop: call with the process group already initialized, model in DDP."""
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    sampler.set_epoch(epoch)
    losses = []
    for i, (x, y) in enumerate(loader):
        if max_batches is not None and i == max_batches:
            break
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        losses.append(loss.item())
    return losses


def fabric_loader(fabric, dataset, batch_size: int):
    """A plain shuffled DataLoader, handed to Fabric (create it once, iterate every epoch)."""
    raise NotImplementedError("Task 07.5: a plain shuffled DataLoader, handed to Fabric")


def fabric_epoch(fabric, model, optimizer, loader, max_batches: int | None = None) -> list[float]:
    """The raw loop for a model and optimizer returned by ``fabric.setup``."""
    losses = []
    for i, (x, y) in enumerate(loader):  # Fabric: no x.to(device)
        if max_batches is not None and i == max_batches:
            break
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        raise NotImplementedError("Task 07.5: backward through Fabric (it knows DDP, precision and scaling)")
        optimizer.step()
        losses.append(loss.item())
    return losses


def fabric_accelerator(requested: str, devices: int, cuda_count: int, mps: bool) -> str:
    """The accelerator to hand Fabric for ``--accelerator requested --devices devices``.

    ``lit_train.py``'s checks (a GPU accelerator needs CUDA; MPS serves one process), then:
    an explicit GPU accelerator needs a GPU per process, and ``auto`` becomes ``cuda`` when
    there is one, else the CPU (or MPS, for one process on a Mac).
    """
    accelerator = resolve_accelerator(requested, devices, cuda_count > 0, mps)
    check_choices(accelerator, "ddp", "32-true", devices, cuda_count > 0,
                  deepspeed_installed=False)
    if accelerator in ("gpu", "cuda") and devices > cuda_count:
        raise UsageError(f"--accelerator {accelerator} --devices {devices}: one GPU per "
                         f"process, and this machine has {cuda_count}; use --devices "
                         f"{cuda_count} or --accelerator cpu")
    if accelerator != "auto":
        return accelerator
    if cuda_count >= devices:
        return "cuda"
    if cuda_count and os.environ.get("LOCAL_RANK", "0") == "0":  # once, not in every rank
        print(f"note: {devices} devices but {cuda_count} GPU(s): the {devices} processes run "
              "on the CPU with gloo (NCCL refuses two processes on one GPU)", file=sys.stderr)
    return "mps" if mps and devices == 1 and not cuda_count else "cpu"


def run(fabric, args) -> dict:
    """Everything after the launch; runs on every rank."""
    fabric.seed_everything(args.seed)
    model = MLP(args.hidden_dim)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)  # Fabric: wraps in DDP, moves to device
    loader = fabric_loader(fabric, fashion_train_set(args.limit), args.batch_size)
    losses = []
    for _ in range(args.epochs):
        losses += fabric_epoch(fabric, model, optimizer, loader)
    # Every rank's mean loss, averaged: the number is the same on all ranks.
    mean_last = fabric.all_reduce(torch.tensor(sum(losses[-10:]) / len(losses[-10:])),
                                  reduce_op="mean")
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    return {"rank": fabric.global_rank, "world_size": fabric.world_size, "steps": len(losses),
            "first_loss": losses[0], "mean_last_loss": float(mean_last),
            "param_checksum": checksum}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Lesson 07: a raw loop trained with Fabric")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "gpu", "cuda", "mps"],
                    help="auto: the GPUs if there is one per device, else the CPU")
    ap.add_argument("--strategy", default="ddp", choices=["ddp", "ddp_spawn", "auto"])
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden-dim", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None, help="first N training samples")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        check_batch_size(args.batch_size)
        accelerator = fabric_accelerator(args.accelerator, args.devices,
                                         torch.cuda.device_count(), mps_available())
        prepare("fashion-mnist", quiet=True)
        from lightning_fabric import Fabric

        from dpt.dist import set_threads, threads_per_rank

        set_threads(threads_per_rank(args.devices))
        fabric = Fabric(accelerator=accelerator, devices=args.devices, strategy=args.strategy)
        fabric.launch()  # ddp: re-runs this script for ranks 1..N-1, then sets up the group
        result = run(fabric, args)
    except (DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # One line per rank, in rank order: the ranks share one stdout, so printing at the same
    # moment would interleave their lines.
    for rank in range(fabric.world_size):
        if fabric.global_rank == rank:
            print("RESULT " + json.dumps(result), flush=True)
        fabric.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
