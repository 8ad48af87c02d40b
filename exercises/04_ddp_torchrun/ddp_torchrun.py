# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 04: DDP launched by torchrun, with snapshots that survive a worker dying.

Lesson 03 started its ranks itself (``mp.spawn``) and passed each one its rank. Here the
launcher does that job: ``torchrun`` starts one process per device, and tells each one who it
is through environment variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``). The script parses no ``--local_rank``.

When a worker dies, torchrun (with ``--max-restarts=K``) stops the others and starts the whole
group again. A restarted process has lost everything in memory, so it resumes from a
*snapshot* on disk: model, optimizer, the number of finished epochs, the random-number state of
every rank and the sampler's seed. With those, the resumed run computes the same weights as a
run that never failed.

Run it (from the repository root; ``torchrun`` is ``python -m torch.distributed.run``)::

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # needed for restarts with gloo on torch 2.14
    torchrun --standalone --nproc-per-node=2 exercises/04_ddp_torchrun/ddp_torchrun.py \\
        --epochs 2 --snapshot runs/l04/snapshot.pt
    # a worker dies mid-epoch on the first attempt; torchrun restarts; training resumes:
    torchrun --standalone --nproc-per-node=2 --max-restarts=2 \\
        exercises/04_ddp_torchrun/ddp_torchrun.py --epochs 3 --snapshot runs/l04/snap.pt \\
        --fail-at 1:5 --fail-rank 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler
from tqdm.auto import tqdm

from dpt import checkpoint as ckpt
from dpt.data import DATASETS, DEFAULT_DATASET, DataError, TensorLoader, check_batch_size
from dpt.device import DEVICE_CHOICES, DeviceError
from dpt.dist import cleanup, setup
from dpt.models import MODELS, build_model

SNAPSHOT_VERSION = 1
FAULT_EXIT_CODE = 13  # what an injected fault exits with, so logs can tell it from a bug


class LaunchError(RuntimeError):
    """The script was started the wrong way (not by torchrun, or with old launcher flags)."""


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int  # global rank: 0 .. world_size-1 across every node
    local_rank: int  # rank on this machine: which GPU to use
    world_size: int  # processes in the whole job
    local_world_size: int  # processes on this machine (for CPU threads per rank)
    restart_count: int  # 0 on the first attempt, then 1, 2, ... after each elastic restart


def torchrun_env(environ: dict[str, str] | None = None) -> TorchrunEnv:
    """Read who this process is from the variables torchrun sets.

    ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` are required: without them, raise
    :class:`LaunchError` saying to launch with torchrun. ``LOCAL_WORLD_SIZE`` defaults to
    ``WORLD_SIZE`` and ``TORCHELASTIC_RESTART_COUNT`` to 0. A rank outside
    ``0..WORLD_SIZE-1`` (or a local rank outside ``0..LOCAL_WORLD_SIZE-1``) is a LaunchError.
    """
    env = os.environ if environ is None else environ
    raise NotImplementedError("Task 04.1: read RANK, LOCAL_RANK, WORLD_SIZE (required: LaunchError naming torchrun if missing), LOCAL_WORLD_SIZE (default WORLD_SIZE), TORCHELASTIC_RESTART_COUNT (default 0); check the ranks are in range; return a TorchrunEnv")


def make_train_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int,
                      world_size: int, seed: int = 0) -> TensorLoader:
    """This rank's share of the training set: a ``TensorLoader`` over ``(x, y)`` whose sampler
    is a shuffling ``DistributedSampler`` for ``rank`` of ``world_size``, seeded with ``seed``
    (the same seed on every rank, so they agree on one permutation and take disjoint parts)."""
    raise NotImplementedError("Task 04.2: build DistributedSampler(range(len(x)), num_replicas=world_size, rank=rank, shuffle=True, seed=seed) and return TensorLoader(x, y, batch_size=..., sampler=it)")


# ------------------------------------------------------------------------------- snapshots
#
# The snapshot is one dict, written by rank 0 and read by every rank:
#   "version":  SNAPSHOT_VERSION
#   "model":    the unwrapped model's state_dict (no "module." prefix: loads into a plain model)
#   "optimizer": optimizer.state_dict() (momentum buffers: without them the resume differs)
#   "epoch":    epochs finished; training resumes at this epoch
#   "world_size": how many ranks wrote it
#   "rng":      one entry per rank: {"torch": CPU generator state, "cuda": state or None}
#   "sampler":  {"seed": the DistributedSampler's seed}; its epoch is "epoch"


def _rng_state(device: torch.device) -> dict:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def save_snapshot(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                  epoch: int, sampler_seed: int, device: torch.device | str = "cpu") -> None:
    """Collective: every rank calls it; rank 0 alone writes ``path`` atomically.

    Every rank's RNG state is gathered to rank 0 (``dist.all_gather_object``) so each rank can
    get its own back on resume. The file holds the keys listed above; the model's state has no
    ``module.`` prefix. All ranks wait (barrier) until the file is in place. Works without a
    process group too (one process, rank 0).
    """
    device = torch.device(device)
    raise NotImplementedError("Task 04.3: gather every rank's _rng_state(device) (all_gather_object when a group is up), then on rank 0 only: build the dict (model unwrapped from .module) and dpt.checkpoint.atomic_save it; finally barrier")


def load_snapshot(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                  device: torch.device | str = "cpu") -> dict:
    """Every rank reads ``path`` (``dpt.checkpoint.load``, CheckpointError when broken) into
    ``model`` (unwrapped if it is DDP) and ``optimizer``, and restores its own RNG state (entry
    ``rank`` of ``"rng"``) when the snapshot was written by the same world size.

    Returns ``{"epoch": epochs finished, "sampler_seed": seed, "exact": bool}``; ``exact`` is
    False when the world size changed (the run resumes, but not bit for bit).
    """
    device = torch.device(device)
    raise NotImplementedError("Task 04.4: state = dpt.checkpoint.load(path, map_location=device); load \"model\" into the unwrapped model and \"optimizer\"; if world_size matches, torch.set_rng_state(state[\"rng\"][rank][\"torch\"]) (and cuda); return the dict described above")


# --------------------------------------------------------------------------------- trainer


@dataclass
class Fault:
    """Make ``rank`` die at batch ``batch`` of epoch ``epoch``, on the first attempt only."""
    epoch: int
    batch: int
    rank: int = 1

    @classmethod
    def parse(cls, text: str | None, rank: int = 1) -> Fault | None:
        if not text:
            return None
        try:
            epoch, batch = (int(v) for v in text.split(":"))
        except ValueError:
            raise ValueError(f"--fail-at wants EPOCH:BATCH (e.g. 1:5), got {text!r}") from None
        if epoch < 0 or batch < 0:
            raise ValueError(f"--fail-at needs non-negative numbers, got {text!r}")
        return cls(epoch, batch, rank)

    def maybe_fire(self, rank: int, restart_count: int, epoch: int, batch: int) -> None:
        if restart_count == 0 and rank == self.rank and (epoch, batch) == (self.epoch, self.batch):
            print(f"[rank {rank}] injected fault: exiting at epoch {epoch} batch {batch} "
                  f"(attempt {restart_count})", file=sys.stderr, flush=True)
            os._exit(FAULT_EXIT_CODE)  # a crash: no cleanup, no goodbye to the other ranks


class Trainer:
    """Seed 004's ``Trainer`` for torchrun, in the spirit of pytorch/examples minGPT-ddp.

    It wraps the model in DDP, and on start loads ``snapshot_path`` if it exists, on every
    rank, *before* wrapping (DDP then broadcasts rank 0's copy, which is the same anyway).
    """

    def __init__(self, model: nn.Module, train_data: TensorLoader,
                 optimizer: torch.optim.Optimizer, device: torch.device, save_every: int = 1,
                 snapshot_path: str | Path | None = None, fault: Fault | None = None,
                 restart_count: int = 0, progress: bool = False, sampler_seed: int = 0):
        self.device = device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = Path(snapshot_path) if snapshot_path else None
        self.fault = fault
        self.restart_count = restart_count
        self.progress = progress and self.rank == 0
        self.sampler_seed = sampler_seed
        self.epochs_run = 0
        self.resumed: dict | None = None
        self.history: list[float] = []
        if self.snapshot_path is not None and self.snapshot_path.exists():
            self.resumed = load_snapshot(self.snapshot_path, self.model, self.optimizer, device)
            self.epochs_run = self.resumed["epoch"]
            self.sampler_seed = self.resumed["sampler_seed"]
            sampler = getattr(self.train_data, "sampler", None)
            if hasattr(sampler, "seed"):
                sampler.seed = self.sampler_seed  # the snapshot's data order wins
        self.ddp = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

    def save(self, epochs_done: int) -> None:
        save_snapshot(self.snapshot_path, self.ddp, self.optimizer, epochs_done,
                      self.sampler_seed, self.device)

    def _run_epoch(self, epoch: int, limit_batches: int | None = None) -> float:
        self.ddp.train()
        total = len(self.train_data)
        if limit_batches is not None:
            total = min(total, limit_batches)
        bar = tqdm(self.train_data, total=total, desc=f"epoch {epoch}",
                   disable=not self.progress, leave=False)
        losses = []
        for i, (inputs, targets) in enumerate(bar):
            if i >= total:
                break
            if self.fault is not None:
                self.fault.maybe_fire(self.rank, self.restart_count, epoch, i)
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            self.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.ddp(inputs), targets)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            self.optimizer.step()
            losses.append(loss.item())
        bar.close()
        self.history.extend(losses)
        return sum(losses) / max(1, len(losses))

    def train(self, max_epochs: int, limit_batches: int | None = None) -> list[float]:
        """Run epochs ``epochs_run .. max_epochs-1``. Before each, tell the sampler the epoch
        (a new shuffle every epoch, the same on every rank); after each, when
        ``snapshot_path`` is set and ``save_every`` divides the epochs done, call
        ``self.save(epochs_done)``. Returns each epoch's mean loss."""
        losses = []
        raise NotImplementedError("Task 04.5: for epoch in range(self.epochs_run, max_epochs): self.train_data.sampler.set_epoch(epoch); run the epoch; update self.epochs_run; save every save_every epochs (when snapshot_path is set)")
        return losses


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
             batch_size: int = 1000) -> tuple[int, int]:
    """Whole-test-set accuracy counts: rank r scores samples r, r+N, r+2N, ... (no sample twice,
    none left out), then the counts are summed over the ranks."""
    model = getattr(model, "module", model)
    was_training = model.training
    model.eval()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    xs, ys = x[rank::world], y[rank::world]
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for start in range(0, len(xs), batch_size):
        inputs, targets = xs[start:start + batch_size].to(device), ys[start:start + batch_size].to(device)
        counts[0] += (model(inputs).argmax(1) == targets).sum()
        counts[1] += targets.numel()
    if dist.is_initialized():
        dist.all_reduce(counts)
    model.train(was_training)
    return int(counts[0]), int(counts[1])


# ------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Lesson 04: DDP under torchrun, with snapshots and elastic restarts. "
                    "Launch with: torchrun --standalone --nproc-per-node=2 ddp_torchrun.py")
    p.add_argument("--dataset", default=DEFAULT_DATASET, choices=sorted(DATASETS))
    p.add_argument("--model", default="convnet", choices=sorted(MODELS))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    p.add_argument("--snapshot", default=None,
                   help="snapshot file: loaded on start if present, written every --save-every")
    p.add_argument("--save-every", type=int, default=1, help="epochs between snapshots")
    p.add_argument("--limit-batches", type=int, default=None, help="batches per epoch at most")
    p.add_argument("--train-limit", type=int, default=None, help="use the first N train samples")
    p.add_argument("--test-limit", type=int, default=None, help="use the first N test samples")
    p.add_argument("--fail-at", default=None, metavar="EPOCH:BATCH",
                   help="fault injection: --fail-rank dies here, on the first attempt only "
                        "(TORCHELASTIC_RESTART_COUNT=0)")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--out", default=None, help="rank 0 saves the final weights here")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per rank")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    old = [a for a in argv if a.split("=")[0] in ("--local_rank", "--local-rank")]
    if old:
        raise LaunchError(
            f"{old[0].split('=')[0]} is the old torch.distributed.launch argument; this script "
            "reads LOCAL_RANK from the environment: launch it with torchrun (or "
            "`python -m torch.distributed.launch --use-env`)")
    return build_parser().parse_args(argv)


def validate(args: argparse.Namespace, env: TorchrunEnv) -> None:
    check_batch_size(args.batch_size)
    for name in ("epochs", "save_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("limit_batches", "train_limit", "test_limit", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.fail_at and not 0 <= args.fail_rank < env.world_size:
        raise ValueError(f"--fail-rank {args.fail_rank} is not a rank of this job "
                         f"(0..{env.world_size - 1})")
    if args.snapshot and not Path(args.snapshot).parent.is_dir():
        raise ckpt.CheckpointError(f"cannot write snapshot {args.snapshot}: folder "
                                   f"{Path(args.snapshot).parent} does not exist")


def run(args: argparse.Namespace, env: TorchrunEnv) -> dict:
    from dpt.data import load_tensors, prepare_distributed

    validate(args, env)
    fault = Fault.parse(args.fail_at, args.fail_rank)
    try:
        device = setup(env.rank, env.world_size, env.local_rank, args.device,
                       timeout_s=args.timeout, threads=args.threads)
    except DeviceError:
        raise
    except RuntimeError as exc:  # too few GPUs, no MASTER_PORT, rendezvous timed out
        raise LaunchError(str(exc).splitlines()[0]) from None
    try:
        say = print if env.rank == 0 else (lambda *a, **k: None)
        say(f"attempt {env.restart_count}: rank 0 of {env.world_size} on {device}, "
            f"{torch.get_num_threads()} thread(s) per rank, batch {args.batch_size} per rank = "
            f"{args.batch_size * env.world_size} per step", flush=True)
        prepare_distributed(args.dataset)
        x, y = load_tensors(args.dataset, train=True, limit=args.train_limit)
        loader = make_train_loader(x, y, args.batch_size, env.rank, env.world_size, args.seed)
        torch.manual_seed(args.seed)  # same initial weights everywhere (DDP broadcasts anyway)
        model = build_model(args.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        trainer = Trainer(model, loader, optimizer, device, save_every=args.save_every,
                          snapshot_path=args.snapshot, fault=fault,
                          restart_count=env.restart_count, progress=not args.no_progress,
                          sampler_seed=args.seed)
        if trainer.resumed is not None:
            exact = "" if trainer.resumed["exact"] else " (world size changed: not bit-exact)"
            say(f"resumed from snapshot {args.snapshot} at epoch {trainer.epochs_run}{exact}",
                flush=True)
        start = time.perf_counter()
        losses = trainer.train(args.epochs, args.limit_batches)
        seconds = time.perf_counter() - start
        for epoch, loss in zip(range(args.epochs - len(losses), args.epochs), losses):
            say(f"epoch {epoch}: mean train loss {loss:.4f}", flush=True)
        xt, yt = load_tensors(args.dataset, train=False, limit=args.test_limit)
        correct, total = evaluate(trainer.ddp, xt, yt, device)
        say(f"test accuracy: {correct / total:.4f} ({correct}/{total}) | training {seconds:.1f}s",
            flush=True)
        if args.out and env.rank == 0:
            ckpt.atomic_save(trainer.model.state_dict(), args.out)
        return {"accuracy": correct / total, "seconds": seconds, "losses": losses}
    finally:
        cleanup()


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        env = torchrun_env()
        run(args, env)
    except (ValueError, LaunchError, DataError, DeviceError, ckpt.CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
