# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 06: NVIDIA Apex's amp, the historical path, and what replaced each piece.

The 'Distributed data parallel training in PyTorch' tutorial (2019) trains with::

    model, optimizer = amp.initialize(model, optimizer, opt_level='O2')
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    model = apex.parallel.DistributedDataParallel(model)

Apex's amp was deprecated once ``torch.cuda.amp`` (now ``torch.amp``) shipped in PyTorch 1.6.
This script runs the Apex variant only when NVIDIA Apex is really importable, on a GPU;
otherwise it says why and prints the table mapping it to ``torch.amp``.

    .venv/bin/python exercises/06_mixed_precision/apex_amp.py               # the table, and whether Apex can run here
    .venv/bin/python exercises/06_mixed_precision/apex_amp.py --opt-level O1 --steps 50   # on a CUDA machine with NVIDIA Apex built

Installing NVIDIA Apex: ``pip install apex`` fetches an unrelated PyPI package. NVIDIA Apex is
built from source: ``git clone https://github.com/NVIDIA/apex && cd apex && pip install -v
--no-build-isolation --config-settings "--build-option=--cpp_ext" --config-settings
"--build-option=--cuda_ext" ./`` (needs a CUDA toolkit matching torch's).
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import importlib
import sys

import torch

# Where to read how torch.amp does each piece (the exact code of tasks 06.1 and 06.2 is yours).
DOCS = ("https://pytorch.org/docs/stable/amp.html",
        "https://pytorch.org/docs/stable/notes/amp_examples.html",
        "https://pytorch.org/tutorials/recipes/recipes/amp_recipe.html")

# opt_level -> (what Apex did, what plays that part in torch.amp)
OPT_LEVELS = {
    "O0": ("pure fp32: amp does nothing (the baseline to compare against)",
           "no autocast, no loss scaling: --precision fp32"),
    "O1": ("patch torch functions: allow-listed ops (matmul, conv) in fp16, deny-listed ones "
           "(softmax, losses) in fp32; weights stay fp32; dynamic loss scaling",
           "the same idea, without patching: autocast chooses each op's dtype inside a "
           "region you open, and a GradScaler object does the dynamic loss scaling (bf16 "
           "autocast needs none)"),
    "O2": ("cast the model to fp16 (batch norm kept fp32), keep fp32 master weights in the "
           "optimizer, dynamic loss scaling",
           "not needed: under autocast the model's own fp32 weights are the master weights "
           "and each op computes on a low-precision copy; a low-precision model with fp32 "
           "masters is what FSDP's MixedPrecisionPolicy(param_dtype=...) offers (lesson 08)"),
    "O3": ("pure fp16: model and optimizer in fp16, no master weights (a speed baseline, "
           "often unstable)",
           "casting the model itself to 16 bits: no master weights, small updates round "
           "away; rarely what you want for training"),
}

# Apex concept -> its torch.amp counterpart, in words; the docs above show the calls.
API_MAP = [
    ("from apex import amp", "nothing to install: torch.amp is part of PyTorch (since 1.6)"),
    ("amp.initialize(model, optimizer, opt_level='O1')",
     "nothing to initialize and nothing patched: the model and the optimizer stay as they "
     "are; autocast is a context you open around some code, and the loss scaler is an object "
     "of its own (torch.amp.GradScaler), created once"),
    ("with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()",
     "the GradScaler does what scale_loss did, in separate calls: one around backward, one "
     "that steps the optimizer (or skips the step after an overflow), one that adapts the "
     "scale; which calls, in which order: task 06.1, and the examples' 'Typical Mixed "
     "Precision Training'"),
    ("amp.master_params(optimizer), to clip the gradients",
     "the model's own (fp32) parameters; their gradients are scaled until the scaler has "
     "unscaled them, which clipping must wait for (the examples: 'Gradient clipping')"),
    ("amp.state_dict() / amp.load_state_dict(), in a checkpoint",
     "the scaler has a state of its own (its current scale and counters), which goes into "
     "the checkpoint and comes back on resume (task 06.2; the AMP recipe: 'Saving/Resuming')"),
    ("apex.parallel.DistributedDataParallel(model)",
     "torch.nn.parallel.DistributedDataParallel as in lesson 03, unchanged: it all-reduces "
     "the fp32 parameters' gradients"),
    ("apex.parallel.convert_syncbn_model(model)",
     "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)"),
    ("python -m torch.distributed.launch ... --local_rank",
     "torchrun, with LOCAL_RANK in the environment (lesson 04)"),
]


class OptLevelError(ValueError):
    """An opt_level Apex would reject (or, worse, misread)."""


def check_opt_level(opt_level: str) -> str:
    """Return the canonical opt_level ``"O0"``..``"O3"`` (capital letter O, then a digit).

    Apex's users are warned that it is the *letter* O: ``"01"`` (zero-one) is the classic typo, and
    lowercase ``"o1"`` is another. Both raise an OptLevelError that names the fix.
    """
    raise NotImplementedError("Task 06.4: return O0-O3 as they are; for '01' or 'o1' raise with the right spelling; reject the rest")


def apex_status() -> tuple[bool, str]:
    """``(True, "")`` when NVIDIA Apex's amp is importable, else ``(False, why)``."""
    try:
        apex = importlib.import_module("apex")
    except ImportError:
        return False, ("NVIDIA Apex is not installed. It is not on PyPI: `pip install apex` "
                       "installs an unrelated package. Build it from source "
                       "(https://github.com/NVIDIA/apex) on a CUDA machine; torch.amp does the "
                       "same job today.")
    try:
        importlib.import_module("apex.amp")
    except Exception as exc:  # noqa: BLE001 - a broken build raises many kinds
        where = getattr(apex, "__file__", "?")
        return False, (f"an `apex` module is importable ({where}) but `apex.amp` is not "
                       f"({type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}). "
                       "It is probably the unrelated PyPI package `apex`, or an Apex built "
                       "without its Python amp module. NVIDIA Apex is built from source.")
    if not torch.cuda.is_available():
        return False, "NVIDIA Apex is installed, but its amp needs a CUDA GPU and there is none."
    return True, ""


def print_tables() -> None:
    print("Apex opt_level -> what it did -> today")
    for level, (then, now) in OPT_LEVELS.items():
        print(f"  {level}: {then}\n      today: {now}")
    print("\nApex call -> what does its job in torch")
    for old, new in API_MAP:
        print(f"  {old}\n      -> {new}")
    print("\nThe calls themselves:\n" + "\n".join(f"  {url}" for url in DOCS))


def train_with_apex(opt_level: str, steps: int, batch_size: int = 64) -> list[float]:  # pragma: no cover - needs CUDA + Apex
    """The 2019 tutorial's Apex loop (single GPU). Only runs where :func:`apex_status` says yes."""
    import torch.nn.functional as F
    from apex import amp  # noqa: PLC0415 - optional dependency

    from dpt.data import make_loader, prepare
    from dpt.models import ConvNet

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = ConvNet().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level)
    prepare("fashion-mnist", quiet=True)
    loader = make_loader("fashion-mnist", train=True, batch_size=batch_size, seed=0)
    losses = []
    for step, (x, y) in enumerate(loader):
        if step >= steps:
            break
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--opt-level", default="O1", help="O0, O1, O2 or O3 (letter O)")
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args(argv)
    try:
        level = check_opt_level(args.opt_level)
    except OptLevelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_tables()
    ok, why = apex_status()
    if not ok:
        print(f"\nApex variant not run: {why}")
        print("The torch.amp version of the same training is ddp_amp.py (amp_train.py: one "
              "process).")
        return 0
    losses = train_with_apex(level, args.steps)  # pragma: no cover
    print(f"Apex {level}: {len(losses)} steps, last loss {losses[-1]:.4f}")  # pragma: no cover
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
