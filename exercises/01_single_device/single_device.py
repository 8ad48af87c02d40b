# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 01: training on one device.

Everything later lessons distribute starts here: a training step, an evaluation that counts
correct answers over the whole test set, and a checkpoint that reloads into a fresh model.
The same code runs on CUDA, Apple's MPS and the CPU, because nothing in it names a device:
``dpt.device.pick_device`` chooses one and every tensor follows ``device``.

Run it::

    python exercises/01_single_device/single_device.py --epochs 1
    python exercises/01_single_device/single_device.py --model mlp --dataset mnist
    python exercises/01_single_device/single_device.py --toy   # seed 004's Trainer on toy data
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from dpt import checkpoint as ckpt
from dpt.data import (
    DATASETS,
    DEFAULT_DATASET,
    DataError,
    TensorLoader,
    ToyRegression,
    check_batch_size,
    make_loader,
    prepare,
)
from dpt.device import DEVICE_CHOICES, DeviceError, pick_device
from dpt.dist import set_threads
from dpt.models import MODELS, LinearRegression, build_model


def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
               optimizer: torch.optim.Optimizer, device: torch.device,
               loss_fn=F.cross_entropy) -> float:
    """One optimization step on one batch; returns the batch's loss as a float."""
    raise NotImplementedError("Task 01.1: move inputs and targets to `device`, then zero the gradients, run forward, compute loss_fn, backward and optimizer.step(); return loss.item()")


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device) -> tuple[int, int]:
    """Count correct predictions over every sample of ``loader``: ``(correct, total)``.

    Returns counts, not a ratio, so that later lessons can add counts from several ranks.
    The model is put in eval mode (batch norm uses its running statistics) and restored.
    """
    raise NotImplementedError("Task 01.2: in eval mode, add up (argmax == target) over every batch, including a short last one; restore the model's previous mode; return (correct, total) as ints")


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    epoch: int) -> Path:
    """Save model, optimizer and epoch atomically, with no wrapper prefix in the keys."""
    raise NotImplementedError("Task 01.3: build {\"model\": ..., \"optimizer\": ..., \"epoch\": epoch} from state_dict()s (unwrap `.module` if the model has one) and write it with dpt.checkpoint.atomic_save")


def load_checkpoint(path: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    map_location="cpu") -> int:
    """Load what :func:`save_checkpoint` wrote; return the epoch it was saved at."""
    raise NotImplementedError("Task 01.3: read the file with dpt.checkpoint.load, load_state_dict into the model (and the optimizer when given) and return the saved epoch")


class Trainer:
    """Seed 004's single-device ``Trainer``, device-agnostic and with a full checkpoint."""

    def __init__(self, model: nn.Module, train_data, optimizer: torch.optim.Optimizer,
                 device: torch.device, save_every: int = 0, checkpoint_path: str | Path = "",
                 loss_fn=F.cross_entropy, progress: bool = False):
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.device = device
        self.save_every = save_every
        self.checkpoint_path = checkpoint_path
        self.loss_fn = loss_fn
        self.progress = progress
        self.epochs_run = 0
        self.history: list[float] = []  # the loss of every step, for the loss curve

    def _run_epoch(self, epoch: int, limit_batches: int | None = None) -> float:
        self.model.train()
        batches = self.train_data
        total = len(batches) if limit_batches is None else min(limit_batches, len(batches))
        bar = tqdm(batches, total=total, desc=f"epoch {epoch}", disable=not self.progress,
                   leave=False)
        losses = []
        for i, batch in enumerate(bar):
            if limit_batches is not None and i >= limit_batches:
                break
            losses.append(train_step(self.model, batch, self.optimizer, self.device,
                                     self.loss_fn))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.close()
        self.history.extend(losses)
        return sum(losses) / max(1, len(losses))

    def train(self, max_epochs: int, limit_batches: int | None = None) -> list[float]:
        epoch_losses = []
        for epoch in range(self.epochs_run, max_epochs):
            epoch_losses.append(self._run_epoch(epoch, limit_batches))
            self.epochs_run = epoch + 1
            if self.save_every and self.checkpoint_path and self.epochs_run % self.save_every == 0:
                save_checkpoint(self.checkpoint_path, self.model, self.optimizer, self.epochs_run)
        return epoch_losses


# ---------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Lesson 01: train and evaluate on one device.")
    p.add_argument("--dataset", default=DEFAULT_DATASET, choices=sorted(DATASETS))
    p.add_argument("--model", default="convnet", choices=sorted(MODELS))
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    p.add_argument("--limit-batches", type=int, default=None,
                   help="train on at most this many batches per epoch (quick runs)")
    p.add_argument("--classic", action="store_true",
                   help="use torchvision + DataLoader instead of the in-memory fast path")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--checkpoint", default=None, help="save model/optimizer/epoch here")
    p.add_argument("--resume", default=None, help="start from this checkpoint")
    p.add_argument("--toy", action="store_true", help="seed 004's toy regression instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def validate(args: argparse.Namespace) -> None:
    """Turn bad input into one clear line before any work starts."""
    check_batch_size(args.batch_size)
    if args.epochs < 1:
        raise ValueError(f"--epochs must be at least 1, got {args.epochs}")
    if args.limit_batches is not None and args.limit_batches < 1:
        raise ValueError(f"--limit-batches must be at least 1, got {args.limit_batches}")
    if args.checkpoint and not Path(args.checkpoint).parent.is_dir():
        raise ckpt.CheckpointError(f"cannot save checkpoint to {args.checkpoint}: folder "
                                   f"{Path(args.checkpoint).parent} does not exist")


def run(args: argparse.Namespace) -> dict:
    validate(args)
    device = pick_device(args.device)
    if args.threads:
        set_threads(args.threads)
    torch.manual_seed(args.seed)
    progress = not args.no_progress
    if args.toy:
        data = ToyRegression()
        loader = TensorLoader(data.x, data.y, batch_size=args.batch_size, shuffle=True)
        model = LinearRegression()
        optimizer = torch.optim.SGD(model.parameters(), lr=min(args.lr, 0.05))
        trainer = Trainer(model, loader, optimizer, device, loss_fn=F.mse_loss,
                          progress=progress)
        losses = trainer.train(args.epochs, args.limit_batches)
        print(f"toy regression: final epoch loss {losses[-1]:.4f} on {device}")
        return {"loss": losses[-1], "history": trainer.history}

    prepare(args.dataset)
    train_loader = make_loader(args.dataset, train=True, batch_size=args.batch_size,
                               fast=not args.classic, seed=args.seed)
    test_loader = make_loader(args.dataset, train=False, batch_size=1000,
                              fast=not args.classic)
    model = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    trainer = Trainer(model, train_loader, optimizer, device, save_every=1,
                      checkpoint_path=args.checkpoint or "", progress=progress)
    if args.resume:
        trainer.epochs_run = load_checkpoint(args.resume, trainer.model, optimizer)
        print(f"resumed from {args.resume} at epoch {trainer.epochs_run}")
    print(f"training {args.model} on {args.dataset} on {device} "
          f"({torch.get_num_threads()} threads, batch {args.batch_size})")
    start = time.perf_counter()
    losses = trainer.train(args.epochs, args.limit_batches)
    seconds = time.perf_counter() - start
    correct, total = evaluate(trainer.model, test_loader, device)
    accuracy = correct / total
    if losses:
        print(f"train loss {losses[-1]:.4f} | {seconds:.1f}s")
    print(f"test accuracy: {accuracy:.4f} ({correct}/{total})")
    return {"accuracy": accuracy, "seconds": seconds, "history": trainer.history}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (ValueError, DataError, DeviceError, ckpt.CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
