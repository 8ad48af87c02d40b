"""Lesson 07: train ``LitClassifier`` on Fashion-MNIST with any Lightning 2.x strategy.

    .venv/bin/python exercises/07_lightning/lit_train.py                          # 1 CPU process
    .venv/bin/python exercises/07_lightning/lit_train.py --devices 2 --strategy ddp
    .venv/bin/python exercises/07_lightning/lit_train.py --devices 2 --strategy ddp_spawn
    .venv/bin/python exercises/07_lightning/lit_train.py --devices 2 --strategy ddp_notebook
    .venv/bin/python exercises/07_lightning/lit_train.py --accelerator gpu --devices 2 --strategy fsdp
    .venv/bin/python exercises/07_lightning/lit_train.py --accelerator gpu --strategy deepspeed  # needs deepspeed
    .venv/bin/python exercises/07_lightning/lit_train.py --precision bf16-mixed   # 16-mixed: GPU only

``ddp`` re-runs this very script once per extra device (``python lit_train.py <same args>``
with ``LOCAL_RANK`` set), so everything that must happen once sits under ``main()``.
On rank 0 the script prints one line ``RESULT {json}`` with the logged metrics.
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from lit_fashion import FashionDataModule, LitClassifier

from dpt.data import MNIST, DataError, add_dataset_argument
from dpt.device import mps_available
from dpt.dist import set_threads, threads_per_rank

CPU_STRATEGIES = ("auto", "ddp", "ddp_spawn", "ddp_notebook")
GPU_STRATEGIES = ("fsdp", "deepspeed")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


class UsageError(ValueError):
    """Bad arguments, or a choice this machine cannot run; one clear line."""


def check_choices(accelerator: str, strategy: str, precision: str, devices: int,
                  cuda_available: bool, deepspeed_installed: bool) -> None:
    """Refuse, with the reason, what Lightning would reject deep inside (or silently change)."""
    if devices < 1:
        raise UsageError(f"--devices must be at least 1, got {devices}")
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and cuda_available)
    if accelerator in ("gpu", "cuda") and not cuda_available:
        raise UsageError(f"--accelerator {accelerator} needs a CUDA GPU and this machine has "
                         "none; use --accelerator cpu")
    if strategy in GPU_STRATEGIES and not on_gpu:
        why = {"fsdp": "Lightning's FSDPStrategy only runs on CUDA devices (FSDP on CPU: see "
                       "lesson 08, torch's fully_shard with gloo)",
               "deepspeed": "DeepSpeed's engine and kernels need CUDA GPUs"}[strategy]
        raise UsageError(f"--strategy {strategy} is GPU-only: {why}. On CPU use --strategy ddp")
    if strategy == "deepspeed" and not deepspeed_installed:
        raise UsageError("--strategy deepspeed needs the deepspeed package "
                         "(pip install deepspeed), which is not installed")
    if precision == "16-mixed" and not on_gpu:
        raise UsageError("--precision 16-mixed (float16 with a GradScaler) is for GPUs; on CPU "
                         "Lightning would silently switch to bf16-mixed, so ask for that instead")


def resolve_accelerator(accelerator: str, devices: int, cuda_available: bool,
                        mps_available: bool) -> str:
    """The accelerator to hand Lightning. Apple's MPS serves one process only: no distributed
    backend supports it, so ``auto`` with several devices on a Mac means the CPU, and an
    explicit ``mps`` with several devices is refused."""
    if accelerator == "mps" and devices > 1:
        raise UsageError(f"--accelerator mps --devices {devices}: MPS trains in one process "
                         "only (no distributed backend supports it); use --devices 1, or "
                         "--accelerator cpu for several processes")
    if accelerator == "mps" and not mps_available:
        raise UsageError("--accelerator mps needs Apple's MPS, which this machine lacks")
    if accelerator == "auto" and devices > 1 and not cuda_available and mps_available:
        print(f"note: {devices} devices on a Mac run as {devices} CPU processes with gloo "
              "(MPS serves one process only)", file=sys.stderr)
        return "cpu"
    return accelerator


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu", "cuda", "mps", "auto"])
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--strategy", default="auto", choices=CPU_STRATEGIES + GPU_STRATEGIES)
    ap.add_argument("--precision", default="32-true", choices=PRECISIONS)
    add_dataset_argument(ap, default=MNIST)  # the Lightning MNIST notebook's dataset
    ap.add_argument("--batch-size", type=int, default=16, help="per device (default 16, as in the Lightning MNIST notebook)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--hidden-dim", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--train-limit", type=int, default=None, help="keep the first N train samples")
    ap.add_argument("--val-limit", type=int, default=None, help="keep the first N val samples")
    ap.add_argument("--limit-train-batches", type=float, default=None)
    ap.add_argument("--test", action="store_true", help="also report test-set accuracy")
    ap.add_argument("--ckpt", default=None, help="save a checkpoint here at the end")
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args(argv)


class ReportSampler(pl.Callback):
    """Each rank prints which sampler the Trainer put in its train loader (we made none)."""

    def on_train_start(self, trainer, pl_module):
        sampler = trainer.train_dataloader.sampler
        print(f"[rank {trainer.global_rank}] train sampler={type(sampler).__name__} "
              f"samples={len(sampler)}", flush=True)


class SaveAtEnd(pl.Callback):
    """Save a checkpoint when training ends, inside the ranks (so it works with spawn too)."""

    def __init__(self, path: str):
        self.path = str(Path(path).resolve())

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)  # every rank calls it, rank 0 writes


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        args.accelerator = resolve_accelerator(args.accelerator, args.devices,
                                               torch.cuda.is_available(), mps_available())
        check_choices(args.accelerator, args.strategy, args.precision, args.devices,
                      torch.cuda.is_available(), importlib.util.find_spec("deepspeed") is not None)
        if args.epochs < 1:
            raise UsageError(f"--epochs must be at least 1, got {args.epochs}")
        if args.accelerator == "cpu":
            set_threads(threads_per_rank(args.devices))
        pl.seed_everything(args.seed, verbose=False)
        dm = FashionDataModule(args.dataset, batch_size=args.batch_size,
                               train_limit=args.train_limit, val_limit=args.val_limit,
                               seed=args.seed)
        model = LitClassifier(hidden_dim=args.hidden_dim, learning_rate=args.lr)
        callbacks = [ReportSampler()] + ([SaveAtEnd(args.ckpt)] if args.ckpt else [])
        trainer = pl.Trainer(
            accelerator=args.accelerator, devices=args.devices, strategy=args.strategy,
            precision=args.precision, max_epochs=args.epochs,
            limit_train_batches=args.limit_train_batches, num_sanity_val_steps=0,
            logger=False, enable_checkpointing=False, enable_model_summary=False,
            enable_progress_bar=os.environ.get("TQDM_DISABLE", "") in ("", "0"),
            callbacks=callbacks)
        start = time.perf_counter()
        trainer.fit(model, datamodule=dm)
        seconds = time.perf_counter() - start
        result = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if args.test:
            result.update({k: float(v) for k, v in
                           trainer.test(model, datamodule=dm, verbose=False)[0].items()})
    except (UsageError, DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if trainer.is_global_zero:
        result.update(strategy=args.strategy, devices=args.devices, precision=args.precision,
                      fit_seconds=round(seconds, 2),
                      world_size=trainer.world_size)
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
