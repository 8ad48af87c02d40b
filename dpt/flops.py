"""How many floating-point operations a training step does, and how many the device could do.

Model FLOPs utilization (MFU, PaLM paper, Chowdhery et al. 2022, appendix B) compares the
arithmetic a step *needs* with what the hardware could have done in the same time::

    achieved FLOP/s = model FLOPs per step / seconds per step
    MFU             = achieved FLOP/s / peak FLOP/s of the device (for the dtype computed in)

"Model FLOPs" are those of the forward and backward passes of the model as written: not the
optimizer, not communication, not activation recomputation (counting recomputation would give
the *hardware* FLOPs utilization, HFU). One multiply-add counts as 2 FLOPs.

This module is the plumbing shared by lesson 12 and the benchmark harness:

- :data:`PEAK_TFLOPS`, the datasheet *dense* peaks (no 2:4 sparsity) of the GPUs the course
  meets, and :func:`datasheet_peak`, which finds the entry for a ``torch.cuda.get_device_name``;
- :func:`measure_peak`, a square-matmul probe (2·n³ FLOPs per product, best of a few): on a CPU,
  or a GPU without an entry, it *is* the peak used, and is labelled so;
- :func:`peak_flops`, the datasheet figure on a known GPU, the probe elsewhere;
- :func:`step_flops`, a step's model FLOPs counted by ``torch.utils.flop_counter.FlopCounterMode``
  on a copy of the model. Scaled-dot-product attention is forced to its MATH backend while
  counting: FlopCounterMode does not count the CPU's fused (flash) attention kernel, so a
  TinyTransformer's attention matmuls (33.5M FLOPs at batch 8) would silently vanish;
- :class:`ComputeDtypes`, which watches code run (a benchmark method's own step) and says in
  which dtype its FLOPs were computed: autocast's bf16 matmuls, or fp32.

TF32, the rule used here: an fp32 step on a GPU with TF32 tensor cores (Ampere and newer) is
rated against the TF32 peak when ``torch.backends.cuda.matmul.allow_tf32`` is on (PyTorch's
default is off), and against the plain fp32 peak otherwise. Convolutions use TF32 by default
(``torch.backends.cudnn.allow_tf32``); a convolution-heavy fp32 model can therefore exceed
"100%" of the fp32 peak: read its MFU against the TF32 line instead.
"""

from __future__ import annotations

import copy
import re
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# Dense (no sparsity) peak TFLOP/s by GPU and dtype, from NVIDIA's published specifications.
# Datasheets quote tensor-core figures "with sparsity" (2:4 structured); the dense peak is half.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet and the "NVIDIA H100 Tensor Core GPU
    # Architecture" whitepaper (table "NVIDIA H100 SXM5 ..."): FP32 67, TF32 494.7,
    # BF16/FP16 989.4 dense (989 / 1,979 with sparsity on the datasheet).
    "H100 SXM": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    # H100 PCIe: the same datasheet, PCIe column: FP32 51, TF32 756 / BF16 and FP16 1,513 with
    # sparsity, i.e. 378 and 756.5 dense.
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5},
    # H200 SXM: NVIDIA H200 datasheet: the same compute as H100 SXM (FP32 67, TF32 989,
    # BF16/FP16 1,979 with sparsity), with more and faster memory (141 GB HBM3e, 4.8 TB/s).
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    # A100 (SXM4 and PCIe, 40 and 80 GB): NVIDIA A100 datasheet: FP32 19.5, TF32 156,
    # BF16/FP16 312 dense (312 / 624 with sparsity).
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    # L4: NVIDIA L4 datasheet: FP32 30.3, TF32 120, BF16/FP16 242 with sparsity -> 60 / 121.
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    # T4 (Turing): NVIDIA T4 datasheet: FP32 8.1, FP16 (mixed precision) 65. Turing has no TF32
    # and no bf16 tensor cores (bf16 is emulated, far below the fp16 figure): no entry for them.
    "T4": {"fp32": 8.1, "fp16": 65.0},
}

# torch.cuda.get_device_name -> PEAK_TFLOPS key, first match wins. Variants with other clocks
# or power (H100 NVL, H200 NVL, GH200, L40S, A10) have no entry and get the probe instead.
_NAME_RULES: tuple[tuple[str, str | None], ...] = (
    (r"\bH100\b.*\bNVL\b", None),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe"),
    (r"\bH100\b.*\b(HBM3|SXM\w*)\b", "H100 SXM"),   # "NVIDIA H100 80GB HBM3"
    (r"\bH200\b.*\bNVL\b", None),
    (r"\bH200\b", "H200"),                           # "NVIDIA H200"
    (r"\bA100\b", "A100"),                           # "NVIDIA A100-SXM4-80GB", "... PCIe"
    (r"\bL4\b", "L4"),                               # "NVIDIA L4" (not L40, L40S)
    (r"\bT4\b", "T4"),                               # "Tesla T4"
)

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

PROBE_LABEL = "measured peak, matmul probe"


def gpu_key(device_name: str) -> str | None:
    """The :data:`PEAK_TFLOPS` key of a ``torch.cuda.get_device_name`` string, or None."""
    for pattern, key in _NAME_RULES:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return key
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"no peak for dtype {dtype}: expected one of "
                         f"{', '.join(str(d) for d in DTYPE_NAMES)}")
    return DTYPE_NAMES[dtype]


def datasheet_peak(device_name: str, dtype: torch.dtype, *,
                   tf32: bool | None = None) -> tuple[float, str] | None:
    """(FLOP/s, label) from the datasheet for this GPU and dtype; None when there is no entry.

    fp32 is rated at the TF32 peak when ``tf32`` is true (default: the current
    ``torch.backends.cuda.matmul.allow_tf32``) and the GPU has TF32 tensor cores.
    """
    name = _dtype_name(dtype)
    key = gpu_key(device_name)
    if key is None:
        return None
    table = PEAK_TFLOPS[key]
    if name == "fp32":
        if tf32 is None:
            tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        if tf32 and "tf32" in table:
            name = "tf32"
    if name not in table:
        return None
    return table[name] * 1e12, f"{key} datasheet, dense {name} ({table[name]:g} TFLOP/s)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 seconds: float = 0.3) -> float:
    """FLOP/s of square matmuls on ``device`` in ``dtype``: 2·n³ per product, best of a few.

    The size grows until one timed batch of products takes about ``seconds``/8, then batches
    are timed until ``seconds`` have passed; the best batch is the peak (the machine at its
    least disturbed). About ``seconds`` to ~2x that in all.
    """
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    _dtype_name(dtype)
    device = torch.device(device)
    max_n = 8192 if device.type == "cuda" else 2048
    target = seconds / 8
    gen = torch.Generator(device=device).manual_seed(0)  # the caller's random state untouched

    def batch(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(k):
            torch.mm(a, b)
        _sync(device)
        return time.perf_counter() - start

    n, k = 256, 1
    while True:
        a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        batch(a, b, 1)                                   # warm-up: kernels, caches, clocks
        took = batch(a, b, k)
        if took >= target:
            break
        if n < max_n:
            n *= 2
        else:
            k *= 2
    best, spent = took, took
    while spent < seconds:
        took = batch(a, b, k)
        best, spent = min(best, took), spent + took
    return 2 * n ** 3 * k / best


def peak_flops(device: torch.device | str, dtype: torch.dtype = torch.float32,
               seconds: float = 0.3, probe: Callable | None = None) -> tuple[float, str]:
    """(peak FLOP/s, label): the datasheet figure on a GPU in :data:`PEAK_TFLOPS`, else the probe.

    The label says which, and why the probe was used on a GPU (no entry for its name, or none
    for this dtype, as bf16 on a T4). A CPU without bf16 (fp16) instructions computes those on
    its fp32 units: its 16-bit peak is the fp32 probe's, labelled so. ``probe`` replaces
    :func:`measure_peak` (a caller that asks for several dtypes can reuse one measurement).
    """
    probe = probe or measure_peak
    device = torch.device(device)
    _dtype_name(dtype)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = datasheet_peak(name, dtype)
        if found is not None:
            return found
        key = gpu_key(name)
        why = (f"no datasheet entry for {name!r}" if key is None
               else f"{key} datasheet has no {DTYPE_NAMES[dtype]} peak")
        return probe(device, dtype, seconds), f"{PROBE_LABEL} ({why})"
    name = DTYPE_NAMES[dtype]
    if device.type == "cpu" and name != "fp32" and not cpu_has_fast(name):
        # bf16/fp16 without the instructions: converted and computed on the fp32 units, so
        # the fp32 rate is the most the CPU can do (a 16-bit matmul probe runs a slow path
        # that convolutions do not take, and would put MFU above 100%)
        return (probe(device, torch.float32, seconds),
                f"{PROBE_LABEL} (cpu, fp32: this CPU has no {name} instructions, {name} is "
                f"computed on its fp32 units)")
    return probe(device, dtype, seconds), f"{PROBE_LABEL} ({device.type}, {name})"


def cpu_has_fast(name: str) -> bool:
    """Whether this CPU computes ``name`` ("bf16", "fp16") in instructions of its own."""
    from dpt.precision import cpu_flags

    wanted = {"bf16": ("amx_bf16", "avx512_bf16"), "fp16": ("amx_fp16", "avx512_fp16")}[name]
    return any(flag in cpu_flags() for flag in wanted)


def _as_args(example_input: Any) -> tuple:
    return tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)


def count_step(model: nn.Module, example_input: Any,
               loss_fn: Callable[[Any], torch.Tensor] | None = None) -> dict[str, int]:
    """Forward and backward FLOPs of one step, ``{"forward": f, "backward": b}``.

    Counted with FlopCounterMode on a deep copy of ``model`` (the caller's parameters, their
    ``.grad`` and buffers such as BatchNorm's running statistics stay untouched), attention
    on the MATH backend. ``loss_fn(output)`` makes the scalar to differentiate (default: the
    sum of the output; a loss's own few FLOPs are not matmuls and count 0 either way).
    Gradients are taken with ``torch.autograd.grad`` for the parameters that require them, as
    ``loss.backward()`` computes them.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    try:
        counted = copy.deepcopy(model)
    except Exception as err:
        raise TypeError(f"step_flops needs a model it can deep-copy (pass the bare module, "
                        f"not a wrapper holding a process group): {err}") from None
    params = [p for p in counted.parameters() if p.requires_grad]
    args = _as_args(example_input)
    forward = FlopCounterMode(display=False)
    backward = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH):
        with forward:
            out = counted(*args)
        loss = loss_fn(out) if loss_fn is not None else _sum(out)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise ValueError("loss_fn must return a one-element tensor")
        with backward if params else nullcontext():
            if params:
                torch.autograd.grad(loss, params, allow_unused=True)
    return {"forward": int(forward.get_total_flops()),
            "backward": int(backward.get_total_flops()) if params else 0}


def _sum(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    if isinstance(out, (tuple, list)):
        return sum(_sum(o) for o in out)
    if isinstance(out, dict):
        return sum(_sum(o) for o in out.values())
    raise TypeError(f"cannot make a loss of a model output of type {type(out).__name__}: "
                    f"pass loss_fn")


def step_flops(model: nn.Module, example_input: Any,
               loss_fn: Callable[[Any], torch.Tensor] | None = None) -> int:
    """Model FLOPs of one training step (forward + backward) at this input's batch.

    See :func:`count_step`; the optimizer's update is not counted.
    """
    counts = count_step(model, example_input, loss_fn)
    return counts["forward"] + counts["backward"]


class ComputeDtypes(TorchDispatchMode):
    """Under it, the FLOPs of every counted operation (matmuls, convolutions, attention: what
    FlopCounterMode counts) are summed by the dtype of its first tensor input. ::

        with ComputeDtypes() as seen:
            step()
        seen.dtype()          # torch.bfloat16 for a step under bf16 autocast

    Operations run on other threads (``nn.DataParallel``'s replicas) are not seen; the
    autograd engine's threads are (they carry the mode with them).
    """

    def __init__(self) -> None:
        super().__init__()
        self.flops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        from torch.utils.flop_counter import flop_registry

        count = flop_registry.get(func._overloadpacket)
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if count is not None and first is not None:
            try:
                self.flops[first.dtype] += int(count(*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - watching must never break the step watched
                self.flops[first.dtype] += 0
        return out

    def total(self) -> int:
        return sum(self.flops.values())

    def dtype(self) -> torch.dtype | None:
        """The dtype most of the FLOPs seen were computed in (None when none were seen)."""
        seen = [(n, d) for d, n in self.flops.items() if n > 0]
        return max(seen, key=lambda nd: nd[0])[1] if seen else None


def mfu(flops_per_step: float, seconds_per_step: float, peak: float) -> float:
    """Model FLOPs utilization: achieved FLOP/s over the peak FLOP/s (a fraction)."""
    if not (seconds_per_step > 0 and peak > 0):
        raise ValueError(f"step seconds and peak must be positive, got {seconds_per_step} "
                         f"and {peak}")
    return flops_per_step / seconds_per_step / peak
