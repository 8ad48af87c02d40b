"""Lesson 06: one process, and the GradScaler at work, step by step.

``ddp_amp.py``'s ``Trainer`` runs here in a job of one process (``dpt.dist.group_of_one``:
no launcher, no port), so this script trains with the very ``_run_batch`` and checkpoint
you write there, one step at a time, and shows what the scaler does: the scale of each step,
a step skipped when a gradient is inf or NaN (``--inject-inf`` poisons a batch on purpose),
the scale halved after it and doubled after ``--growth-interval`` good steps, and a resumed
run that carries on with the scale it had reached.

A CPU has no fp16 recipe, but it has a GradScaler: ``--force-scaler`` turns one on around
fp32 (or bf16) compute, so its logic can be watched anywhere. (As a DDP job, this runs on a
GPU or the CPU, never on Apple's MPS, which no distributed backend supports.)

    .venv/bin/python exercises/06_mixed_precision/amp_train.py --precision auto --steps 200
    .venv/bin/python exercises/06_mixed_precision/amp_train.py --precision bf16 --device cpu --steps 100 --checkpoint /tmp/amp.pt
    .venv/bin/python exercises/06_mixed_precision/amp_train.py --precision bf16 --steps 50 --checkpoint /tmp/amp.pt --resume
    .venv/bin/python exercises/06_mixed_precision/amp_train.py --precision fp32 --force-scaler --inject-inf 5 --steps 20   # watch a skip
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import sys
import time

import torch
from ddp_amp import Trainer

from dpt import cli
from dpt.data import add_dataset_argument, make_loader, prepare
from dpt.device import DEVICE_CHOICES, pick_device
from dpt.dist import group_of_one
from dpt.models import MODELS, build_model
from dpt.precision import NAMES, add_precision_argument, choose_precision


def inject_inf(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of the batch whose first pixel is inf: the loss and every gradient become inf/NaN."""
    x, y = batch
    x = x.clone()
    x.view(-1)[0] = float("inf")
    return x, y


def watched_step(trainer, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """``trainer._run_batch`` on ``batch``, and what the scaler did: ``{"loss", "scale"
    (the one this step used), "skipped" (True when the scale went down: an inf/NaN
    gradient made the scaler skip the optimizer's step)}``."""
    x, y = (t.to(trainer.device) for t in batch)
    scale = trainer.scaler.get_scale()
    loss = trainer._run_batch(x, y)
    return {"loss": loss, "scale": scale, "skipped": trainer.scaler.get_scale() < scale}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_precision_argument(p)
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    p.add_argument("--model", default="convnet", choices=sorted(MODELS))
    add_dataset_argument(p)
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
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    return p


def run(args: argparse.Namespace) -> dict:
    if args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    if args.resume and not args.checkpoint:
        raise ValueError("--resume needs --checkpoint PATH")
    device = pick_device(args.device, distributed=True)  # a DDP job, if only of one
    _, scaled = choose_precision(device, args.precision)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, init_scale=args.init_scale,
                                  growth_interval=args.growth_interval,
                                  enabled=scaled or args.force_scaler)
    with group_of_one(device):
        # the Trainer counts epochs; here one "epoch" of its counter is one step
        trainer = Trainer(model, None, optimizer, device, checkpoint_path=args.checkpoint,
                          resume_from=args.checkpoint if args.resume else None,
                          precision=args.precision, max_norm=args.clip or None, scaler=scaler)
        start = trainer.epochs_run
        state = f"on, scale {scaler.get_scale():g}" if scaler.is_enabled() else "off"
        print(f"device {device} | autocast {NAMES[trainer.dtype]} | scaler {state} | "
              f"from step {start}", flush=True)
        prepare(args.dataset, quiet=True)
        loader = make_loader(args.dataset, train=True, batch_size=args.batch_size,
                             seed=args.seed)
        history, skipped = [], []
        step, t0 = start, time.perf_counter()
        while step < start + args.steps:
            loader.set_epoch(step)
            for batch in loader:
                if step >= start + args.steps:
                    break
                if step in args.inject_inf:
                    batch = inject_inf(batch)
                out = watched_step(trainer, batch)
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
            trainer._save_checkpoint(step)
            tail = f", scale {scaler.get_scale():g}" if scaler.is_enabled() else ""
            print(f"saved {args.checkpoint} (step {step}{tail})", flush=True)
    return {"history": history, "skipped": skipped, "step": step,
            "scale": scaler.get_scale() if scaler.is_enabled() else None}


if __name__ == "__main__":
    sys.exit(cli.main(run, build_parser()))
