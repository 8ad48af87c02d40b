"""Lesson 09: sharded checkpoints with torch.distributed.checkpoint (DCP).

A sharded model saves as it is: every rank writes its own shards (of the parameters and of
Adam's state) into one folder, at the same time, and nobody gathers the whole model. The
folder's ``.metadata`` records which part of which tensor lies where, so the checkpoint can
be loaded by any number of ranks: saved at 2 ranks, resumed at 1, 2 or 4, each rank reading
the pieces its new shards need. With a fixed global batch per step (``fsdp2_practice``), the
resumed losses are those of a run that was never stopped.

For inference, one file with the whole model: the full state dict, gathered once, loadable
into a plain ``TinyTransformer`` without torch.distributed.

    .venv/bin/python solutions/09_fsdp/dcp_checkpoint.py --steps 6 --save-at 3 --folder ckpt
    .venv/bin/python solutions/09_fsdp/dcp_checkpoint.py --steps 6 --resume ckpt --nproc 4
    .venv/bin/python solutions/09_fsdp/dcp_checkpoint.py --demo    # resume at 1, 2 and 4 ranks
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from fsdp2_practice import CONFIG, build_sharded, make_optimizer, train_steps
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from dpt.checkpoint import (
    CheckpointError,
    atomic_save,
    check_dcp_checkpoint,
    load,
    reading_checkpoint,
)
from dpt.dist import barrier, gathers_for_shared_gpu, get_rank
from dpt.models import TinyTransformer


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer,
                    folder: str | Path, step: int) -> None:
    """Every rank writes its shards of the model and of the optimizer's state, and the step
    to resume at, into ``folder`` (collective: every rank calls it).

    The checkpoint holds ``{"model": ..., "optim": ..., "step": step}``: the model's and the
    optimizer's state dicts keyed by parameter name (``"blocks.0.qkv.weight"``, at any number
    of ranks), not by position.
    """
    Path(folder).mkdir(parents=True, exist_ok=True)
    # BEGIN SOLUTION 09.21: state dicts keyed by parameter name that an optimizer on another number of ranks can use, then one collective save of model, optimizer and step
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "step": step},
             checkpoint_id=str(folder))
    # END SOLUTION


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer,
                    folder: str | Path) -> int:
    """Load a :func:`save_checkpoint` folder (``"model"``, ``"optim"``, ``"step"``) into this
    run's sharded model and optimizer, whatever the number of ranks that saved it; returns
    the step to resume at."""
    check_dcp_checkpoint(folder)  # a missing, partial or truncated folder: one line, every rank
    with reading_checkpoint(folder):
        # BEGIN SOLUTION 09.22: DCP loads in place: give it state dicts shaped like this run's shards, then hand what it read back to the model and the optimizer
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": 0}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return state["step"]
        # END SOLUTION


def export_full(model: nn.Module, path: str | Path) -> None:
    """Write the whole model's weights to one file at ``path``, as plain CPU tensors a model
    without torch.distributed loads (collective: every rank calls it)."""
    # BEGIN SOLUTION 09.23: every rank takes part in gathering whole tensors, moved to the CPU; one rank writes them
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if get_rank() == 0:
        atomic_save(state, path)
    # END SOLUTION
    barrier()  # nobody reads the file before it is written


def load_for_inference(path: str | Path, config: dict | None = None) -> TinyTransformer:
    """A plain TinyTransformer with the weights :func:`export_full` wrote, in eval mode."""
    model = TinyTransformer(**(config or CONFIG))
    model.load_state_dict(load(path))
    return model.eval()


def train_worker(rank: int, world_size: int, steps: int = 6, seed: int = 0,
                 save_at: int | None = None, folder: str | None = None,
                 resume: str | None = None, export: str | None = None) -> dict:
    """Train to step ``steps``: from scratch, or from the checkpoint ``resume``; save a DCP
    checkpoint into ``folder`` after ``save_at`` steps; export the full model at the end."""
    model = build_sharded(seed)
    optimizer = make_optimizer(model.parameters())
    start = load_checkpoint(model, optimizer, resume) if resume else 0
    losses = []
    if save_at is not None and start <= save_at:
        losses += train_steps(model, optimizer, range(start, save_at), seed)
        save_checkpoint(model, optimizer, folder, save_at)
        start = save_at
    losses += train_steps(model, optimizer, range(start, steps), seed)
    if export:
        with gathers_for_shared_gpu():  # gloo's gathers of CUDA tensors (ranks sharing a GPU)
            export_full(model, export)
    return {"rank": rank, "start": start if resume else 0, "losses": losses}


def resume_demo(world_sizes=(1, 2, 4), steps: int = 6, save_at: int = 3,
                folder: str | Path | None = None, timeout: float = 300) -> list[dict]:
    """Train ``steps`` steps at 2 ranks, saving at ``save_at``; resume from that checkpoint at
    each of ``world_sizes``. One row per run: the losses of the steps after ``save_at``, the
    largest gap from the uninterrupted run's, and where its ranks computed (``ranks``: a GPU
    each with NCCL, several sharing the GPUs with gloo when there are fewer GPUs than ranks,
    or the CPU)."""
    from dpt.ranks import placement, run_distributed

    with tempfile.TemporaryDirectory(prefix="dcp-demo-") as tmp:
        ckpt = str(Path(folder or tmp) / f"step{save_at}")
        full = run_distributed(train_worker, world_size=2, timeout=timeout, echo=False,
                               kwargs={"steps": steps, "save_at": save_at, "folder": ckpt})
        base = full[0]["losses"][save_at:]
        rows = [{"run": "uninterrupted, 2 ranks", "losses": base, "max_gap": 0.0,
                 "ranks": placement(2).label}]
        for n in world_sizes:
            r = run_distributed(train_worker, world_size=n, timeout=timeout, echo=False,
                                kwargs={"steps": steps, "resume": ckpt})[0]
            rows.append({"run": f"resumed at step {r['start']}, {n} rank(s)",
                         "losses": r["losses"], "ranks": placement(n).label,
                         "max_gap": max(abs(a - b) for a, b in zip(r["losses"], base))})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks: 1, 2 or 4")
    ap.add_argument("--steps", type=int, default=6, help="train up to this step")
    ap.add_argument("--save-at", type=int, default=None, help="save a checkpoint at this step")
    ap.add_argument("--folder", default="dcp_checkpoint", help="where --save-at saves")
    ap.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    ap.add_argument("--export", default=None, help="write the full model to this file")
    ap.add_argument("--demo", action="store_true", help="save at 2 ranks, resume at 1, 2, 4")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    try:
        if args.nproc not in (1, 2, 4, 8):
            raise ValueError("--nproc must be 1, 2, 4 or 8 (it must divide the global batch)")
        if not 1 <= args.steps <= 10_000 or (args.save_at is not None
                                             and not 0 <= args.save_at <= args.steps):
            raise ValueError("--steps must be 1..10000 and --save-at at most --steps")
        if args.demo:
            for row in resume_demo(steps=args.steps, timeout=args.timeout):
                print(f"{row['run']:<28} losses {' '.join(f'{v:.5f}' for v in row['losses'])}"
                      f"   max gap {row['max_gap']:.1e}   ({row['ranks']})")
            return 0
        if args.resume:
            check_dcp_checkpoint(args.resume)  # before starting any rank
        from dpt.ranks import run_distributed

        results = run_distributed(
            train_worker, world_size=args.nproc, timeout=args.timeout, echo=False,
            kwargs={"steps": args.steps, "save_at": args.save_at, "folder": args.folder,
                    "resume": args.resume, "export": args.export})
    except (CheckpointError, ValueError, RuntimeError, OSError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    r0 = results[0]
    print(f"{args.nproc} rank(s), steps {r0['start']}..{args.steps}: losses "
          + " ".join(f"{v:.5f}" for v in r0["losses"]))
    if args.save_at is not None:
        print(f"checkpoint of step {args.save_at} in {args.folder}/")
    if args.export:
        print(f"full model for inference in {args.export}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
