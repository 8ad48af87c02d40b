"""Device and backend choice. The same code runs on CUDA, Apple's MPS and the CPU."""

from __future__ import annotations

import functools
import os
import shutil

import torch

DEVICE_CHOICES = ("auto", "cuda", "mps", "cpu")


class DeviceError(RuntimeError):
    """A device was asked for that this machine does not have."""


MPS_DISTRIBUTED = ("--device mps cannot train with several processes: no distributed backend "
                   "supports Apple's MPS (gloo runs on the CPU, NCCL on CUDA GPUs); use "
                   "--device auto or cpu, which run the ranks on the CPU with gloo")


def mps_note(device: torch.device) -> str | None:
    """One line for a Mac user whose ranks run on the CPU although MPS is there, else None."""
    if torch.device(device).type == "cpu" and mps_available():
        return ("note: this Mac's GPU (MPS) is not used: no distributed backend supports it, "
                "so the ranks run on the CPU with gloo")
    return None


def mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def pick_device(requested: str | None = "auto", *, distributed: bool = False) -> torch.device:
    """The device for this process. An explicit device must exist.

    ``auto`` means the best device for one process: cuda, then mps, then cpu. With
    ``distributed=True`` (the process joins a process group) it means the best device a
    distributed backend supports: cuda (NCCL), else cpu (gloo). No backend supports Apple's
    MPS, so on a Mac the ranks of a multi-process lesson run on the CPU, and an explicit
    ``mps`` is refused with one line.
    """
    requested = (requested or "auto").lower()
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if mps_available() and not distributed:
            return torch.device("mps")
        return torch.device("cpu")
    kind = requested.split(":")[0]
    if kind not in DEVICE_CHOICES:
        raise DeviceError(f"unknown device {requested!r}; choose one of: {', '.join(DEVICE_CHOICES)}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda was asked for, but this machine has no CUDA GPU "
                          "(torch.cuda.is_available() is False); use --device cpu or auto")
    if kind == "cuda" and ":" in requested and int(requested.split(":")[1]) >= torch.cuda.device_count():
        raise DeviceError(f"{requested} does not exist: this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s)")
    if kind == "mps" and distributed:
        raise DeviceError(MPS_DISTRIBUTED)
    if kind == "mps" and not mps_available():
        raise DeviceError("--device mps was asked for, but MPS is not available here")
    return torch.device(requested)


SHARE_GPU_VAR = "DPT_SHARE_GPU"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def shares_gpu() -> bool:
    """Whether the ranks of this machine share its GPUs (``DPT_SHARE_GPU=1`` and CUDA is there).

    NCCL refuses two ranks on one GPU, so one GPU normally means one rank. With
    ``DPT_SHARE_GPU=1`` any number of ranks run on a machine's GPUs: local rank r uses
    ``cuda:(r % torch.cuda.device_count())`` (:func:`gpu_for`) and the backend is gloo, which
    takes CUDA tensors. A one-GPU machine then runs multi-rank code with its tensors on the GPU,
    and a tensor left on the wrong device shows. Without CUDA the variable changes nothing.
    """
    value = os.environ.get(SHARE_GPU_VAR, "").strip().lower()
    if value not in _ON + _OFF:
        raise DeviceError(f"{SHARE_GPU_VAR}={os.environ[SHARE_GPU_VAR]!r} is neither 1 nor 0: "
                          "set it to 1 to let several ranks share a GPU, or unset it")
    return value in _ON and torch.cuda.is_available()


def gpu_for(local_rank: int) -> torch.device:
    """The GPU of process ``local_rank`` of this machine: its own one, or under
    :func:`shares_gpu` GPU ``local_rank % device_count`` (several ranks per GPU)."""
    count = torch.cuda.device_count()
    if shares_gpu():
        return torch.device("cuda", local_rank % max(1, count))
    if local_rank >= count:
        raise DeviceError(f"local rank {local_rank} needs GPU {local_rank}, but this machine has "
                          f"{count}; start fewer processes per node (or set {SHARE_GPU_VAR}=1 "
                          "to let ranks share a GPU, with gloo)")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device | str) -> str:
    """NCCL for CUDA, gloo for everything else (NCCL is not built on CPU-only or Mac wheels).

    Ranks sharing a GPU (:func:`shares_gpu`) use gloo on CUDA too: NCCL refuses two ranks on
    one GPU, gloo does not.
    """
    return "nccl" if torch.device(device).type == "cuda" and not shares_gpu() else "gloo"


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels, so a clock read afterwards measures finished work."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@functools.cache
def compiler_problem(device_type: str = "cpu") -> str | None:
    """One line saying why ``torch.compile``'s inductor cannot compile for ``device_type``
    here, or None.

    Cheap checks only (nothing is compiled): dynamo itself, then what inductor's code
    generator needs: a C++ compiler for the CPU, Triton for a GPU.
    """
    from torch._dynamo.eval_frame import is_dynamo_supported

    if not is_dynamo_supported():
        return "torch.compile is not supported on this Python or platform"
    if torch.device(device_type).type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor needs Triton for CUDA code and this machine has none"
        return None
    compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if not any(shutil.which(c) for c in compilers if c):
        return "inductor needs a C++ compiler (g++ or clang++) for CPU code and none is on PATH"
    return None
