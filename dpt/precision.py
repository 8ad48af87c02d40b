"""The ``--precision`` flag of lesson 06: its values, its checks, and the dtype a device gets.

What to compute in is a property of the machine, decided here once: lesson 06's scripts take
``--precision {fp32,bf16,fp16,auto}`` from :func:`add_precision_argument`,
``dpt.cli.validate`` refuses an impossible request before any process starts
(:func:`check_request`), and each rank turns the flag into an autocast dtype for *its own*
device with :func:`choose_precision`. How a training step uses that dtype and the
``GradScaler`` is the lesson's to write, not this module's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

PRECISIONS = ("fp32", "bf16", "fp16", "auto")
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


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


def choose_precision(device: torch.device, requested: str = "auto"
                     ) -> tuple[torch.dtype | None, bool]:
    """``(autocast dtype, or None for fp32; whether a GradScaler is needed)`` on ``device``.

    ``auto``: on CUDA, bf16 where the GPU has it in hardware (compute capability 8 and up),
    else fp16 with a scaler; on a CPU, bf16 only with bf16 instructions (AMX or
    AVX512-BF16), since without them bf16 is emulated and slower than fp32; elsewhere fp32.
    """
    if requested not in PRECISIONS:
        raise PrecisionError(f"unknown precision {requested!r}; choose one of "
                             f"{', '.join(PRECISIONS)}")
    device = torch.device(device)
    if requested == "auto":
        if device.type == "cuda":
            requested = "bf16" if cuda_has_native_bf16(device) else "fp16"
        elif device.type == "cpu" and cpu_has_fast_bf16():
            requested = "bf16"
        else:
            requested = "fp32"
    if requested == "fp16" and device.type != "cuda":
        raise PrecisionError(f"--precision fp16 is the CUDA recipe (fp16 autocast + GradScaler); "
                             f"on {device.type} use bf16 (no scaler needed) or fp32")
    if requested == "bf16" and device.type == "mps":
        raise PrecisionError("bf16 autocast is not supported on MPS here; use fp32")
    return DTYPES[requested], requested == "fp16"


def add_precision_argument(p: argparse.ArgumentParser, default: str = "auto"
                           ) -> argparse.ArgumentParser:
    p.add_argument("--precision", default=default, choices=PRECISIONS,
                   help="autocast dtype. auto: bf16 on GPUs of compute capability 8+, fp16 "
                        "with a GradScaler on older ones; on a CPU bf16 if it has bf16 "
                        "instructions, else fp32")
    return p


def check_request(precision: str, device: str) -> None:
    """Refuse, before anything starts, a ``--precision`` that ``--device`` cannot run.

    Only what is certain without a process: fp16 needs CUDA, and MPS has no bf16 autocast.
    ``auto`` always has an answer; each rank resolves it for its own device.
    """
    kind = (device or "auto").split(":")[0]
    cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    if precision == "fp16" and not cuda:
        where = kind if kind != "auto" else "this machine (no CUDA GPU)"
        raise PrecisionError(f"--precision fp16 is the CUDA recipe (fp16 autocast + "
                             f"GradScaler); on {where} use bf16 (no scaler needed) or fp32")
    if precision == "bf16" and kind == "mps":
        raise PrecisionError("bf16 autocast is not supported on MPS here; use fp32")
