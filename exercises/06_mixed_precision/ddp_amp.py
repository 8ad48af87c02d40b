# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 06: DDP with ``--precision {32,bf16,fp16}``, and where the casts happen.

Lesson 03's DDP script plus one flag. Nothing about DDP changes: the parameters stay fp32,
autocast casts *copies* of them to bf16/fp16 for each matmul/conv in the forward, autograd
casts the gradients back to the parameter's dtype (fp32) on the way out, and DDP all-reduces
those fp32 gradients. A communication hook records the dtype of every bucket it all-reduces,
so you can see it.

    .venv/bin/python exercises/06_mixed_precision/ddp_amp.py --precision bf16 --nprocs 2 --steps 50       # spawns 2 CPU ranks
    .venv/bin/torchrun --standalone --nproc-per-node 2 exercises/06_mixed_precision/ddp_amp.py --precision 32 --steps 50
    .venv/bin/python exercises/06_mixed_precision/ddp_amp.py --precision fp16 --device cuda --nprocs 2      # GPUs: fp16 + GradScaler

(fp16 on CPU is refused with a clear error: it is the CUDA recipe.)
"""

from __future__ import annotations

import importlib.util
import sys

if importlib.util.find_spec("torch") is None:  # not the course's venv: say so in one line
    sys.exit(f"error: {sys.executable} has no torch; use the course's venv: .venv/bin/python "
             f"{sys.argv[0]} (or `source .venv/bin/activate` first; `make setup` creates it)")

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from amp_train import PrecisionError, amp_train_step, choose_precision, make_scaler
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from dpt.data import DataError, TensorLoader, check_batch_size, load_tensors, prepare_distributed
from dpt.device import DEVICE_CHOICES, DeviceError, pick_device
from dpt.dist import cleanup, find_free_port, rank0_print, rank_device, setup
from dpt.models import build_model


class DtypeRecorder:
    """State for :func:`recording_allreduce_hook`: the dtype of each bucket all-reduced."""

    def __init__(self, group=None):
        self.group = group
        self.dtypes: list[torch.dtype] = []


def recording_allreduce_hook(state, bucket):
    """A DDP comm hook: note the bucket's dtype, then do exactly what DDP does by default.

    (No type annotations: DDP checks them, and ``from __future__ import annotations`` would
    turn them into strings it rejects.)
    """
    raise NotImplementedError("Task 06.3: record the bucket's dtype, then do DDP's default all-reduce")


def cast_map(model: nn.Module, x: torch.Tensor, device: torch.device,
             dtype: torch.dtype | None) -> list[dict]:
    """Run one forward under autocast and report, per leaf module, the dtypes it saw.

    Rows: module name, type, parameter dtype, input dtype, output dtype. Under bf16 autocast
    the parameters stay fp32 while conv/linear outputs are bf16: the cast happens inside
    the op, on a copy of the weight.
    """
    rows, handles = [], []
    for name, mod in model.named_modules():
        if list(mod.children()):
            continue

        def hook(m, inp, out, name=name):
            p = next(m.parameters(), None)
            rows.append({"module": name, "type": type(m).__name__,
                         "param": str(p.dtype).replace("torch.", "") if p is not None else "-",
                         "input": str(inp[0].dtype).replace("torch.", ""),
                         "output": str(out.dtype).replace("torch.", "")})

        handles.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            model(x.to(device))
    finally:
        for h in handles:
            h.remove()
    return rows


def synthetic_data(n: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def train_ddp(rank: int, world_size: int, precision: str = "bf16", steps: int = 20,
              batch_size: int = 32, data: str = "synthetic", lr: float = 0.02,
              device: str = "auto", seed: int = 0, clip: float | None = 1.0,
              force_scaler: bool = False) -> dict:
    """One rank of DDP training with autocast. Joins the process group unless already in one.

    ``device`` is used when this function starts the group itself (``auto``: this rank's GPU
    under NCCL, else the CPU with gloo); inside an existing group, the group's backend decides
    (``dpt.dist.rank_device``), so a gloo group never gets CUDA tensors, nor NCCL CPU ones.
    Returns what the tests and the notebook look at: losses, the dtypes DDP all-reduced,
    the parameters' dtypes, a flat copy of the final parameters, and the scaler's scale.
    """
    own_group = not dist.is_initialized()
    if own_group:  # this machine's GPU number is the local rank, not the global one
        dev = setup(rank, world_size, int(os.environ.get("LOCAL_RANK", rank)), device)
    else:  # already in a group (the tests, the notebook): its backend decides the device
        dev = rank_device()
    try:
        dtype, needs_scaler = choose_precision(dev, precision)
        torch.manual_seed(seed)  # same initial weights everywhere (DDP also broadcasts them)
        model = build_model("convnet").to(dev)
        ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        recorder = DtypeRecorder()
        ddp.register_comm_hook(recorder, recording_allreduce_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        scaler = make_scaler(dev, needs_scaler or force_scaler)
        x, y = synthetic_data(seed=seed) if data == "synthetic" else load_tensors(data, True)
        sampler = DistributedSampler(range(len(x)), num_replicas=world_size, rank=rank,
                                     shuffle=True, seed=seed)
        loader = TensorLoader(x, y, batch_size=batch_size, sampler=sampler)
        casts = cast_map(model, x[:2], dev, dtype) if rank == 0 else []
        losses, skipped, step, epoch = [], 0, 0, 0
        while step < steps:
            loader.set_epoch(epoch)
            for batch in loader:
                if step >= steps:
                    break
                out = amp_train_step(ddp, batch, optimizer, dev, dtype, scaler, max_norm=clip)
                losses.append(out["loss"])
                skipped += out["skipped"]
                step += 1
            epoch += 1
        flat = torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])
        return {"rank": rank, "losses": losses, "skipped": skipped,
                "allreduce_dtypes": sorted({str(d) for d in recorder.dtypes}),
                "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()
                                       if p.grad is not None}),
                "params": flat, "casts": casts,
                "scale": scaler.get_scale() if scaler else None}
    finally:
        if own_group:
            cleanup()


def _spawned(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _report(train_ddp(rank, args.nprocs, args.precision, args.steps, args.batch_size,
                      args.data, args.lr, args.device, args.seed))


def _report(result: dict) -> None:
    if result["rank"] != 0:
        return
    for row in result["casts"]:
        print(f"  {row['module']:10} {row['type']:12} param {row['param']:8} "
              f"in {row['input']:9} out {row['output']}")
    losses = result["losses"]
    tail = losses[-10:]
    print(f"all-reduced gradient dtypes: {result['allreduce_dtypes']} | parameters: "
          f"{result['param_dtypes']} | grads: {result['grad_dtypes']}")
    print(f"{len(losses)} steps, last-10 mean loss {sum(tail) / max(1, len(tail)):.4f}, "
          f"skipped {result['skipped']}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precision", default="bf16", choices=("32", "bf16", "fp16", "auto"))
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    p.add_argument("--nprocs", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--data", default="synthetic", help="synthetic or fashion-mnist")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_batch_size(args.batch_size)
        if args.nprocs < 1:
            raise ValueError(f"--nprocs must be >= 1, got {args.nprocs}")
        dev = pick_device(args.device, distributed=True)
        choose_precision(dev, args.precision)  # fail here, once, not in every rank
        if dev.type == "cuda" and args.nprocs > torch.cuda.device_count():
            raise DeviceError(f"--nprocs {args.nprocs} needs {args.nprocs} GPUs; this machine "
                              f"has {torch.cuda.device_count()}")
        if args.data != "synthetic":
            prepare_distributed(args.data)
        if "RANK" in os.environ:  # torchrun
            args.nprocs = int(os.environ["WORLD_SIZE"])
            rank = int(os.environ["RANK"])
            _report(train_ddp(rank, args.nprocs, args.precision, args.steps, args.batch_size,
                              args.data, args.lr, args.device, args.seed))
        else:
            rank0_print(f"spawning {args.nprocs} ranks, precision {args.precision}")
            mp.spawn(_spawned, args=(args, find_free_port()), nprocs=args.nprocs)
    except (ValueError, DeviceError, DataError, PrecisionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
