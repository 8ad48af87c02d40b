# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 06: mixed-precision training with ``torch.amp`` on one device.

One step, in the order it must happen: the forward and the loss run under autocast, and
nothing else does; backward runs on the *scaled* loss; the gradients are unscaled before they
are clipped, so that clipping sees their true norm; the optimizer steps through the scaler,
which skips the step when a gradient is inf or NaN; and the scaler updates its scale (down
after an overflow, up after enough good steps). ``HINTS.md`` has more, step by step.

fp16 (CUDA) needs the scaler; bf16 has fp32's exponent range and does not. The same step
function serves both: ``scaler=None`` means no scaling.

    .venv/bin/python exercises/06_mixed_precision/amp_train.py --precision auto --steps 200
    .venv/bin/python exercises/06_mixed_precision/amp_train.py --precision bf16 --device cpu --steps 100 --checkpoint /tmp/amp.pt
    .venv/bin/python exercises/06_mixed_precision/amp_train.py --precision bf16 --steps 200 --checkpoint /tmp/amp.pt --resume
    .venv/bin/python exercises/06_mixed_precision/amp_train.py --precision 32 --force-scaler --inject-inf 5 --steps 20   # watch a skip
"""

from __future__ import annotations

import importlib.util
import sys

if importlib.util.find_spec("torch") is None:  # not the course's venv: say so in one line
    sys.exit(f"error: {sys.executable} has no torch; use the course's venv: .venv/bin/python "
             f"{sys.argv[0]} (or `source .venv/bin/activate` first; `make setup` creates it)")

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dpt.checkpoint import CheckpointError, atomic_save, load
from dpt.data import DataError, check_batch_size, make_loader, prepare
from dpt.device import DEVICE_CHOICES, DeviceError, pick_device
from dpt.models import build_model

PRECISIONS = ("auto", "32", "bf16", "fp16")
DTYPES = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(ValueError):
    """A precision this device cannot run."""


def cpu_flags() -> list[str]:
    """The CPU feature flags that matter for low precision (Linux /proc/cpuinfo; [] elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
            return sorted(f for f in flags if "bf16" in f or "fp16" in f or f.startswith("amx")
                          or f in ("avx2", "avx512f", "fma"))
    return []


def cpu_has_fast_bf16() -> bool:
    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cuda_has_native_bf16(device: torch.device | None = None) -> bool:
    """bf16 in hardware: compute capability 8.0 (Ampere) or newer.

    ``torch.cuda.is_bf16_supported()`` also answers yes on older GPUs (a T4, a V100), where
    bf16 is emulated and slower than fp16; only ``including_emulation=False`` excludes them.
    Asking about ``device`` itself also avoids touching another rank's GPU.
    """
    return torch.cuda.get_device_properties(device).major >= 8


def choose_precision(device: torch.device, requested: str = "auto") -> tuple[torch.dtype | None, bool]:
    """Return ``(autocast dtype or None for fp32, whether a GradScaler is needed)``.

    ``auto``: on CUDA, bf16 where the GPU supports it (Ampere and newer) else fp16 with a
    scaler; on a CPU, bf16 only when it has bf16 instructions (AMX or AVX512-BF16), since
    without them bf16 is emulated and slower than fp32; elsewhere fp32.
    """
    if requested not in PRECISIONS:
        raise PrecisionError(f"unknown precision {requested!r}; choose one of {', '.join(PRECISIONS)}")
    if requested == "auto":
        if device.type == "cuda":
            requested = "bf16" if cuda_has_native_bf16(device) else "fp16"
        elif device.type == "cpu" and cpu_has_fast_bf16():
            requested = "bf16"
        else:
            requested = "32"
    if requested == "fp16" and device.type != "cuda":
        raise PrecisionError(f"--precision fp16 is the CUDA recipe (fp16 autocast + GradScaler); "
                             f"on {device.type} use bf16 (no scaler needed) or 32")
    if requested == "bf16" and device.type == "mps":
        raise PrecisionError("bf16 autocast is not supported on MPS here; use 32")
    return DTYPES[requested], requested == "fp16"


def make_scaler(device: torch.device, enabled: bool, init_scale: float = 2.0 ** 16,
                growth_interval: int = 2000) -> torch.amp.GradScaler | None:
    """A GradScaler for ``device`` (torch 2.x has them for CUDA and CPU), or None."""
    if not enabled:
        return None
    return torch.amp.GradScaler(device.type, init_scale=init_scale,
                                growth_interval=growth_interval)


def amp_train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                   optimizer: torch.optim.Optimizer, device: torch.device,
                   dtype: torch.dtype | None = None,
                   scaler: torch.amp.GradScaler | None = None,
                   max_norm: float | None = None, loss_fn=F.cross_entropy) -> dict:
    """One mixed-precision step. Returns ``{"loss", "scale", "skipped", "grad_norm"}``.

    ``dtype=None`` runs in fp32 (autocast disabled). ``scaler=None`` means no loss scaling.
    ``scale`` is the scale used for this step (1.0 without a scaler); ``skipped`` is True when
    the scaler found inf/NaN gradients and did not call ``optimizer.step()``; ``grad_norm``
    is the true (unscaled) gradient norm when ``max_norm`` is given, else None.
    """
    x, y = (t.to(device, non_blocking=True) for t in batch)
    raise NotImplementedError("Task 06.1: forward and loss under autocast; backward, clipping and step through the scaler when there is one")
    return {"loss": loss.item(), "scale": scale, "skipped": skipped, "grad_norm": grad_norm}


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler | None, step: int, precision: str) -> Path:
    """Model, optimizer, the scaler's state (scale, growth tracker), step and precision."""
    raise NotImplementedError("Task 06.2: save model, optimizer, the scaler's state, step and precision in one checkpoint")


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler | None) -> int:
    """Restore everything :func:`save_checkpoint` wrote; return the step to resume from.

    A checkpoint without scaler state cannot resume an fp16 run faithfully (the scale would
    restart at 65536 and skip steps while it backs off again): that is a CheckpointError.
    """
    raise NotImplementedError("Task 06.2: restore what save_checkpoint wrote; a scaler with no saved state is a CheckpointError")


def inject_inf(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of the batch whose first pixel is inf: the loss and every gradient become inf/NaN."""
    x, y = batch
    x = x.clone()
    x.view(-1)[0] = float("inf")
    return x, y


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="auto picks from the machine: cuda bf16/fp16, cpu bf16 if it has bf16 "
                        "instructions, else 32")
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    p.add_argument("--model", default="convnet")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="max grad norm (0: no clipping)")
    p.add_argument("--force-scaler", action="store_true",
                   help="use a GradScaler even without fp16 (to watch it work on a CPU)")
    p.add_argument("--init-scale", type=float, default=2.0 ** 16)
    p.add_argument("--growth-interval", type=int, default=2000)
    p.add_argument("--inject-inf", type=int, action="append", default=[], metavar="STEP",
                   help="poison the batch of this step with an inf (repeatable)")
    p.add_argument("--checkpoint", default=None, help="save here at the end")
    p.add_argument("--resume", action="store_true", help="resume from --checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    return p


def run(args: argparse.Namespace) -> dict:
    check_batch_size(args.batch_size)
    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    if args.resume and not args.checkpoint:
        raise ValueError("--resume needs --checkpoint PATH")
    if args.checkpoint and not Path(args.checkpoint).resolve().parent.is_dir():
        raise ValueError(f"--checkpoint folder {Path(args.checkpoint).parent} does not exist")
    device = pick_device(args.device)
    dtype, needs_scaler = choose_precision(device, args.precision)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_model(args.model).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = make_scaler(device, needs_scaler or args.force_scaler, args.init_scale,
                         args.growth_interval)
    start = load_checkpoint(args.checkpoint, model, optimizer, scaler) if args.resume else 0
    name = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    state = f"on, scale {scaler.get_scale():g}" if scaler else "off"
    print(f"device {device} | autocast {name} | scaler {state} | from step {start}", flush=True)
    prepare(args.dataset, quiet=True)
    loader = make_loader(args.dataset, train=True, batch_size=args.batch_size, seed=args.seed)
    history, skipped = [], []
    step, t0 = start, time.perf_counter()
    while step < start + args.steps:
        loader.set_epoch(step)
        for batch in loader:
            if step >= start + args.steps:
                break
            if step in args.inject_inf:
                batch = inject_inf(batch)
            out = amp_train_step(model, batch, optimizer, device, dtype, scaler,
                                 max_norm=args.clip or None)
            history.append(out["loss"])
            if out["skipped"]:
                skipped.append(step)
                print(f"step {step}: inf/NaN gradients, step skipped, scale "
                      f"{out['scale']:g} -> {scaler.get_scale():g}", flush=True)
            step += 1
    seconds = time.perf_counter() - t0
    finite = [v for v in history if v == v and abs(v) != float("inf")]
    tail = finite[-20:]
    print(f"{len(history)} steps in {seconds:.1f}s | last-20 mean loss "
          f"{sum(tail) / max(1, len(tail)):.4f} | skipped {skipped}", flush=True)
    if args.checkpoint:
        save_checkpoint(args.checkpoint, model, optimizer, scaler, step, args.precision)
        tail = f", scale {scaler.get_scale():g}" if scaler else ""
        print(f"saved {args.checkpoint} (step {step}{tail})", flush=True)
    return {"history": history, "skipped": skipped, "step": step,
            "scale": scaler.get_scale() if scaler else None}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (ValueError, DeviceError, DataError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
