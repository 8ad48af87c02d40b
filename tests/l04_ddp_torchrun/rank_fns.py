"""Functions lesson 04's tests run on several ranks (module level, so they can be pickled)."""

from __future__ import annotations

import os
import signal
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from dpt.data import TensorLoader
from dpt.models import ConvNet
from tests.lessons import load

LESSON = "04_ddp_torchrun"


def _mod():
    return load(LESSON, "ddp_torchrun")


def _data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def _stepped_model(seed: int):
    """A ConvNet (seeded) and an SGD-momentum optimizer that has taken one step."""
    torch.manual_seed(seed)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(8, seed)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return model, opt


class SpySampler(DistributedSampler):
    """A DistributedSampler that records the epoch and the indices of every pass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes: list[tuple[int, list[int]]] = []

    def __iter__(self):
        order = list(super().__iter__())
        self.passes.append((self.epoch, order))
        return iter(order)


def trainer_epochs(rank, world_size, runs):
    """For each ``(epochs, start_epoch)`` of ``runs``: the sampler passes the Trainer makes."""
    return [_trainer_epochs(rank, world_size, epochs, start) for epochs, start in runs]


def _trainer_epochs(rank, world_size, epochs, start_epoch):
    mod = _mod()
    x, y = _data(64)
    sampler = SpySampler(range(len(x)), num_replicas=world_size, rank=rank, shuffle=True, seed=3)
    loader = TensorLoader(x, y, batch_size=8, sampler=sampler)
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = mod.Trainer(model, loader, opt, torch.device("cpu"), save_every=0)
    trainer.epochs_run = start_epoch
    trainer.train(epochs, limit_batches=2)
    return {"passes": sampler.passes, "epochs_run": trainer.epochs_run}


def trainer_save_schedule(rank, world_size, runs):
    """For each ``(epochs, save_every, path)``: the epochs-done values the Trainer snapshots
    at (save() is recorded, not written)."""
    return [_save_schedule(rank, world_size, *run) for run in runs]


def _save_schedule(rank, world_size, epochs, save_every, path):
    mod = _mod()

    class Recording(mod.Trainer):
        def __init__(self, *args, **kwargs):
            self.saved = []
            super().__init__(*args, **kwargs)

        def save(self, epochs_done):
            self.saved.append(epochs_done)

    x, y = _data(32)
    sampler = DistributedSampler(range(len(x)), num_replicas=world_size, rank=rank, seed=0)
    loader = TensorLoader(x, y, batch_size=8, sampler=sampler)
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = Recording(model, loader, opt, torch.device("cpu"), save_every=save_every,
                        snapshot_path=path)
    trainer.train(epochs, limit_batches=1)
    return trainer.saved


def trainer_weights_agree(rank, world_size, snapshot_paths):
    """Ranks build models from different seeds; after the Trainer starts (and loads the
    snapshot when there is one) and trains, all ranks must hold the same weights."""
    return [_weights_agree(rank, world_size, path) for path in snapshot_paths]


def _weights_agree(rank, world_size, snapshot_path):
    mod = _mod()
    x, y = _data(64)
    sampler = DistributedSampler(range(len(x)), num_replicas=world_size, rank=rank, seed=0)
    loader = TensorLoader(x, y, batch_size=8, sampler=sampler)
    torch.manual_seed(100 + rank)  # different initial weights on purpose
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = mod.Trainer(model, loader, opt, torch.device("cpu"), save_every=0,
                          snapshot_path=snapshot_path)
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train(trainer.epochs_run + 1, limit_batches=2)
    return {"start": start, "end": dict(trainer.model.named_parameters()),
            "epochs_run": trainer.epochs_run}


def save_snapshot_on_ranks(rank, world_size, folder):
    """Every rank calls save_snapshot with its OWN path: only rank 0 may write a file."""
    mod = _mod()
    model, opt = _stepped_model(seed=0)  # the same weights on every rank
    ddp = DDP(model)
    torch.manual_seed(1000 + rank)  # a different RNG state on every rank
    torch.rand(rank + 1)
    rng = torch.get_rng_state()
    mod.save_snapshot(Path(folder) / f"snap{rank}.pt", ddp, opt, epoch=3, sampler_seed=7)
    return {"rng": rng, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "after": torch.get_rng_state()}


def load_snapshot_on_ranks(rank, world_size, path):
    """Each rank starts from different weights and its own RNG, then loads the snapshot."""
    mod = _mod()
    model, opt = _stepped_model(seed=50 + rank)
    ddp = DDP(model) if dist.is_initialized() else model
    torch.manual_seed(777 + rank)
    info = mod.load_snapshot(path, ddp, opt)
    return {"info": info, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "draw": torch.rand(4)}


def write_then_die_mid_snapshot(folder: str, marker: str, error: str) -> None:
    """Child process: write snapshot epoch 1, then start epoch 2's and stall half-written.

    The parent SIGKILLs us while ``torch.save`` has written half of its bytes.
    """
    try:
        mod = _mod()
        path = Path(folder) / "snapshot.pt"
        model, opt = _stepped_model(seed=0)
        mod.save_snapshot(path, model, opt, epoch=1, sampler_seed=0)
        real_save = torch.save

        def half_then_stall(obj, f, *args, **kwargs):
            import io

            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            if isinstance(f, (str, os.PathLike)):
                f = open(f, "wb")  # noqa: SIM115 - we are about to be killed
            f.write(data[: len(data) // 2])
            f.flush()
            Path(marker).write_text("half written")
            time.sleep(120)

        torch.save = half_then_stall
        mod.save_snapshot(path, model, opt, epoch=2, sampler_seed=0)
        Path(error).write_text("save_snapshot returned although torch.save never finished")
    except BaseException:  # noqa: BLE001 - hand the failure to the parent
        Path(error).write_text(traceback.format_exc())
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
