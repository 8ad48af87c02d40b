"""Lesson 04: lesson 03's training launched by torchrun, with snapshots that survive a crash.

Lesson 03 started its processes itself (``mp.spawn``) and worked out each one's rank. Here the
launcher does that: ``torchrun`` starts one process per device and tells each who it is in
environment variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``). When a worker dies, torchrun (with
``--max-restarts``) stops the others and starts them all again. A restarted process has lost
everything in memory, so it resumes from a *snapshot* on disk: model, optimizer, epochs
finished, every rank's random-number state and the sampler's seed. With those, the resumed run
computes the same weights as a run that never failed. This file is lesson 03's ``ddp_spawn.py``
plus what that takes (``CHANGES.diff``), as ``multigpu_torchrun.py`` grows from
``multigpu.py`` in PyTorch's DDP tutorial series.

Run it, from the repository root, on your own tree (``torchrun`` is
``python -m torch.distributed.run``)::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # restarts need it (README: Common errors)
    torchrun --standalone --nproc-per-node=2 --max-restarts=2 \\
        exercises/04_ddp_torchrun/ddp_torchrun.py --epochs 3 --snapshot runs/l04/snap.pt
    # stop it (or kill one worker) mid-run, run the same command again: it resumes.
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from dpt import checkpoint as ckpt
from dpt import cli
from dpt.data import TensorLoader, load_tensors, prepare_distributed
from dpt.device import gpu_for, pick_device, shares_gpu
from dpt.dist import (
    LaunchError,
    TorchrunEnv,
    barrier,
    get_rank,
    get_world_size,
    preflight,
    rank0_print,
)
from dpt.models import build_model


def torchrun_env(environ: dict[str, str] | None = None) -> TorchrunEnv:
    """Who this process is, from the variables torchrun sets (``os.environ`` by default).

    ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` are required; ``LOCAL_WORLD_SIZE`` defaults to
    ``WORLD_SIZE`` and ``TORCHELASTIC_RESTART_COUNT`` to 0. A missing variable, or a rank
    outside its world, raises ``LaunchError`` with a message that says how to launch.
    """
    env = os.environ if environ is None else environ
    # BEGIN SOLUTION 04.1: read and check torchrun's variables
    missing = [k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if k not in env]
    if missing:
        raise LaunchError(f"{', '.join(missing)} not set: start this script with torchrun")
    rank, local_rank, world_size = (int(env[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size):
        raise LaunchError(f"RANK {rank} or LOCAL_RANK {local_rank} out of range (torchrun?)")
    return TorchrunEnv(rank, local_rank, world_size, local_world_size,
                       int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))
    # END SOLUTION


def ddp_setup(args) -> tuple[int, int, torch.device]:
    """Join the job as the process torchrun says this is: ``(rank, world_size, device)``."""
    env = torchrun_env()
    device = join_group(env.rank, env.world_size, env.local_rank, env.local_world_size, args)
    return env.rank, env.world_size, device


# CARRIED FROM 03_ddp_spawn (generated: edit it there, then `make exercises`)
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
    # BEGIN SOLUTION 03.2: copy your answer from lesson 03
    on_gpus = pick_device(args.device, distributed=True).type == "cuda"
    device = gpu_for(local_rank) if on_gpus else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" and not shares_gpu() else "gloo"
    preflight(args, rank, world_size, local_rank, local_world_size, device, backend)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    # END SOLUTION
    return device


# CARRIED FROM 03_ddp_spawn (generated: edit it there, then `make exercises`)
def prepare_dataloader(x: torch.Tensor, y: torch.Tensor, batch_size: int,
                       shuffle: bool = True, seed: int = 0) -> TensorLoader:
    """This rank's share of ``(x, y)``: the ranks' shares never overlap and together cover
    every sample (when the length does not divide, a few samples repeat to even the shares;
    none is dropped). With ``shuffle``, the order is random, the same ``seed`` on every rank."""
    # BEGIN SOLUTION 03.3: copy your answer from lesson 03
    sampler = DistributedSampler(range(len(x)), shuffle=shuffle, seed=seed)
    return TensorLoader(x, y, batch_size=batch_size, sampler=sampler)
    # END SOLUTION


class Trainer:
    """Lesson 03's Trainer, with snapshots: it resumes from ``snapshot_path`` if there is one."""

    def __init__(self, model: nn.Module, train_data, optimizer: torch.optim.Optimizer,
                 device: torch.device, save_every: int = 1,
                 snapshot_path: str | Path | None = None, progress: bool = False):
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.progress = progress
        self.epochs_run = 0  # epochs finished: train() continues from here
        self.history: list[float] = []  # the loss of every step, for the loss curve
        # Whether to resume is one decision, rank 0's, for every rank: ranks that each looked
        # could disagree (a snapshot written between two looks) and hang. Every rank then reads
        # the file from its own disk: without a filesystem that all nodes share, copy the
        # snapshot to every node before a restart.
        if snapshot_path and ckpt.exists_on_rank_0(snapshot_path):
            # BEGIN SOLUTION 04.5: resume where the snapshot left off
            info = load_snapshot(snapshot_path, self.model, self.optimizer, device)
            self.epochs_run = info["epoch"]
            self.train_data.sampler.seed = info["sampler_seed"]
            rank0_print(f"resumed from snapshot {snapshot_path} at epoch {self.epochs_run}"
                        + ("" if info["exact"] else " (another world size: not bit for bit)"))
            # END SOLUTION
            ckpt.check_same_epoch(self.epochs_run, snapshot_path)  # no node had an old copy
        # DDP broadcasts rank 0's weights, then averages the gradients in every backward()
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

    # CARRIED FROM 03_ddp_spawn (generated: edit it there, then `make exercises`)
    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimization step on one batch (already on the device); returns its loss."""
        # BEGIN SOLUTION 01.1: copy your answer from lesson 01
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()
        # END SOLUTION

    # CARRIED FROM 03_ddp_spawn (generated: edit it there, then `make exercises`)
    def _run_epoch(self, epoch: int, limit_batches: int | None = None) -> float:
        """One pass over the data (at most ``limit_batches`` batches); returns the mean loss."""
        # BEGIN SOLUTION 03.4: copy your answer from lesson 03
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

    def _save_snapshot(self, epoch: int) -> None:
        """Collective: every rank calls it; rank 0 alone writes the snapshot (the format is
        below), as lesson 01's checkpoint is written. Nobody goes on before it is complete."""
        # BEGIN SOLUTION 04.3: everything a restarted job needs, written once
        rngs = gather_rng_states(self.device)
        if get_rank() == 0:
            save_checkpoint(self.snapshot_path, self.model, self.optimizer, epoch, rng=rngs,
                            world_size=len(rngs), sampler={"seed": self.train_data.sampler.seed})
        barrier()
        # END SOLUTION

    def train(self, max_epochs: int, limit_batches: int | None = None) -> list[float]:
        """Run epochs ``epochs_run .. max_epochs-1``; returns each epoch's mean loss."""
        losses = []
        for epoch in range(self.epochs_run, max_epochs):
            losses.append(self._run_epoch(epoch, limit_batches))
            rank0_print(f"epoch {epoch}: mean train loss {losses[-1]:.4f}")
            self.epochs_run = epoch + 1
            if self.snapshot_path and self.epochs_run % self.save_every == 0:
                self._save_snapshot(self.epochs_run)
        return losses


# CARRIED FROM 03_ddp_spawn (generated: edit it there, then `make exercises`)
@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device) -> tuple[int, int]:
    """``(correct, total)`` over the WHOLE dataset, the same on every rank, as ints.

    ``loader`` holds this rank's share (a ``DistributedSampler`` without shuffling), which
    repeats a few samples when the dataset does not divide evenly: each sample counts once.
    The model predicts in eval mode and is left in the mode it was in.
    """
    # BEGIN SOLUTION 03.6: copy your answer from lesson 03
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


# CARRIED FROM 03_ddp_spawn (generated: edit it there, then `make exercises`)
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


# CARRIED FROM 03_ddp_spawn (generated: edit it there, then `make exercises`)
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


# A snapshot is lesson 01's checkpoint ("model", "optimizer", "epoch": epochs finished) plus
#   "world_size": ranks that wrote it, "sampler": {"seed": the DistributedSampler's seed},
#   "rng": one entry per rank, {"torch": CPU generator state, "cuda": its GPU's state or None}


def gather_rng_states(device: torch.device) -> list[dict]:
    """Every rank's random-number state, in rank order, on every rank (collective; without a
    process group, a list of one). Reading the states draws no random number."""
    # BEGIN SOLUTION 04.2: each rank's generator states, gathered from every rank
    state = {"torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
    states = [state] * get_world_size()
    if get_world_size() > 1:
        dist.all_gather_object(states, state)
    return states
    # END SOLUTION


def load_snapshot(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                  device: torch.device) -> dict:
    """Load ``path`` into ``model`` (already on ``device``) and ``optimizer``, and restore
    this rank's own random-number state when the world size is the one that wrote it.

    Returns ``{"epoch", "sampler_seed", "exact"}``; ``exact`` is False when the world size
    changed (the run resumes, but not bit for bit). A broken file is a ``CheckpointError``.
    """
    # BEGIN SOLUTION 04.4: model, optimizer and this rank's random-number state back
    state = load_checkpoint(path, model, optimizer, device)
    exact = state["world_size"] == get_world_size()
    if exact:
        rng = state["rng"][get_rank()]
        torch.set_rng_state(rng["torch"].cpu())
        if rng["cuda"] is not None and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"].cpu(), device)
    return {"epoch": state["epoch"], "sampler_seed": state["sampler"]["seed"], "exact": exact}
    # END SOLUTION


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
                      args.snapshot, args.progress)
    rank0_print(cli.describe(args, device))
    seconds = cli.timed(trainer.train, args.epochs, args.limit_batches)
    correct, total = evaluate(trainer.model, test_data, device)
    rank0_print(f"test accuracy: {correct / total:.4f} ({correct}/{total})")
    return {"accuracy": correct / total, "seconds": seconds, "history": trainer.history}


def main(args) -> dict:
    """One worker of the job (torchrun starts it): join, build, train, test, leave.

    Returns ``{"accuracy", "seconds", "history"}`` (the loss of every step).
    """
    rank, world_size, device = ddp_setup(args)
    try:
        return train_and_evaluate(args, device)
    finally:
        # BEGIN SOLUTION 03.2: copy your answer from lesson 03
        dist.destroy_process_group()
        # END SOLUTION


def build_parser():
    p = cli.parser("Lesson 04: DDP under torchrun, with snapshots.", per_rank=True, epochs=2)
    p.add_argument("--snapshot", default=None, help="resume from it if present; save to it")
    return p


if __name__ == "__main__":
    sys.exit(cli.main(main, build_parser()))
