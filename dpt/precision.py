"""The ``--precision`` flag of lesson 06: its values, its checks, and the dtype a device gets.

What to compute in is a property of the machine, decided here once: lesson 06's scripts take
``--precision {fp32,bf16,fp16,auto}`` from :func:`add_precision_argument`,
``dpt.cli.validate`` refuses an impossible request before any process starts
(:func:`check_request`), the ranks of a job agree on what ``auto`` means
(:func:`agree_precision`), and each rank turns that into an autocast dtype for its device with
:func:`choose_precision`. How a training step uses that dtype and the ``GradScaler`` is the
lesson's to write, not this module's.

Why the ranks must agree: on a cluster whose GPUs differ (an A100 next to a V100), ``auto``
resolved rank by rank gives bf16 on one and fp16 with a GradScaler on the other, and DDP then
averages one rank's scaled gradients with another's unscaled ones.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

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


def low_precision_for(device: torch.device | str | tuple[int, int]) -> str:
    """The 16-bit format to compute in on ``device`` by the rule above, by name.

    ``"fp16"`` on a CUDA GPU of compute capability below 8 (a T4, a V100: bf16 is emulated
    there), else ``"bf16"`` (Ampere and newer; the CPU, whose autocast has no fp16 recipe).
    ``device`` may be a compute capability ``(major, minor)`` instead, for a caller that
    has read it without a device (``nvidia-smi``). :data:`DTYPES` turns the name into the
    dtype.
    """
    if isinstance(device, tuple):
        major = int(device[0])
    else:
        device = torch.device(device)
        if device.type != "cuda":
            return "bf16"
        major = torch.cuda.get_device_properties(device).major
    return "bf16" if major >= 8 else "fp16"


def compute_format(requested: str, device: torch.device | str) -> tuple[str, str | None]:
    """A ``--dtype`` (fp32, bf16, fp16 or auto) for ranks computing on ``device``: the name to
    compute in, and one line to show (None when there is nothing to say).

    ``auto`` is :func:`low_precision_for` the device, and the line says what it chose; an
    explicit bf16 where bf16 is emulated runs as asked, and the line says so.
    """
    if requested not in ("fp32", "bf16", "fp16", "auto"):
        raise PrecisionError(f"unknown dtype {requested!r}; choose one of fp32, bf16, fp16, auto")
    device = torch.device(device)
    best = low_precision_for(device)
    emulated = "bf16 is emulated on this GPU (compute capability below 8)"
    if requested == "auto":
        why = f": {emulated}" if best == "fp16" else ""
        return best, f"note: --dtype auto computes in {best} on {device.type}{why}"
    if requested == "bf16" and best == "fp16":
        return "bf16", f"note: {emulated}, so bf16 runs slower than fp16 here"
    return requested, None


def auto_candidates(device: torch.device) -> list[str]:
    """What ``auto`` may pick on ``device``: the precisions it runs well, best first.

    A CUDA GPU of compute capability 8 and up: bf16, fp16, fp32; an older one: fp16, fp32
    (its bf16 is emulated); a CPU with bf16 instructions: bf16, fp32; anything else: fp32.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return ["bf16", "fp16", "fp32"] if cuda_has_native_bf16(device) else ["fp16", "fp32"]
    if device.type == "cpu" and cpu_has_fast_bf16():
        return ["bf16", "fp32"]
    return ["fp32"]


def agree_precision(device: torch.device, requested: str = "auto") -> str:
    """The precision every rank of the job uses for ``requested``, by name.

    An explicit precision comes back as it is. ``auto`` becomes the best precision that
    every rank's device runs well (:func:`auto_candidates`): in a process group of several
    ranks this is collective (an all-gather; every rank must call it), and rank 0 says so
    when some rank's own best differs. Without a process group it is this device's best.
    """
    if requested != "auto":
        return requested
    mine = auto_candidates(device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine[0]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"device": str(device), "candidates": mine})
    common = [p for p in mine if all(p in r["candidates"] for r in everyone)]
    chosen = common[0]  # fp32 is in every list
    if dist.get_rank() == 0 and any(r["candidates"][0] != chosen for r in everyone):
        best = ", ".join(f"rank {i} ({r['device']}) {r['candidates'][0]}"
                         for i, r in enumerate(everyone))
        print(f"note: --precision auto: the ranks' devices differ ({best}); all ranks use "
              f"{chosen}, which every one of them runs", flush=True)
    return chosen


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
        requested = auto_candidates(device)[0]
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
                        "instructions, else fp32; every rank uses the best one all the "
                        "ranks' devices run")
    return p


def check_request(precision: str, device: str) -> None:
    """Refuse, before anything starts, a ``--precision`` that ``--device`` cannot run.

    Only what is certain without a process: fp16 needs CUDA, and MPS has no bf16 autocast.
    ``auto`` always has an answer; the ranks resolve it together (:func:`agree_precision`).
    """
    kind = (device or "auto").split(":")[0]
    cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    if precision == "fp16" and not cuda:
        where = kind if kind != "auto" else "this machine (no CUDA GPU)"
        raise PrecisionError(f"--precision fp16 is the CUDA recipe (fp16 autocast + "
                             f"GradScaler); on {where} use bf16 (no scaler needed) or fp32")
    if precision == "bf16" and kind == "mps":
        raise PrecisionError("bf16 autocast is not supported on MPS here; use fp32")
