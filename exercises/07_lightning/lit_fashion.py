# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 07: the ``TutorialModule`` and ``MNISTDataModule`` of the PyTorch Lightning MNIST
notebook, written for Lightning 2.x.

What changed from the notebook, and why:

- ``Accuracy(task="multiclass", num_classes=10)``: torchmetrics 0.11+ needs the task.
- No ``*_step_end`` / ``*_epoch_end`` hooks: Lightning 2.0 removed them (see ``lit_migration``).
- Validation metrics are reduced over *every* rank: the accuracy is a torchmetrics object
  (its ``compute()`` all-gathers its counts), the loss is a plain tensor logged with
  ``sync_dist=True``. Without that, each rank logs the number for its own half of the data.
- The portable habits of Lightning's old multi-GPU guide: no ``.cuda()`` / ``.to()`` inside
  the module, new tensors made on ``self.device`` with the input's dtype, no hand-made
  ``DistributedSampler`` (the Trainer adds one), and ``prepare_data`` (one process per
  machine touches the disk or network) versus ``setup`` (every process builds its datasets,
  identically).
"""

from __future__ import annotations

import os

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split
from torchmetrics import Accuracy

from dpt import data as dpt_data
from dpt.models import MLP


def _rank() -> int:
    """This process's global rank, read from the launcher's variables (0 when alone)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


class FashionDataModule(pl.LightningDataModule):
    """Fashion-MNIST (or MNIST when present) held in memory, split 55k/5k like the notebook.

    ``train_limit`` / ``val_limit`` keep the first samples of each split, for short runs.
    ``shuffle=False`` makes the order deterministic, so a 2-rank run and a 1-rank run with a
    twice-as-large batch see exactly the same samples at each step.
    """

    def __init__(self, dataset: str = dpt_data.DEFAULT_DATASET, data_dir: str | None = None,
                 batch_size: int = 16, val_size: int = 5000, train_limit: int | None = None,
                 val_limit: int | None = None, shuffle: bool = True, seed: int = 0,
                 verbose: bool = True):
        super().__init__()
        dpt_data.dataset_info(dataset)  # unknown name: ValueError now, not on every rank later
        dpt_data.check_batch_size(batch_size)
        self.dataset, self.data_dir = dataset, data_dir
        self.batch_size, self.val_size = batch_size, val_size
        self.train_limit, self.val_limit = train_limit, val_limit
        self.shuffle, self.seed, self.verbose = shuffle, seed, verbose
        self.num_classes = 10

    def _say(self, what: str) -> None:
        if self.verbose:
            print(f"[rank {_rank()} pid {os.getpid()}] {what}", flush=True)

    def prepare_data(self) -> None:
        """Lightning calls this on ONE process per machine: download or unpack here."""
        self._say("prepare_data")
        raise NotImplementedError("Task 07.3: make sure the files are on disk (dpt_data.prepare); nothing else")

    def setup(self, stage: str | None = None) -> None:
        """Lightning calls this on EVERY process: build the datasets, never download here."""
        self._say(f"setup({getattr(stage, 'value', stage)})")
        raise NotImplementedError("Task 07.3: load tensors (no download) and split with a seeded generator")

    # No DistributedSampler anywhere below: under ddp the Trainer swaps in one per rank.
    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle,
                          generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size)


def _head(ds, limit: int | None):
    if limit is None or limit >= len(ds):
        return ds
    return torch.utils.data.Subset(ds, range(limit))


class LitClassifier(pl.LightningModule):
    """The notebook's 2-layer MLP (hidden 128, Adam, lr 1e-4) as a Lightning 2.x module."""

    def __init__(self, hidden_dim: int = 128, learning_rate: float = 1e-4,
                 noise_std: float = 0.0, num_classes: int = 10):
        super().__init__()
        self.save_hyperparameters()
        self.net = MLP(hidden_dim, num_classes)
        self.val_acc = Accuracy(task="multiclass", num_classes=num_classes)
        self.test_acc = Accuracy(task="multiclass", num_classes=num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # No x.cuda() / x.to(device) here: Lightning has already moved the batch.
        return self.net(x)

    def add_noise(self, x: torch.Tensor) -> torch.Tensor:
        """Gaussian input noise while training (a regularizer), on x's device and dtype."""
        if not self.training or self.hparams.noise_std == 0:
            return x
        raise NotImplementedError("Task 07.4: a fresh random tensor on self.device with x's dtype, never .cuda()")

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.hparams.noise_std > 0:
            x = self.add_noise(x)
        raise NotImplementedError("Task 07.1: forward, cross-entropy, log \"train_loss\" (per step, no sync), return it")

    def validation_step(self, batch, batch_idx):
        x, y = batch
        raise NotImplementedError("Task 07.2: update self.val_acc and log it (the Metric object) and \"val_loss\" with sync_dist=True")

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc.update(self(x).argmax(dim=1), y)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)
