"""Lesson 07: Lightning 1.x calls against Lightning 2.x, one row per change.

Every row holds two small programs: ``old()`` runs the call as Lightning 1.x tutorials wrote it, ``new()``
runs today's replacement. ``run_row`` executes both, so the table printed by
``python lit_migration.py`` (and shown in the README and the notebook) carries the error
text this very Lightning install produces, not a remembered one.
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Accuracy

from dpt.models import MLP

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False)


# ------------------------------------------------------------------ the kwargs translator


def migrate_trainer_kwargs(old: dict, cuda: bool | None = None) -> dict:
    """Turn Lightning 1.x ``Trainer`` keyword arguments into 2.x ones.

    ``gpus=N`` -> ``accelerator="gpu", devices=N``; ``distributed_backend``/``accelerator``
    naming a strategy -> ``strategy``; ``dp`` and ``ddp2`` -> ``ddp``; ``ddp_sharded`` ->
    ``fsdp`` on GPUs (on CPU: ``ddp``, shard the optimizer with ZeroRedundancyOptimizer);
    ``weights_summary=None`` -> ``enable_model_summary=False``. Other keys pass through.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    # BEGIN SOLUTION 07.6: translate gpus, distributed_backend, accelerator="dp"/"ddp*", dp/ddp2/ddp_sharded, weights_summary
    new = dict(old)
    backend = new.pop("distributed_backend", None)
    if new.get("accelerator") in ("dp", "ddp", "ddp2", "ddp_spawn", "ddp_sharded"):
        backend = backend or new.pop("accelerator")  # 1.x accepted a strategy name here
    strategies = {"dp": "ddp", "ddp2": "ddp", "ddp_sharded": "fsdp" if cuda else "ddp",
                  "ddp_spawn": "ddp_spawn", "ddp": "ddp", "fsdp": "fsdp"}
    if "gpus" in new:
        gpus = new.pop("gpus")
        if gpus not in (None, 0):
            new["accelerator"] = "gpu"
            new["devices"] = gpus
    if backend is not None:
        new["strategy"] = backend
    if new.get("strategy") in strategies:
        new["strategy"] = strategies[new["strategy"]]
    if "weights_summary" in new:
        new["enable_model_summary"] = new.pop("weights_summary") is not None
    return new
    # END SOLUTION


# ------------------------------------------------------------------ tiny modules for rows


def tiny_loader(n: int = 32, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 1, 28, 28, generator=g),
                                    torch.randint(0, 10, (n,), generator=g)),
                      batch_size=batch_size)


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = MLP(16)
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OldStepEnd(Tiny):
    """The Lightning MNIST notebook's custom reduction: the loss is averaged in ``training_step_end``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.cross_entropy(self.net(x), y)}

    def training_step_end(self, outputs):
        self._count("training_step_end")
        return {"loss": outputs["loss"].mean()}


class NewStepEnd(Tiny):
    """2.x: do the reduction in ``training_step``; for every rank's outputs, all_gather."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        everyone = self.all_gather(logits.detach())  # (world, B, C) under ddp, (B, C) alone
        self._count("training_step")
        self.gathered_shape = tuple(everyone.shape)
        return F.cross_entropy(logits, y)


class OldEpochEnd(Tiny):
    def training_epoch_end(self, outputs):
        self._count("training_epoch_end")


class NewEpochEnd(Tiny):
    """2.x: keep what you need as attributes, read it in ``on_train_epoch_end``."""

    def on_train_epoch_start(self):
        self.step_losses = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.step_losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self):
        self._count("on_train_epoch_end")
        self.epoch_mean = torch.stack(self.step_losses).mean()


def _fit(module: pl.LightningModule, **kwargs) -> pl.LightningModule:
    kwargs = {**QUIET, "accelerator": "cpu", "devices": 1, "max_epochs": 1, **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(**kwargs).fit(module, tiny_loader())
    return module


# --------------------------------------------------------------------------- the rows


@dataclass
class Row:
    old_api: str  # as Lightning 1.x code wrote it
    new_api: str
    old: Callable[[], object]  # runs the old call (expected to fail or do nothing)
    new: Callable[[], object]  # runs the new call
    note: str = ""


def _trainer(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pl.Trainer(**QUIET, **kwargs)


def _cpu(kwargs: dict) -> dict:
    """This machine has no GPU: check the translated call with the CPU in place of "gpu"."""
    return {**kwargs, "accelerator": "cpu"} if kwargs.get("accelerator") == "gpu" else kwargs


def _accuracy_new():
    acc = Accuracy(task="multiclass", num_classes=10)
    return acc(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 0]))


def _step_end_old():
    module = _fit(OldStepEnd(), max_steps=2)
    return f"training_step_end called {module.calls.get('training_step_end', 0)} times"


ROWS: list[Row] = [
    Row("Trainer(gpus=2)", 'Trainer(accelerator="gpu", devices=2)',
        lambda: _trainer(gpus=2),
        lambda: _trainer(**_cpu(migrate_trainer_kwargs({"gpus": 2}, cuda=True)))),
    Row('Trainer(gpus=2, accelerator="dp")', 'Trainer(accelerator="gpu", devices=2, strategy="ddp")',
        lambda: _trainer(accelerator="dp"),
        lambda: _trainer(**_cpu(migrate_trainer_kwargs({"gpus": 2, "accelerator": "dp"},
                                                       cuda=True))),
        "DataParallel is gone: one process per device instead"),
    Row('Trainer(strategy="dp")', 'Trainer(strategy="ddp")',
        lambda: _trainer(strategy="dp"),
        lambda: _trainer(accelerator="cpu", devices=2, **migrate_trainer_kwargs({"strategy": "dp"}))),
    Row("Trainer(distributed_backend='ddp')", 'Trainer(strategy="ddp")',
        lambda: _trainer(distributed_backend="ddp"),
        lambda: _trainer(accelerator="cpu", devices=2,
                         **migrate_trainer_kwargs({"distributed_backend": "ddp"}))),
    Row('Trainer(strategy="ddp2")', 'Trainer(strategy="ddp")',
        lambda: _trainer(strategy="ddp2"),
        lambda: _trainer(accelerator="cpu", devices=2, **migrate_trainer_kwargs({"strategy": "ddp2"})),
        "DP inside a node is gone; plain DDP over every device"),
    Row('Trainer(strategy="ddp_sharded")',
        'Trainer(strategy="fsdp") on GPUs; on CPU strategy="ddp" + ZeroRedundancyOptimizer',
        lambda: _trainer(strategy="ddp_sharded"),
        lambda: _trainer(accelerator="cpu", devices=2,
                         **migrate_trainer_kwargs({"strategy": "ddp_sharded"}, cuda=False)),
        "fairscale is gone; FSDP refuses the CPU (see lit_train.py --strategy fsdp)"),
    Row("def training_step_end(self, outputs)",
        "reduce in training_step (self.all_gather for every rank's outputs)",
        _step_end_old,
        lambda: _fit(NewStepEnd(), max_steps=2).calls,
        "no error at all: the hook is silently never called"),
    Row("def training_epoch_end(self, outputs)",
        "def on_train_epoch_end(self) + outputs kept as attributes",
        lambda: _fit(OldEpochEnd(), max_steps=2),
        lambda: _fit(NewEpochEnd(), max_steps=2).calls),
    Row("Trainer(weights_summary=None)", "Trainer(enable_model_summary=False)",
        lambda: _trainer(weights_summary=None),
        lambda: pl.Trainer(logger=False, **migrate_trainer_kwargs({"weights_summary": None}))),
    Row("Accuracy(num_classes=10)", 'Accuracy(task="multiclass", num_classes=10)',
        lambda: Accuracy(num_classes=10), _accuracy_new),
]


def run_row(row: Row) -> tuple[str, object]:
    """Run the old call; return ("ExceptionType: message", new-call result) or the old result."""
    try:
        outcome = f"runs: {row.old()}"
    except Exception as exc:  # noqa: BLE001 - the error IS the finding
        outcome = f"{type(exc).__name__}: {exc}"
    return outcome, row.new()


def first_sentence(text: str) -> str:
    text = text.replace("`", "'").replace("|", "/")
    return text.split(". ")[0].rstrip(".")


def markdown_table() -> str:
    lines = ["| old call (Lightning 1.x) | what Lightning 2.x does with it | new call |",
             "|---|---|---|"]
    for row in ROWS:
        outcome, _ = run_row(row)
        note = f" ({row.note})" if row.note else ""
        lines.append(f"| `{row.old_api}` | {first_sentence(outcome)}{note} | `{row.new_api}` |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
    sys.exit(0)
