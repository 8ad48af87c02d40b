"""Rank functions for lesson 06's multi-process tests (importable, so ranks can run them).

Each takes the lesson's modules from the tree under test (``tests.lessons.load``), in the rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dpt.models import ConvNet
from tests.lessons import load

LESSON = "06_mixed_precision"


def _batch(rank: int, step: int, n: int = 8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def hook_under_bf16(rank: int, world_size: int) -> dict:
    """DDP + bf16 autocast with the lesson's recording hook, written without the lesson's
    train step (so this tests task 06.3 alone). Returns the recorded dtypes, this rank's
    local gradients (from an unwrapped copy), the DDP gradients and the final parameters."""
    amp_inspect = load(LESSON, "amp_inspect")

    torch.manual_seed(0)
    model = ConvNet(batch_norm=False)
    local = ConvNet(batch_norm=False)
    local.load_state_dict(model.state_dict())
    ddp = DDP(model)
    recorder = amp_inspect.DtypeRecorder()
    ddp.register_comm_hook(recorder, amp_inspect.recording_allreduce_hook)
    x, y = _batch(rank, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(ddp(x), y)
        local_loss = F.cross_entropy(local(x), y)
    loss.backward()
    local_loss.backward()
    flat = lambda ps: torch.cat([p.flatten() for p in ps])  # noqa: E731
    out = {"dtypes": sorted({str(d) for d in recorder.dtypes}),
           "n_buckets": len(recorder.dtypes),
           "ddp_grads": flat(p.grad for p in model.parameters()),
           "local_grads": flat(p.grad for p in local.parameters()),
           "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()})}
    # The control: a model whose weights are bf16 has bf16 buckets, so a hook that writes
    # down float32 without looking at the bucket records the wrong dtype here.
    bf16 = DDP(ConvNet(batch_norm=False).to(torch.bfloat16))
    bf16_recorder = amp_inspect.DtypeRecorder()
    bf16.register_comm_hook(bf16_recorder, amp_inspect.recording_allreduce_hook)
    F.cross_entropy(bf16(x.to(torch.bfloat16)).float(), y).backward()
    out["bf16_weights_dtypes"] = sorted({str(d) for d in bf16_recorder.dtypes})
    dist.barrier()
    return out


def lesson_trainer_ddp(rank: int, world_size: int, precision: str) -> dict:
    """The lesson's own Trainer under DDP, a few small steps on synthetic data, with the
    lesson's recording hook (``amp_inspect.ddp_dtypes``). A forward hook on the model it
    builds adds, per step, the autocast dtype the forward ran under (None: autocast off) and
    the samples this rank trained on."""
    amp_inspect = load(LESSON, "amp_inspect")

    seen = {"autocast": [], "inputs": []}
    real_build = amp_inspect.build_model

    def build_and_watch(*args, **kwargs):
        model = real_build(*args, **kwargs)

        def watch(module, inputs, output):
            on = torch.is_autocast_enabled("cpu")
            seen["autocast"].append(str(torch.get_autocast_dtype("cpu")) if on else None)
            seen["inputs"].append(inputs[0].detach().cpu().clone())

        model.register_forward_hook(watch)
        return model

    amp_inspect.build_model = build_and_watch
    try:
        out = amp_inspect.ddp_dtypes(rank, world_size, precision=precision, steps=3,
                                     batch_size=8)
    finally:
        amp_inspect.build_model = real_build
    out["autocast"] = seen["autocast"]
    out["inputs"] = seen["inputs"]
    return out


def save_on_ranks(rank: int, world_size: int, folder: str) -> dict:
    """The lesson's ``_save_checkpoint`` on every rank: first each rank to its OWN path (only
    rank 0 may write a file), then all to one path while rank 0 writes slowly (nobody may
    return before the file is there)."""
    from pathlib import Path

    from tests.helpers import recording_moves, slowed

    ddp_amp = load(LESSON, "ddp_amp")

    torch.manual_seed(0)
    model = ConvNet(batch_norm=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 7)
    with recording_moves() as moves:
        trainer = ddp_amp.Trainer(model, None, opt, torch.device("cpu"), scaler=scaler,
                                  checkpoint_path=Path(folder) / f"own{rank}.pt")
    trainer._save_checkpoint(2)
    dist.barrier()
    with slowed(ddp_amp, "save_checkpoint"):
        trainer.checkpoint_path = Path(folder) / "shared.pt"
        trainer._save_checkpoint(3)
        there_on_return = trainer.checkpoint_path.is_file()
    return {"there_on_return": there_on_return,
            "model_sent": moves.module_sent(model, "cpu")}


def precision_on_unlike_ranks(rank: int, world_size: int, precision: str = "auto") -> dict:
    """The lesson's Trainer on ranks whose CPUs differ: rank 0's has bf16 instructions, the
    others' have none (faked, so the answer does not depend on this machine's CPU). Returns the
    autocast dtype it chose and whether its GradScaler is on."""
    import dpt.precision

    ddp_amp = load(LESSON, "ddp_amp")

    dpt.precision.cpu_has_fast_bf16 = lambda: rank == 0
    torch.manual_seed(0)
    model = ConvNet(batch_norm=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ddp_amp.Trainer(model, None, opt, torch.device("cpu"), precision=precision)
    return {"dtype": str(trainer.dtype), "scaled": trainer.scaler.is_enabled()}


def agreed_on_unlike_gpus(rank: int, world_size: int, majors: tuple[int, ...]) -> dict:
    """``dpt.precision.agree_precision`` for ``cuda:rank``, whose compute capability is faked
    to ``majors[rank]`` (no GPU is touched: gloo gathers on the CPU). Returns the precision
    agreed, the dtype and scaler it gives, and what the rank printed."""
    import contextlib
    import io
    import types

    from dpt import precision

    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        major=majors[torch.device(device).index], minor=0)
    device = torch.device("cuda", rank)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        name = precision.agree_precision(device, "auto")
    dtype, scaled = precision.choose_precision(device, name)
    return {"name": name, "dtype": str(dtype), "scaled": scaled, "printed": out.getvalue()}
