# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
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
    # two "nodes" on one machine: two terminals, the same port, -nr 0 and -nr 1. Each
    # "node" sees its own GPU (on a CPU-only machine CUDA_VISIBLE_DEVICES changes nothing):
    CUDA_VISIBLE_DEVICES=0 python exercises/03_ddp_spawn/ddp_spawn.py -n 2 -g 1 -nr 0 \\
        --master-port 29533 --threads 1
    CUDA_VISIBLE_DEVICES=1 python exercises/03_ddp_spawn/ddp_spawn.py -n 2 -g 1 -nr 1 \\
        --master-port 29533 --threads 1
"""

from __future__ import annotations

import importlib.util
import sys

if importlib.util.find_spec("torch") is None:  # not the course's venv: say so in one line
    sys.exit(f"error: {sys.executable} has no torch; use the course's venv: .venv/bin/python "
             f"{sys.argv[0]} (or `source .venv/bin/activate` first; `make setup` creates it)")

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from dpt import checkpoint as ckpt
from dpt import cli
from dpt.data import TensorLoader
from dpt.dist import rank0_print, setup


def ddp_setup(local_rank: int, args) -> tuple[int, int, torch.device]:
    """Join the job as process ``local_rank`` of machine ``args.nr``.

    ``args.nodes`` machines each start ``args.gpus`` processes; the ranks are numbered machine
    after machine. Returns ``(rank, world_size, device)``; ``dpt.dist.setup`` does the joining
    (backend, device, CPU threads) once it knows who this process is.
    """
    raise NotImplementedError("Task 03.1: who is this process in the whole job? Then join the group")


def prepare_dataloader(x: torch.Tensor, y: torch.Tensor, batch_size: int,
                       shuffle: bool = True, seed: int = 0) -> TensorLoader:
    """This rank's share of ``(x, y)``: the ranks' shares never overlap and together cover
    every sample (when the length does not divide, a few samples repeat to even the shares;
    none is dropped). With ``shuffle``, the order is random, the same ``seed`` on every rank."""
    raise NotImplementedError("Task 03.2: a loader over this rank's share of the samples")


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

    # from lesson 01_single_device, unchanged
    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimization step on one batch (already on the device); returns its loss."""
        raise NotImplementedError("Task 01.1: copy your answer from lesson 01")

    def _run_epoch(self, epoch: int, limit_batches: int | None = None) -> float:
        """One pass over the data (at most ``limit_batches`` batches); returns the mean loss."""
        raise NotImplementedError("Task 03.3: a different order every epoch, the same on every rank")
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
        raise NotImplementedError("Task 03.4: one writer, the unwrapped model, and everybody waits for it")

    # from lesson 01_single_device, unchanged
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
    raise NotImplementedError("Task 03.5: count this rank's real samples, then add up over the ranks")


# from lesson 01_single_device, unchanged
def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    epoch: int, **extra) -> Path:
    """Save ``{"model", "optimizer", "epoch", **extra}`` to ``path``; return the path.

    A crash in the middle of a save must never leave a broken file at ``path``, and the
    model's keys carry no wrapper prefix (``module.``), so they load into a plain model.
    """
    raise NotImplementedError("Task 01.3: copy your answer from lesson 01")


# from lesson 01_single_device, unchanged
def load_checkpoint(path: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    device: torch.device | str = "cpu") -> dict:
    """Load what :func:`save_checkpoint` wrote into ``model`` (and ``optimizer``), tensors
    onto ``device``; return the whole dict (``["epoch"]`` is where training resumes).

    A missing or corrupted file raises ``dpt.checkpoint.CheckpointError``.
    """
    raise NotImplementedError("Task 01.3: copy your answer from lesson 01")


def run(local_rank: int, args) -> dict:
    """What each process of the job does (``mp.spawn`` calls it), from joining to leaving."""
    rank, world_size, device = ddp_setup(local_rank, args)
    try:
        return cli.train_and_evaluate(args, device, prepare_dataloader, Trainer, evaluate,
                                      checkpoint_path=args.checkpoint, resume_from=args.resume)
    finally:
        dist.destroy_process_group()


def build_parser():
    p = cli.add_spawn_flags(cli.parser("Lesson 03: DDP started with mp.spawn.", per_rank=True))
    p.add_argument("--checkpoint", default=None, help="rank 0 saves here after each epoch")
    p.add_argument("--resume", default=None, help="every rank starts from this checkpoint")
    return p


if __name__ == "__main__":
    sys.exit(cli.main(lambda args: cli.spawn(run, args), build_parser()))
