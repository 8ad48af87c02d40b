"""Lesson 08: FSDP2 (``torch.distributed.fsdp.fully_shard``) on the lesson's ConvNet.

``fully_shard`` replaces every parameter of a module by a DTensor sharded on dim 0 over the
ranks: each rank keeps 1/N of every parameter, its gradient and (so) its Adam state. It
is applied per block first, then to the root: each block becomes one unit that is
all-gathered just before its forward (and backward) and freed right after, and whose
gradients are reduce-scattered as soon as its backward is done.

    .venv/bin/python solutions/08_sharding/fsdp2_train.py                      # 2 CPU ranks, gloo
    .venv/bin/python solutions/08_sharding/fsdp2_train.py --mode ddp           # the same with DDP
    .venv/bin/python solutions/08_sharding/fsdp2_train.py --save fsdp_full.pt  # full state dict, rank 0
    .venv/bin/python solutions/08_sharding/fsdp2_train.py --lightning          # Lightning's one-liner

Ranks are started by ``dpt.ranks.run_distributed`` (free port, fail fast, timeout): the
worker is a function of this file, so the notebook can start it too.
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from zero_accounting import measure_bytes

from dpt.dist import device_mesh, gathers_for_shared_gpu, rank_device
from dpt.models import build_model


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The units to shard one by one: the root's direct children that hold parameters."""
    return [child for child in model.children()
            if any(True for _ in child.parameters())]


def shard_model(model: nn.Module, blocks: list[nn.Module] | None = None, **fsdp_kwargs) -> nn.Module:
    """Apply FSDP2 to each block, then to the root; returns the (same, now sharded) model."""
    from torch.distributed.fsdp import fully_shard

    blocks = default_blocks(model) if blocks is None else blocks
    # Without a mesh, fully_shard takes the machine's accelerator even for gloo ranks; this
    # mesh is on the device the rank computes on (the CPU under gloo, its GPU under NCCL).
    fsdp_kwargs.setdefault("mesh", device_mesh())
    # BEGIN SOLUTION 08.4: fully_shard each block (its own all-gather unit), then the root
    for block in blocks:
        fully_shard(block, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    # END SOLUTION
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict as plain CPU tensors on rank 0 (an empty dict elsewhere).

    Every rank must call it: gathering the shards is a collective.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # BEGIN SOLUTION 08.5: get_model_state_dict with full_state_dict=True and cpu_offload=True
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
    # END SOLUTION


def shard_report(model: nn.Module) -> list[dict]:
    """Per parameter: its full shape, this rank's local shape, and the placement."""
    rows = []
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        rows.append({"name": name, "type": type(p).__name__, "full": tuple(p.shape),
                     "local": tuple(local.shape), "numel": p.numel(), "local_numel": local.numel(),
                     "placements": str(getattr(p, "placements", "replicated"))})
    return rows


def synthetic_batch(rank: int, step: int, batch_size: int, seed: int = 0):
    """A fixed MNIST-shaped batch, different per rank and per step."""
    g = torch.Generator().manual_seed(seed * 100003 + rank * 1009 + step)
    return torch.randn(batch_size, 1, 28, 28, generator=g), torch.randint(0, 10, (batch_size,),
                                                                          generator=g)


def fashion_batches(rank: int, world_size: int, batch_size: int, seed: int = 0):
    """Fashion-MNIST batches of this rank's DistributedSampler shard, epoch after epoch."""
    from torch.utils.data.distributed import DistributedSampler

    from dpt.data import TensorLoader, load_tensors, prepare_distributed

    prepare_distributed("fashion-mnist")
    x, y = load_tensors("fashion-mnist", train=True)
    sampler = DistributedSampler(range(len(y)), num_replicas=world_size, rank=rank, seed=seed)
    loader = TensorLoader(x, y, batch_size=batch_size, sampler=sampler)
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def wrap(model: nn.Module, mode: str, device: torch.device) -> nn.Module:
    """Shard ``model`` (already on ``device``) with FSDP2, or replicate it with DDP."""
    if mode == "fsdp2":
        return shard_model(model)
    if mode == "ddp":
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return model
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    raise ValueError(f"unknown mode {mode!r}; choose fsdp2 or ddp")


def train_worker(rank: int, world_size: int, mode: str = "fsdp2", steps: int = 5,
                 batch_size: int = 32, lr: float = 1e-3, weight_decay: float = 0.0,
                 data: str = "synthetic", model_name: str = "convnet", seed: int = 0,
                 save: str | None = None, progress: bool = False) -> dict:
    """Train ``steps`` Adam steps on this rank; return losses, shards, memory, full state dict.

    Run on every rank with the process group initialized (``run_distributed``).
    """
    device = rank_device()  # the CPU under gloo, this rank's GPU under NCCL
    torch.manual_seed(seed)
    model = wrap(build_model(model_name).to(device), mode, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    batches = (fashion_batches(rank, world_size, batch_size, seed) if data == "fashion-mnist"
               else (synthetic_batch(rank, s, batch_size, seed) for s in range(steps)))
    losses = []
    bar = range(steps)
    if progress and rank == 0:
        from tqdm import tqdm
        bar = tqdm(bar, desc=f"{mode} x{world_size}")
    for _ in bar:
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    mean = torch.stack(losses)
    if dist.is_initialized():  # the loss averaged over ranks, as one would log it
        dist.all_reduce(mean)
        mean /= world_size
    memory = measure_bytes(model, optimizer)
    if mode == "fsdp2":
        with gathers_for_shared_gpu():  # gloo's gathers of CUDA tensors (ranks sharing a GPU)
            state = full_state_dict(model)
    else:
        state = (
            {k: v.detach().cpu().clone() for k, v in getattr(model, "module", model).state_dict().items()}
            if rank == 0 else {})
    if save and rank == 0:
        from dpt.checkpoint import atomic_save
        atomic_save(state, save)
    return {"rank": rank, "mode": mode, "losses": mean.tolist(), "shards": shard_report(model),
            "memory": memory, "state_dict": state}


def lightning_fsdp_trainer(accelerator: str = "auto", devices: int = 2, **trainer_kwargs):
    """Lightning's FSDP is one argument: ``strategy="fsdp"``. It needs a CUDA GPU per device.

    On a machine without them, or with fewer than ``devices``, this raises a RuntimeError
    that says so, and what to use.
    """
    import pytorch_lightning as pl

    if not torch.cuda.is_available():
        raise RuntimeError(
            "Lightning's strategy='fsdp' only runs on CUDA GPUs (its FSDPStrategy refuses "
            "accelerator='cpu', see lesson 07); this machine has none. On CPU, shard with "
            "torch's fully_shard over gloo, as shard_model() in this lesson does.")
    gpus = torch.cuda.device_count()
    if isinstance(devices, int) and devices > gpus:
        raise RuntimeError(
            f"Lightning's strategy='fsdp' with devices={devices} needs {devices} GPUs, one per "
            f"process, and this machine has {gpus}: use devices={gpus} (--nproc {gpus}), or "
            "torch's fully_shard over gloo, as shard_model() in this lesson does.")
    return pl.Trainer(accelerator=accelerator, devices=devices, strategy="fsdp",
                      **trainer_kwargs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks: one per GPU with NCCL when there are enough GPUs, else CPU processes "
                         "with gloo")
    ap.add_argument("--mode", choices=["fsdp2", "ddp"], default="fsdp2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--data", choices=["fashion-mnist", "synthetic"], default="fashion-mnist")
    ap.add_argument("--save", default=None, help="write rank 0's full state dict here")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--lightning", action="store_true",
                    help="show Lightning's strategy='fsdp' (GPU only)")
    args = ap.parse_args(argv)
    try:
        if args.lightning:
            trainer = lightning_fsdp_trainer(devices=args.nproc)
            print(f"Lightning trainer with {type(trainer.strategy).__name__}")
            return 0
        if args.nproc < 1 or args.steps < 1 or args.batch_size < 1:
            raise ValueError("--nproc, --steps and --batch-size must be at least 1")
        if args.data == "synthetic" and args.steps > 10_000:
            raise ValueError("--steps too large for synthetic data")
        from dpt.dist import threads_per_rank
        from dpt.ranks import run_distributed

        results = run_distributed(
            train_worker, world_size=args.nproc, backend="auto", timeout=args.timeout,
            threads=threads_per_rank(args.nproc), echo=False,
            kwargs={"mode": args.mode, "steps": args.steps, "batch_size": args.batch_size,
                    "lr": args.lr, "data": args.data, "save": args.save, "progress": True})
    except (ValueError, RuntimeError, OSError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    r0 = results[0]
    losses = r0["losses"]
    k = max(1, len(losses) // 10)
    print(f"{args.mode} on {args.nproc} rank(s): loss {sum(losses[:k]) / k:.3f} -> "
          f"{sum(losses[-k:]) / k:.3f} (mean of first/last {k} steps)")
    for r in results:
        mem = r["memory"]
        print(f"rank {r['rank']}: params {mem['params'] / 1024:.1f} KiB, grads "
              f"{mem['grads'] / 1024:.1f} KiB, Adam state {mem['optimizer'] / 1024:.1f} KiB")
    if args.save:
        print(f"full state dict ({len(r0['state_dict'])} tensors) saved by rank 0 to {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
