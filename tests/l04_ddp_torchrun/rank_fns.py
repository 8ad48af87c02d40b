"""Functions lesson 04's tests run on several ranks (module level, so they can be pickled)."""

from __future__ import annotations

import copy
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

from dpt.checkpoint import CheckpointError
from dpt.data import TensorLoader
from dpt.dist import find_free_port, rank_device
from dpt.models import ConvNet
from tests.helpers import (
    TRAINING_ARGS,
    recording_moves,
    run_leaving_the_group,
    slowed,
    unsent_message,
)
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


def _trainer(mod, rank, world_size, model, opt, snapshot_path=None, seed=3, n=64):
    x, y = _data(n)
    sampler = SpySampler(range(len(x)), num_replicas=world_size, rank=rank, shuffle=True,
                         seed=seed)
    return mod.Trainer(model, TensorLoader(x, y, batch_size=8, sampler=sampler), opt,
                       rank_device(), snapshot_path=snapshot_path)


def rng_states_on_ranks(rank, world_size):
    """Each rank has its own RNG state; every rank must receive all of them, in rank order."""
    mod = _mod()
    torch.manual_seed(1000 + rank)
    torch.rand(rank + 1)
    mine = torch.get_rng_state()
    states = mod.gather_rng_states(rank_device())
    return {"mine": mine, "states": [s["torch"] for s in states],
            "after": torch.get_rng_state()}


def save_snapshot_on_ranks(rank, world_size, folder):
    """Every rank snapshots to its OWN path: only rank 0 may write a file."""
    mod = _mod()
    model, opt = _stepped_model(seed=0)  # the same weights on every rank
    try:  # a first run: the snapshot file does not exist yet
        trainer = _trainer(mod, rank, world_size, model, opt, Path(folder) / f"snap{rank}.pt",
                           seed=7)
    except CheckpointError as exc:
        return {"error": str(exc)}
    torch.manual_seed(1000 + rank)  # a different RNG state on every rank
    torch.rand(rank + 1)
    rng = torch.get_rng_state()
    trainer._save_snapshot(3)
    after = torch.get_rng_state()
    # Then all snapshot to one path while rank 0 writes slowly: nobody may return before the
    # file is there (a rank that runs ahead could read, or be restarted onto, no snapshot).
    dist.barrier()
    with slowed(torch, "save"):
        trainer.snapshot_path = Path(folder) / "shared.pt"
        trainer._save_snapshot(4)
        there_on_return = trainer.snapshot_path.is_file()
    return {"rng": rng, "model": {k: v.cpu() for k, v in model.state_dict().items()},
            "after": after, "there_on_return": there_on_return}


def load_snapshot_on_ranks(rank, world_size, path):
    """Each rank starts from different weights and its own RNG, then loads the snapshot."""
    mod = _mod()
    model, opt = _stepped_model(seed=50 + rank)
    ddp = DDP(model) if dist.is_initialized() else model
    torch.manual_seed(777 + rank)
    info = mod.load_snapshot(path, ddp, opt, torch.device("cpu"))
    return {"info": info, "model": model.state_dict(), "optimizer": opt.state_dict(),
            "draw": torch.rand(4)}


def resume_from_snapshot(rank, world_size, path):
    """Ranks build models from different seeds and a loader seeded 3; a Trainer given the
    snapshot must start from its weights, epoch and sampler seed, and train on from there."""
    mod = _mod()
    torch.manual_seed(100 + rank)  # different initial weights on purpose
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with recording_moves() as moves:
        trainer = _trainer(mod, rank, world_size, model, opt, snapshot_path=path, seed=3)
    plain = getattr(trainer.model, "module", trainer.model)  # DDP's module, if wrapped
    start = {k: v.cpu().clone() for k, v in plain.state_dict().items()}
    optimizer = copy.deepcopy(opt.state_dict())  # training goes on to change it in place
    epochs_run = trainer.epochs_run
    trainer.snapshot_path = None  # train without writing over the test's snapshot
    trainer.train(epochs_run + 2, limit_batches=2)
    return {"start": start, "optimizer": optimizer, "epochs_run": epochs_run,
            "passes": trainer.train_data.sampler.passes,
            "model_sent": moves.module_sent(model, rank_device()),
            "end": {k: v.detach().cpu() for k, v in plain.named_parameters()}}


def resume_when_one_rank_sees_the_snapshot(rank, world_size, path, seer):
    """A Trainer given ``path``, where only rank ``seer`` finds the file when it looks
    (``os.path.exists``, ``Path.exists``): as when the snapshot is written between two ranks'
    looks, or a node keeps an old file the others do not have. Reading it still works, so only
    the decision to resume is tested. Returns where this rank starts: epoch and sampler seed."""
    mod = _mod()
    real_exists, real_path_exists = os.path.exists, Path.exists
    target = os.path.abspath(path)

    def seen(p) -> bool:
        return rank == seer or os.path.abspath(p) != target

    os.path.exists = lambda p: seen(p) and real_exists(p)
    Path.exists = lambda self, *a, **k: seen(self) and real_path_exists(self, *a, **k)
    try:
        torch.manual_seed(0)
        model = ConvNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        trainer = _trainer(mod, rank, world_size, model, opt, snapshot_path=path, seed=3)
    finally:
        os.path.exists, Path.exists = real_exists, real_path_exists
    return {"epochs_run": trainer.epochs_run, "seed": trainer.train_data.sampler.seed}


def resume_from_unlike_copies(rank, world_size, path, stale):
    """A Trainer given ``path`` on nodes without a shared disk, where rank 1's node holds an
    older copy (``stale``: what rank 1 reads at ``path``). Returns where this rank starts, or
    the CheckpointError it raised."""
    import dpt.checkpoint

    mod = _mod()
    real_load = dpt.checkpoint.load
    if rank == 1:
        dpt.checkpoint.load = lambda p, *a, **k: real_load(
            stale if os.path.abspath(p) == os.path.abspath(path) else p, *a, **k)
    try:
        torch.manual_seed(0)
        model = ConvNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        trainer = _trainer(mod, rank, world_size, model, opt, snapshot_path=path, seed=3)
    except CheckpointError as exc:
        return {"error": str(exc), "epochs_run": None}
    finally:
        dpt.checkpoint.load = real_load
    return {"error": None, "epochs_run": trainer.epochs_run}


def trainer_without_a_snapshot(rank, world_size):
    """A run without --snapshot: the Trainer starts at epoch 0 and trains its batches. The
    model comes in eval mode (as evaluate() leaves it between runs), and the batches are
    watched for their move to the device."""
    mod = _mod()
    torch.manual_seed(0)
    model = ConvNet().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    try:
        trainer = _trainer(mod, rank, world_size, model, opt, snapshot_path=None)
    except Exception as exc:  # noqa: BLE001 (the test reports it in the student's terms)
        return {"error": f"{type(exc).__name__}: {exc}"}
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(module.training))
    with recording_moves() as moves:
        trainer.train_data = moves.loader(trainer.train_data)
        losses = trainer.train(2, limit_batches=2)
    return {"error": None, "epochs_run": trainer.epochs_run, "forwards": len(forwards),
            "losses": losses, "modes": forwards, "history": list(trainer.history),
            "unsent": unsent_message(moves, rank_device(), "the training batches",
                                     "Trainer._run_epoch")}


def run_leaves_the_group(rank, world_size, fail):
    """The lesson's ``main`` (one torchrun worker) with a stand-in for the training: whether it
    returns or raises, the process must have left the process group afterwards."""
    from argparse import Namespace

    args = Namespace(device="cpu", timeout=60.0, threads=1, snapshot=None, **TRAINING_ARGS)
    return run_leaving_the_group(lambda: _mod().main(args), fail, _mod())


def write_then_die_mid_snapshot(folder: str, marker: str, error: str) -> None:
    """Child process: write snapshot epoch 1, then start epoch 2's and stall half-written.

    The parent SIGKILLs us while ``torch.save`` has written half of its bytes.
    """
    try:
        mod = _mod()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)  # the Trainer wraps in DDP
        model, opt = _stepped_model(seed=0)
        trainer = _trainer(mod, 0, 1, model, opt, Path(folder) / "snapshot.pt")
        trainer._save_snapshot(1)
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
        trainer._save_snapshot(2)
        Path(error).write_text("_save_snapshot returned although torch.save never finished")
    except BaseException:  # noqa: BLE001 - hand the failure to the parent
        Path(error).write_text(traceback.format_exc())
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
