# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 01: training on one device.

Everything later lessons distribute starts here: a ``Trainer`` whose ``_run_batch`` takes one
optimization step, whose ``_run_epoch`` goes over the data once and whose ``train`` runs the
epochs and saves checkpoints; an evaluation that counts correct answers over the whole test
set; a checkpoint that reloads into a fresh model; and ``train_and_evaluate``, which puts them
to work (data, model, optimizer, training, test accuracy) on the device ``main`` picks. The
shape is that of ``single_gpu.py`` in PyTorch's DDP tutorial series. Lessons 03 and 04 grow
this same file: their ``CHANGES.diff`` shows what each one adds. Nothing here names a device:
``dpt.device.pick_device`` chooses one and every tensor follows ``device``.

Run it, from the repository root, on your own tree::

    python exercises/01_single_device/single_device.py --epochs 1
    python exercises/01_single_device/single_device.py --model mlp --dataset mnist
    python exercises/01_single_device/single_device.py --limit-batches 50 --checkpoint ck.pt
    python exercises/01_single_device/single_device.py --epochs 2 --resume ck.pt
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dpt import checkpoint as ckpt
from dpt import cli
from dpt.data import TensorLoader, load_tensors, prepare_distributed
from dpt.device import pick_device
from dpt.dist import rank0_print, set_threads
from dpt.models import build_model


def prepare_dataloader(x: torch.Tensor, y: torch.Tensor, batch_size: int,
                       shuffle: bool = True, seed: int = 0) -> TensorLoader:
    """Batches of ``(x, y)``, in a new random order every epoch when ``shuffle``."""
    generator = torch.Generator().manual_seed(seed)
    return TensorLoader(x, y, batch_size=batch_size, shuffle=shuffle, generator=generator)


class Trainer:
    """Trains ``model`` on ``train_data``; a checkpoint every ``save_every`` epochs."""

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

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimization step on one batch (already on the device); returns its loss."""
        raise NotImplementedError("Task 01.1: one optimization step on this batch")

    def _run_epoch(self, epoch: int, limit_batches: int | None = None) -> float:
        """One pass over the data (at most ``limit_batches`` batches); returns the mean loss."""
        self.model.train()
        losses = []
        for source, targets in cli.batches(self.train_data, limit_batches, f"epoch {epoch}",
                                           self.progress):
            source, targets = source.to(self.device), targets.to(self.device)
            losses.append(self._run_batch(source, targets))
        self.history.extend(losses)
        return sum(losses) / max(1, len(losses))

    def _save_checkpoint(self, epoch: int) -> None:
        save_checkpoint(self.checkpoint_path, self.model, self.optimizer, epoch)

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
    """``(correct, total)`` over every sample of ``loader``, as ints.

    Counts, not a ratio: counts add up (over batches of any size, and later over ranks).
    The model predicts in eval mode and is left in the mode it was in.
    """
    raise NotImplementedError("Task 01.2: count the correct predictions over every sample")


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    epoch: int, **extra) -> Path:
    """Save ``{"model", "optimizer", "epoch", **extra}`` to ``path``; return the path.

    A crash in the middle of a save must never leave a broken file at ``path``, and the
    model's keys carry no wrapper prefix (``module.``), so they load into a plain model.
    """
    raise NotImplementedError("Task 01.3: an atomic checkpoint of the unwrapped model, optimizer and epoch")


def load_checkpoint(path: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    device: torch.device | str = "cpu") -> dict:
    """Load what :func:`save_checkpoint` wrote into ``model`` (and ``optimizer``), tensors
    onto ``device``; return the whole dict (``["epoch"]`` is where training resumes).

    A missing or corrupted file raises ``dpt.checkpoint.CheckpointError``.
    """
    raise NotImplementedError("Task 01.3: read the checkpoint back into the model (and optimizer)")


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


def main(args) -> dict:
    """The whole script, on the one device this machine offers: pick it, then train and
    evaluate there (lesson 03's ``main`` joins a process group instead, and leaves it)."""
    device = pick_device(args.device)
    if args.threads:
        set_threads(args.threads)
    return train_and_evaluate(args, device)


def build_parser():
    p = cli.parser("Lesson 01: train and evaluate on one device.")
    p.add_argument("--checkpoint", default=None, help="save model/optimizer/epoch here")
    p.add_argument("--resume", default=None, help="start from this checkpoint")
    return p


if __name__ == "__main__":
    sys.exit(cli.main(main, build_parser()))
