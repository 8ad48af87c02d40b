"""What lessons 01 and 02's tests need to hold on a GPU machine too, checked on any machine.

- :func:`fake_one_gpu`: the machine looks as if it had one CUDA GPU (to ``nn.DataParallel``
  and to ``torch.cuda``), and any move of a module or a tensor to CUDA fails the test, naming
  the move. A test run under it proves it moves nothing to a GPU behind its own back, which
  ``nn.DataParallel(model)`` does on a machine with exactly one GPU: it sends the model to
  ``cuda:0`` when built.
- :func:`cpu_data_parallel`: ``nn.DataParallel(model)`` built as where no GPU is visible, so
  the model stays where it is (for the checkpoint tests, which only read and write weights).
- :func:`full_fp32`: CUDA convolutions and matrix products in full fp32 inside the block.
  Ampere and later GPUs run convolutions in TF32 by default (about three decimal digits),
  which no comparison to 1e-4 survives.
- :func:`tutorial_cell`: one code cell of a lesson's notebook (its ``tutorial.py``), to run
  under the spies and fakes above.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from unittest import mock

import torch
from torch import nn

from tests.lessons import script


def _cuda_target(args: tuple, kwargs: dict) -> torch.device | None:
    """The CUDA device a ``.to(...)`` call asks for, else None."""
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
    try:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
    except (TypeError, RuntimeError):
        return None
    return device if device is not None and device.type == "cuda" else None


def _refuse(what: str, device) -> None:
    raise AssertionError(
        f"{what} was sent to {device} on a machine with one GPU (faked here, so nothing can "
        "really move): on a real GPU it would then sit on the GPU while the checkpoint and "
        "the comparison are on the CPU ('Expected all tensors to be on the same device'). "
        "nn.DataParallel(model) does this when built with one GPU visible")


def fake_one_gpu(monkeypatch) -> None:
    """Until the test ends: one CUDA GPU is visible, and every move to CUDA fails."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # nn.DataParallel compares the GPUs' sizes when built: one GPU is balanced
    data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")
    monkeypatch.setattr(data_parallel, "_check_balance", lambda device_ids: None)
    module_to, tensor_to = nn.Module.to, torch.Tensor.to

    def guarded_module_to(self, *args, **kwargs):
        device = _cuda_target(args, kwargs)
        if device is not None:
            _refuse(f"a {type(self).__name__} module", device)
        return module_to(self, *args, **kwargs)

    def guarded_tensor_to(self, *args, **kwargs):
        device = _cuda_target(args, kwargs)
        if device is not None:
            _refuse(f"a tensor of shape {tuple(self.shape)}", device)
        return tensor_to(self, *args, **kwargs)

    def module_cuda(self, device=None):
        _refuse(f"a {type(self).__name__} module (.cuda())", device or "cuda")

    def tensor_cuda(self, device=None, *args, **kwargs):
        _refuse(f"a tensor of shape {tuple(self.shape)} (.cuda())", device or "cuda")

    monkeypatch.setattr(nn.Module, "to", guarded_module_to)
    monkeypatch.setattr(nn.Module, "cuda", module_cuda)
    monkeypatch.setattr(torch.Tensor, "to", guarded_tensor_to)
    monkeypatch.setattr(torch.Tensor, "cuda", tensor_cuda)


def cpu_data_parallel(module: nn.Module) -> nn.DataParallel:
    """``nn.DataParallel(module)`` as built where no GPU is visible: no device ids, and the
    module stays where it is. Its keys are the wrapper's (``module.`` prefixed)."""
    with mock.patch.object(torch.cuda, "is_available", lambda: False):
        return nn.DataParallel(module)


def _precision_flags() -> list[tuple[object, str, object]]:
    """(owner, attribute, full-fp32 value) of the TF32 switches of this torch."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        # torch >= 2.9: mixing these with the legacy allow_tf32 flags is an error
        return [(conv, "fp32_precision", "ieee"),
                (torch.backends.cuda.matmul, "fp32_precision", "ieee")]
    return [(torch.backends.cudnn, "allow_tf32", False),
            (torch.backends.cuda.matmul, "allow_tf32", False)]


@contextmanager
def full_fp32():
    """CUDA convolutions and matrix products in full fp32 (no TF32) inside the block; the
    switches are put back after it, also when it raises. Nothing changes on a CPU."""
    flags = _precision_flags()
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in flags]
    try:
        for owner, name, value in flags:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def tf32_allowed() -> bool:
    """Whether CUDA convolutions may use TF32 now (what :func:`full_fp32` turns off)."""
    owner, name, full = _precision_flags()[0]
    return getattr(owner, name) != full


def tutorial_cell(lesson: str, needle: str) -> str:
    """The one code cell of ``<target>/<lesson>/tutorial.py`` (jupytext percent format, the
    notebook's source) whose text contains ``needle``."""
    cells, lines = [], None
    for line in script(lesson, "tutorial.py").read_text().splitlines():
        if line.startswith("# %%"):
            lines = None if "[markdown]" in line else []
            if lines is not None:
                cells.append(lines)
        elif lines is not None:
            lines.append(line)
    found = ["\n".join(cell) for cell in cells if needle in "\n".join(cell)]
    assert len(found) == 1, f"{len(found)} code cells of {lesson}/tutorial.py contain {needle!r}"
    return found[0]
