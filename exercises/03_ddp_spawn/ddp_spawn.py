# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 03: DistributedDataParallel launched with ``mp.spawn``, on one node or several.

Lesson 01 trained one model in one process. Here every device gets its own process, each
holding a full copy of the model and training on its own slice of the data. After every
backward pass DDP averages the gradients across processes, so every copy takes the same step
and the copies stay identical. Seed 003 starts the processes itself with ``mp.spawn``, one
per device, and works out each process's place in the whole job from three arguments:

- ``-n/--nodes``: how many machines take part;
- ``-g/--gpus``: how many processes to start on this machine (one per device);
- ``-nr/--nr``: this machine's number, 0 .. nodes-1.

Process ``local_rank`` on machine ``nr`` has global rank ``nr * gpus + local_rank``, and the
job has ``nodes * gpus`` processes. Every machine runs the same command with its own ``-nr``.

Run it (from the repository root)::

    # one machine, two processes (CPU: gloo; GPUs: NCCL, one GPU per process)
    python exercises/03_ddp_spawn/ddp_spawn.py -g 2 --epochs 1
    # two "nodes" on one machine: two terminals, same port, -nr 0 and -nr 1
    python exercises/03_ddp_spawn/ddp_spawn.py -n 2 -g 1 -nr 0 --master-port 29533
    python exercises/03_ddp_spawn/ddp_spawn.py -n 2 -g 1 -nr 1 --master-port 29533
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler
from tqdm.auto import tqdm

from dpt import checkpoint as ckpt
from dpt.data import (
    DATASETS,
    DEFAULT_DATASET,
    DataError,
    TensorLoader,
    check_batch_size,
    load_tensors,
    prepare,
    prepare_distributed,
)
from dpt.device import DEVICE_CHOICES, DeviceError, backend_for, pick_device
from dpt.dist import DEFAULT_TIMEOUT_S, find_free_port, set_threads, threads_per_rank
from dpt.models import MODELS, build_model


class LaunchError(ValueError):
    """The launch arguments do not describe a job that can run."""


# ------------------------------------------------------------------ the process group


def ddp_setup(rank: int, world_size: int, local_rank: int | None = None,
              device: str | torch.device = "auto", local_world_size: int | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = None) -> torch.device:
    """Join the process group as ``rank`` of ``world_size``; return this process's device.

    - the backend follows the device: NCCL for CUDA, gloo for the CPU (and MPS);
    - ``MASTER_ADDR``/``MASTER_PORT`` come from the environment. ``MASTER_ADDR`` defaults
      to this machine. A missing ``MASTER_PORT`` is only safe to invent when there is one
      process (a free port); otherwise the launcher must choose one port for everybody;
    - on CUDA, process ``local_rank`` uses GPU ``local_rank`` of its machine;
    - the CPU threads are split among the ``local_world_size`` processes of this machine;
    - collectives (and the first connection) give up after ``timeout_s`` seconds.
    """
    raise NotImplementedError("Task 03.1: pick the device (pin cuda:local_rank), split the threads, read MASTER_ADDR/MASTER_PORT (free port only if world_size == 1), init_process_group with backend_for(device) and the timeout; return the device")


def ddp_teardown() -> None:
    """Leave the process group. Safe to call when setup failed half-way, or twice."""
    raise NotImplementedError("Task 03.1: destroy the process group, but only if one is initialized")


@contextlib.contextmanager
def ddp_session(rank: int, world_size: int, **kwargs):
    """``with ddp_session(rank, world_size) as device:``: the teardown runs even on errors."""
    try:
        yield ddp_setup(rank, world_size, **kwargs)
    finally:
        ddp_teardown()


# ------------------------------------------------------------------ who is who (seed 003)


def global_rank(node_rank: int, procs_per_node: int, local_rank: int) -> int:
    """Seed 003's formula: the ranks of node 0 come first, then those of node 1, ..."""
    raise NotImplementedError("Task 03.2: node nr owns ranks nr*procs_per_node .. nr*procs_per_node + procs_per_node - 1")


def check_launch(nodes: int, procs_per_node: int, node_rank: int,
                 device: str = "auto") -> int:
    """Refuse a launch that cannot work, with one clear sentence; return the world size."""
    raise NotImplementedError("Task 03.2: nodes >= 1, procs_per_node >= 1, 0 <= node_rank < nodes (LaunchError); with device cuda, no more processes than GPUs (DeviceError); return nodes * procs_per_node")


def effective_batch_size(per_rank: int, world_size: int) -> int:
    """Samples that go into one optimizer step: each rank's batch, on every rank."""
    return per_rank * world_size


# ------------------------------------------------------------------ data and the loop


def make_train_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int,
                      world_size: int, seed: int = 0) -> TensorLoader:
    """A shuffled loader over this rank's share of ``(x, y)``: the shares never overlap."""
    raise NotImplementedError("Task 03.3: a DistributedSampler(range(len(x)), num_replicas=world_size, rank=rank, shuffle=True, seed=seed) inside a TensorLoader")


def train_step(model: nn.Module, batch, optimizer: torch.optim.Optimizer,
               device: torch.device) -> float:
    """Lesson 01's step. With DDP, backward() also averages the gradients across ranks."""
    inputs, targets = (t.to(device, non_blocking=True) for t in batch)
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


def train_epoch(model: nn.Module, loader, optimizer: torch.optim.Optimizer,
                device: torch.device, epoch: int, limit_batches: int | None = None,
                progress: bool = False) -> list[float]:
    """One epoch of this rank's shard; returns the loss of every step."""
    raise NotImplementedError("Task 03.3: call loader.set_epoch(epoch) first (a new shuffle each epoch), then train_step over the batches (at most limit_batches), collecting the losses")


def wrap_model(model: nn.Module, device: torch.device) -> DDP:
    """Move the model to this rank's device and wrap it in DDP (which syncs the weights)."""
    raise NotImplementedError("Task 03.4: DDP(model.to(device)), with device_ids=[device.index] on CUDA and None on the CPU")


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    epoch: int) -> Path | None:
    """Rank 0 writes model (without ``module.``), optimizer and epoch; others return None."""
    raise NotImplementedError("Task 03.4: only on rank 0: atomic_save {\"model\": model.module.state_dict(), \"optimizer\": ..., \"epoch\": ...}; every rank then meets at a barrier")


def load_checkpoint(path: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> int:
    """Every rank loads the same file (before the DDP wrap); returns the saved epoch."""
    state = ckpt.load(path)
    try:
        model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        return int(state["epoch"])
    except (KeyError, TypeError, RuntimeError, ValueError) as exc:
        raise ckpt.CheckpointError(f"checkpoint {path} does not fit this model/optimizer "
                                   f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
                                   ) from exc


@torch.no_grad()
def evaluate_distributed(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         device: torch.device, batch_size: int = 1000) -> tuple[int, int]:
    """Correct/total over the WHOLE of ``(x, y)``, each rank counting its own shard.

    DistributedSampler pads the index list (repeating its first entries) until it divides
    evenly among the ranks, so some samples would be counted twice. Positions past
    ``len(x)`` in the padded list are those repeats: drop them, count, and all-reduce.
    """
    raise NotImplementedError("Task 03.5: shard with DistributedSampler(shuffle=False), drop the padded repeats (this rank's positions rank, rank+ws, ... that are >= len(x)), count correct/total in eval mode (restore the mode), all_reduce both counts (SUM) and return them as ints")


# ------------------------------------------------------------------ one rank's whole job


def run_training(rank: int, world_size: int, args: argparse.Namespace,
                 local_rank: int | None = None) -> dict:
    """Everything one rank does, from joining the group to leaving it.

    ``mp.spawn`` (below) calls this once per process; the tests and the notebook call it
    through ``dpt.testing.run_distributed``. Returns this rank's results.
    """
    local_rank = rank if local_rank is None else local_rank
    local_world = getattr(args, "gpus", None) or world_size
    with ddp_session(rank, world_size, local_rank=local_rank, device=args.device,
                     local_world_size=local_world, timeout_s=args.timeout,
                     threads=getattr(args, "threads", None)) as device:
        main_process = rank == 0
        say = print if main_process else (lambda *a, **k: None)
        prepare_distributed(args.dataset, local_rank=local_rank)
        x_train, y_train = load_tensors(args.dataset, train=True, limit=args.train_limit)
        x_test, y_test = load_tensors(args.dataset, train=False, limit=args.test_limit)

        torch.manual_seed(args.seed)  # same seed everywhere; DDP also broadcasts rank 0's
        model = build_model(args.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        start_epoch = 0
        if args.resume:
            start_epoch = load_checkpoint(args.resume, model, optimizer)
            say(f"resumed from {args.resume} at epoch {start_epoch}")
        ddp_model = wrap_model(model, device)
        # The optimizer holds the same Parameter objects DDP wraps; no need to rebuild it.
        loader = make_train_loader(x_train, y_train, args.batch_size, rank, world_size,
                                   seed=args.seed)
        eff = effective_batch_size(args.batch_size, world_size)
        say(f"world size {world_size} ({args.nodes} node(s) x {args.gpus} process(es)), "
            f"backend {dist.get_backend()}, device {device}, "
            f"{torch.get_num_threads()} thread(s) per rank")
        say(f"effective batch size: {args.batch_size} per rank x {world_size} ranks = {eff} "
            f"samples per optimizer step (DDP averages the {world_size} gradients, so each "
            f"step is like one process with batch {eff}); each rank sees "
            f"{len(loader.sampler)} of {len(x_train)} samples per epoch")

        history: list[float] = []
        seen: list[list[int]] = []
        start = time.perf_counter()
        for epoch in range(start_epoch, args.epochs):
            if args.fail_rank == rank and epoch == start_epoch:
                raise RuntimeError(f"rank {rank} fails on purpose (--fail-rank)")
            losses = train_epoch(ddp_model, loader, optimizer, device, epoch,
                                 args.limit_batches, progress=main_process and args.progress)
            seen.append(list(iter(loader.sampler))[:8])
            history.extend(losses)
            say(f"epoch {epoch}: mean loss {sum(losses) / max(1, len(losses)):.4f} "
                f"(rank 0, {len(losses)} steps)")
            if args.checkpoint:
                save_checkpoint(args.checkpoint, ddp_model, optimizer, epoch + 1)
        seconds = time.perf_counter() - start
        correct, total = evaluate_distributed(ddp_model, x_test, y_test, device)
        say(f"test accuracy: {correct / total:.4f} ({correct}/{total}, counted on "
            f"{world_size} ranks) | train {seconds:.1f}s")
        return {"rank": rank, "world_size": world_size, "accuracy": correct / total,
                "correct": correct, "total": total, "seconds": seconds, "history": history,
                "first_indices": seen,
                "state": {k: v.detach().cpu().clone()
                          for k, v in ddp_model.module.state_dict().items()}}


def _spawned(local_rank: int, args: argparse.Namespace) -> None:
    """What ``mp.spawn`` runs in each new process: work out the rank, train, report."""
    rank = global_rank(args.nr, args.gpus, local_rank)
    world_size = args.nodes * args.gpus
    try:
        run_training(rank, world_size, args, local_rank=local_rank)
    except dist.DistNetworkError as exc:
        print(f"error: rank {rank} lost or never reached the rendezvous at "
              f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within "
              f"{args.timeout:g}s ({str(exc).strip().splitlines()[0][:100]})",
              file=sys.stderr, flush=True)
        sys.exit(2)
    except (LaunchError, DataError, DeviceError, ckpt.CheckpointError,
            dist.DistError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"error: rank {rank}: {type(exc).__name__}: {first}", file=sys.stderr,
              flush=True)
        sys.exit(2)  # mp.spawn sees the exit code, stops the other ranks and raises


# ---------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Lesson 03: DDP started with mp.spawn.")
    p.add_argument("-n", "--nodes", type=int, default=1, help="machines in the job")
    p.add_argument("-g", "--gpus", type=int, default=2,
                   help="processes to start on this machine (one per GPU, or CPU ranks)")
    p.add_argument("-nr", "--nr", type=int, default=0, help="this machine's rank, 0..nodes-1")
    p.add_argument("--master-addr", default=None,
                   help="address of node 0 (default: $MASTER_ADDR, else 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="port on node 0 (default: $MASTER_PORT; on one node, a free port)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds to wait for the other processes (connect, collectives)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: this machine's cores / -g; "
                        "use 1 when several 'nodes' share one machine)")
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    p.add_argument("--dataset", default=DEFAULT_DATASET, choices=sorted(DATASETS))
    p.add_argument("--model", default="convnet", choices=sorted(MODELS))
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--limit-batches", type=int, default=None)
    p.add_argument("--train-limit", type=int, default=None, help="use the first N samples")
    p.add_argument("--test-limit", type=int, default=None)
    p.add_argument("--checkpoint", default=None, help="rank 0 saves here after each epoch")
    p.add_argument("--resume", default=None, help="every rank starts from this checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--fail-rank", type=int, default=None,
                   help="demo: this global rank raises at the start of training")
    return p


def resolve_master(args: argparse.Namespace) -> tuple[str, int]:
    """Where rank 0 listens. One node may pick a free port; several must agree on one."""
    addr = args.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = args.master_port or os.environ.get("MASTER_PORT")
    if port is None:
        if args.nodes > 1:
            raise LaunchError("with --nodes > 1, give every node the same --master-port "
                              "(or MASTER_PORT), and --master-addr of node 0")
        port = find_free_port()
    port = int(port)
    if not 0 < port < 65536:
        raise LaunchError(f"--master-port must be 1..65535, got {port}")
    return addr, port


def validate(args: argparse.Namespace) -> int:
    world_size = check_launch(args.nodes, args.gpus, args.nr, args.device)
    check_batch_size(args.batch_size)
    if args.epochs < 1:
        raise LaunchError(f"--epochs must be at least 1, got {args.epochs}")
    for name in ("limit_batches", "train_limit", "test_limit", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise LaunchError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.timeout <= 0:
        raise LaunchError(f"--timeout must be positive, got {args.timeout}")
    if args.checkpoint and not Path(args.checkpoint).parent.is_dir():
        raise ckpt.CheckpointError(f"cannot save checkpoint to {args.checkpoint}: folder "
                                   f"{Path(args.checkpoint).parent} does not exist")
    if args.resume:
        ckpt.load(args.resume)  # a missing or corrupted file fails here, before any spawn
    return world_size


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    args = build_parser().parse_args(argv)
    try:
        world_size = validate(args)
        addr, port = resolve_master(args)
        prepare(args.dataset, quiet=True)
    except (LaunchError, ValueError, DataError, DeviceError, ckpt.CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    # c10d's C++ retry warnings (with stack frames) would bury our one-line errors.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    print(f"node {args.nr} of {args.nodes}: starting {args.gpus} process(es), global ranks "
          f"{global_rank(args.nr, args.gpus, 0)}..{global_rank(args.nr, args.gpus, args.gpus - 1)}"
          f" of {world_size}; rendezvous at {addr}:{port}", flush=True)
    try:
        # join=True: wait for all; if one process fails, the others are terminated.
        mp.spawn(_spawned, args=(args,), nprocs=args.gpus, join=True)
    except mp.ProcessExitedException as exc:
        if exc.exit_code == 2:  # the rank already printed its one-line error
            return 2
        print(f"error: process {exc.error_index} died with exit code {exc.exit_code}; "
              "the other processes were stopped", file=sys.stderr)
        return 1
    except mp.ProcessRaisedException as exc:
        last = str(exc).strip().splitlines()[-1]
        print(f"error: process {exc.error_index} failed: {last}; the other processes were "
              "stopped", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
