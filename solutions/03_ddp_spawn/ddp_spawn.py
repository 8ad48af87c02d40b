"""Lesson 03: lesson 01's training on every device at once, with DDP and ``mp.spawn``.

Every device gets its own process, each holding a full copy of the model and training on its
own share of the data. During ``backward()`` DDP averages the gradients of all processes, so
every copy takes the same step and the copies stay identical. This file is lesson 01's
``single_device.py`` plus what that takes (``CHANGES.diff`` lists it), as ``multigpu.py``
grows from ``single_gpu.py`` in PyTorch's DDP tutorial series. The script starts its
processes itself with ``mp.spawn``, one per device, and each works out its place in the job:

- ``-n/--nodes``: how many machines take part;
- ``-g/--gpus``: how many processes to start on this machine (one per device);
- ``-nr/--nr``: this machine's number, 0 .. nodes-1 (every machine runs the same command).

Run it, from the repository root, on your own tree::

    python exercises/03_ddp_spawn/ddp_spawn.py -g 2 --epochs 1
    # two "nodes" on one machine: two terminals, the same port, -nr 0 and -nr 1; node 1 is
    # told where node 0 is. Each "node" sees its own GPU (on a CPU-only machine
    # CUDA_VISIBLE_DEVICES changes nothing):
    CUDA_VISIBLE_DEVICES=0 python exercises/03_ddp_spawn/ddp_spawn.py -n 2 -g 1 -nr 0 \\
        --master-port 29533 --threads 1
    CUDA_VISIBLE_DEVICES=1 python exercises/03_ddp_spawn/ddp_spawn.py -n 2 -g 1 -nr 1 \\
        --master-addr 127.0.0.1 --master-port 29533 --threads 1
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from dpt import checkpoint as ckpt
from dpt import cli
from dpt.data import TensorLoader, load_tensors, prepare_distributed
from dpt.device import gpu_for, pick_device, shares_gpu
from dpt.dist import preflight, rank0_print
from dpt.models import build_model


def ddp_setup(local_rank: int, args) -> tuple[int, int, torch.device]:
    """Join the job as process ``local_rank`` of machine ``args.nr``.

    ``args.nodes`` machines each start ``args.gpus`` processes; the ranks are numbered machine
    after machine. Returns ``(rank, world_size, device)``.
    """
    # BEGIN SOLUTION 03.1: who is this process in the whole job?
    rank = args.nr * args.gpus + local_rank
    world_size = args.nodes * args.gpus
    # END SOLUTION
    device = join_group(rank, world_size, local_rank, args.gpus, args)
    return rank, world_size, device


def join_group(rank: int, world_size: int, local_rank: int, local_world_size: int,
               args) -> torch.device:
    """Join the process group as ``rank`` of ``world_size``; return this process's device.

    The launcher has set MASTER_ADDR and MASTER_PORT: where rank 0 waits for the others. On
    GPUs (``--device auto`` on a machine with GPUs, or ``cuda``) process ``local_rank`` of its
    machine uses GPU ``local_rank`` (``gpu_for``), with NCCL; otherwise the CPU, with gloo
    (gloo also when ``DPT_SHARE_GPU=1`` lets ranks share a GPU, which NCCL refuses).
    ``preflight`` splits the CPU cores among the ``local_world_size`` processes of this
    machine and checks that every rank chose the same backend, before anyone waits.
    """
    # BEGIN SOLUTION 03.2: the device, the backend that goes with it, then join the group
    on_gpus = pick_device(args.device, distributed=True).type == "cuda"
    device = gpu_for(local_rank) if on_gpus else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" and not shares_gpu() else "gloo"
    preflight(args, rank, world_size, local_rank, local_world_size, device, backend)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    # END SOLUTION
    return device


def prepare_dataloader(x: torch.Tensor, y: torch.Tensor, batch_size: int,
                       shuffle: bool = True, seed: int = 0) -> TensorLoader:
    """This rank's share of ``(x, y)``: the ranks' shares never overlap and together cover
    every sample (when the length does not divide, a few samples repeat to even the shares;
    none is dropped). With ``shuffle``, the order is random, the same ``seed`` on every rank."""
    # BEGIN SOLUTION 03.3: a loader over this rank's share of the samples
    sampler = DistributedSampler(range(len(x)), shuffle=shuffle, seed=seed)
    return TensorLoader(x, y, batch_size=batch_size, sampler=sampler)
    # END SOLUTION


class Trainer:
    """Trains ``model`` on this rank's ``train_data``; rank 0 checkpoints every ``save_every``."""

    def __init__(self, model: nn.Module, train_data, optimizer: torch.optim.Optimizer,
                 device: torch.device, save_every: int = 1,
                 checkpoint_path: str | Path | None = None, progress: bool = False,
                 resume_from: str | Path | None = None):
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.checkpoint_path = checkpoint_path
        self.progress = progress
        self.epochs_run = 0  # epochs finished: train() continues from here
        self.history: list[float] = []  # the loss of every step, for the loss curve
        if resume_from:  # the model is on its device: the momentum goes there too
            self.epochs_run = load_checkpoint(resume_from, self.model, optimizer, device)["epoch"]
            rank0_print(f"resumed from {resume_from} at epoch {self.epochs_run}")
        # DDP broadcasts rank 0's weights, then averages the gradients in every backward()
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

    # CARRIED FROM 01_single_device (generated: edit it there, then `make exercises`)
    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimization step on one batch (already on the device); returns its loss."""
        # BEGIN SOLUTION 01.1: copy your answer from lesson 01
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()
        # END SOLUTION

    def _run_epoch(self, epoch: int, limit_batches: int | None = None) -> float:
        """One pass over the data (at most ``limit_batches`` batches); returns the mean loss."""
        # BEGIN SOLUTION 03.4: a different order every epoch, the same on every rank
        self.train_data.sampler.set_epoch(epoch)
        # END SOLUTION
        self.model.train()
        losses = []
        for source, targets in cli.batches(self.train_data, limit_batches, f"epoch {epoch}",
                                           self.progress):
            source, targets = source.to(self.device), targets.to(self.device)
            losses.append(self._run_batch(source, targets))
        self.history.extend(losses)
        return sum(losses) / max(1, len(losses))

    def _save_checkpoint(self, epoch: int) -> None:
        """Rank 0 alone writes the plain model (no ``module.``); nobody goes on before the
        file is complete."""
        # BEGIN SOLUTION 03.5: one writer, the unwrapped model, and everybody waits for it
        if dist.get_rank() == 0:
            save_checkpoint(self.checkpoint_path, self.model.module, self.optimizer, epoch)
        dist.barrier()
        # END SOLUTION

    # CARRIED FROM 01_single_device (generated: edit it there, then `make exercises`)
    def train(self, max_epochs: int, limit_batches: int | None = None) -> list[float]:
        """Run epochs ``epochs_run .. max_epochs-1``; returns each epoch's mean loss."""
        losses = []
        for epoch in range(self.epochs_run, max_epochs):
            losses.append(self._run_epoch(epoch, limit_batches))
            rank0_print(f"epoch {epoch}: mean train loss {losses[-1]:.4f}")
            self.epochs_run = epoch + 1
            if self.checkpoint_path and self.epochs_run % self.save_every == 0:
                self._save_checkpoint(self.epochs_run)
        return losses


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device) -> tuple[int, int]:
    """``(correct, total)`` over the WHOLE dataset, the same on every rank, as ints.

    ``loader`` holds this rank's share (a ``DistributedSampler`` without shuffling), which
    repeats a few samples when the dataset does not divide evenly: each sample counts once.
    The model predicts in eval mode and is left in the mode it was in.
    """
    # BEGIN SOLUTION 03.6: count this rank's real samples, then add up over the ranks
    was_training = model.training
    model.eval()
    sampler = loader.sampler  # positions rank, rank + N, ... of a list padded past the data
    real = len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas))
    correct = total = 0
    for inputs, targets in loader:
        keep = min(len(targets), real - total)  # the rest of this share is padding
        inputs, targets = inputs[:keep].to(device), targets[:keep].to(device)
        correct += int((model(inputs).argmax(dim=1) == targets).sum())
        total += len(targets)
    model.train(was_training)
    counts = torch.tensor([correct, total], device=device)
    dist.all_reduce(counts)
    return int(counts[0]), int(counts[1])
    # END SOLUTION


# CARRIED FROM 01_single_device (generated: edit it there, then `make exercises`)
def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    epoch: int, **extra) -> Path:
    """Save ``{"model", "optimizer", "epoch", **extra}`` to ``path``; return the path.

    A crash in the middle of a save must never leave a broken file at ``path``, and the
    model's keys carry no wrapper prefix (``module.``), so they load into a plain model.
    """
    # BEGIN SOLUTION 01.3: copy your answer from lesson 01
    state = {"model": getattr(model, "module", model).state_dict(),
             "optimizer": optimizer.state_dict(), "epoch": epoch, **extra}
    return ckpt.atomic_save(state, path)
    # END SOLUTION


# CARRIED FROM 01_single_device (generated: edit it there, then `make exercises`)
def load_checkpoint(path: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    device: torch.device | str = "cpu") -> dict:
    """Load what :func:`save_checkpoint` wrote into ``model`` (and ``optimizer``), tensors
    onto ``device``; return the whole dict (``["epoch"]`` is where training resumes).

    A missing or corrupted file raises ``dpt.checkpoint.CheckpointError``.
    """
    # BEGIN SOLUTION 01.3: copy your answer from lesson 01
    state = ckpt.load(path, map_location=device)
    getattr(model, "module", model).load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state
    # END SOLUTION


# CARRIED FROM 01_single_device (generated: edit it there, then `make exercises`)
def train_and_evaluate(args, device: torch.device) -> dict:
    """The script's work on ``device``: the data, the model and its optimizer, training, and
    the accuracy on the test set. Returns ``{"accuracy", "seconds", "history"}`` (the loss of
    every step)."""
    cli.deterministic(args.deterministic)
    # in a process group (lesson 03 on), one process per machine unpacks the data
    prepare_distributed(args.dataset)
    x, y = load_tensors(args.dataset, train=True, limit=args.train_limit)
    train_data = prepare_dataloader(x, y, args.batch_size, seed=args.seed)
    x_test, y_test = load_tensors(args.dataset, train=False, limit=args.test_limit)
    test_data = prepare_dataloader(x_test, y_test, 1000, shuffle=False)
    torch.manual_seed(args.seed)
    model = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    trainer = Trainer(model, train_data, optimizer, device, args.save_every,
                      args.checkpoint, args.progress, resume_from=args.resume)
    rank0_print(cli.describe(args, device))
    seconds = cli.timed(trainer.train, args.epochs, args.limit_batches)
    correct, total = evaluate(trainer.model, test_data, device)
    rank0_print(f"test accuracy: {correct / total:.4f} ({correct}/{total})")
    return {"accuracy": correct / total, "seconds": seconds, "history": trainer.history}


def main(local_rank: int, args) -> dict:
    """One process of the job (``mp.spawn`` starts it): join, train and evaluate, leave.

    Returns what :func:`train_and_evaluate` returns: ``{"accuracy", "seconds", "history"}``.
    """
    rank, world_size, device = ddp_setup(local_rank, args)
    try:
        return train_and_evaluate(args, device)
    finally:
        # BEGIN SOLUTION 03.2: leave the group, whatever happened
        dist.destroy_process_group()
        # END SOLUTION


def launch(args) -> None:
    """Start this machine's ``args.gpus`` processes, each running :func:`main`, and wait."""
    # BEGIN SOLUTION 03.7: tell the processes where rank 0 waits, then start them
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    mp.spawn(main, args=(args,), nprocs=args.gpus)
    # END SOLUTION


def build_parser():
    p = cli.add_spawn_flags(cli.parser("Lesson 03: DDP started with mp.spawn.", per_rank=True))
    p.add_argument("--checkpoint", default=None, help="rank 0 saves here after each epoch")
    p.add_argument("--resume", default=None, help="every rank starts from this checkpoint")
    return p


if __name__ == "__main__":
    # with_free_port: check -n/-g/-nr, choose the port, one error line if a process fails
    sys.exit(cli.main(cli.with_free_port(launch), build_parser()))
