"""Rank functions for lesson 09's FSDP2 and DCP tests (run by dpt.ranks.run_distributed).

Each check runs one task's code between the other tasks' references, the solution's own code
(tests/l09_fsdp/_references.py, generated from solutions/), so a task is graded on its own. A part that raises is returned as ``{"error": ...}`` (the same on every
rank, since the ranks run the same code), so the other parts of the same launch still run and
each test fails with its own task's message.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dpt.dist import rank_device
from dpt.memory import MemoryTracker
from dpt.models import TinyTransformer
from tests import references as refs
from tests.helpers import rank_part
from tests.lessons import load

LESSON = "09_fsdp"
# dcp's CheckpointException is a BaseException: caught by name where a part may raise it


def practice():
    return load(LESSON, "fsdp2_practice")


def checkpointing():
    return load(LESSON, "dcp_checkpoint")


_part = rank_part


# --- the reference pieces ------------------------------------------------------------------

def meta_model(fp) -> TinyTransformer:
    with torch.device("meta"):
        return TinyTransformer(**fp.CONFIG)


def ref(task: str):
    """The solution's code for ``task`` (tests/l09_fsdp/_references.py), in the lesson's module."""
    return refs.reference(LESSON, task)


def build(fp, seed: int = 0):
    """The model, sharded and initialised by the references of 09.17 and 09.19."""
    return ref("09.19")(ref("09.17")(meta_model(fp)), rank_device(), seed)


def train(fp, model, optimizer, steps, seed: int = 0, batch: int | None = None) -> list[float]:
    """The lesson's training step, on the slices of the reference of 09.20 (train_steps, the
    given loop, would use the student's) of global batches of ``batch`` (None: the lesson's)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rank_slice = ref("09.20")
    losses = []
    for step in steps:
        x, y = rank_slice(*fp.global_batch(step, seed, batch=batch or fp.GLOBAL_BATCH), rank,
                          world_size)
        optimizer.zero_grad(set_to_none=True)
        loss = fp.loss_fn(model(x.to(rank_device())), y.to(rank_device()))
        loss.backward()
        optimizer.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
    return losses


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name, as plain CPU tensors (collective)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for n, p in model.named_parameters()}


def full_adam(model, optimizer) -> dict[str, torch.Tensor]:
    """Adam's first moment of every parameter, whole, by name (collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    sd = get_optimizer_state_dict(model, optimizer,
                                  options=StateDictOptions(full_state_dict=True))
    return {n: st["exp_avg"].detach().cpu().clone() for n, st in sd["state"].items()
            if "exp_avg" in st}


def unsharded_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]


@contextmanager
def counting_collectives():
    """Count the all-gathers, and record the dtypes of the reduce-scatters, this rank issues
    (under whichever name this torch's FSDP2 calls them)."""
    seen = {"all_gather": 0, "reduce_dtypes": []}
    saved = {}

    def wrap(name, kind):
        real = getattr(dist, name)

        def spy(*args, **kwargs):
            if kind == "all_gather":
                seen["all_gather"] += 1
            else:
                tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
                if tensor is not None:
                    seen["reduce_dtypes"].append(str(tensor.dtype))
            return real(*args, **kwargs)

        saved[name] = real
        setattr(dist, name, spy)

    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            wrap(name, "all_gather")
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            wrap(name, "reduce")
    try:
        yield seen
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)


# --- 09.17-09.20 and the recipe -------------------------------------------------------------

def _units_check(fp):
    """Which modules are units, and which parameters are held whole after a forward."""
    out = {}
    for raf in (True, False):
        model = fp.shard_transformer(meta_model(fp), reshard_after_forward=raf)
        units = {"root": isinstance(model, FSDPModule)}
        units.update({f"blocks.{i}": isinstance(b, FSDPModule)
                      for i, b in enumerate(model.blocks)})
        ref("09.19")(model, rank_device())
        types = sorted({type(p).__name__ for p in model.parameters()})
        x, y = fp.global_batch(0)
        per = len(x) // dist.get_world_size()
        x, y = x[dist.get_rank() * per:][:per], y[dist.get_rank() * per:][:per]
        logits = model(x)
        held = unsharded_names(model)
        fp.loss_fn(logits, y).backward()
        out[f"raf={raf}"] = {"units": units, "types": types, "held": held}
    return out


def _fp32_check(fp, steps):
    model = fp.shard_transformer(meta_model(fp))
    ref("09.19")(model, rank_device())
    return {"losses": train(fp, model, fp.make_optimizer(model.parameters()), range(steps))}


def _bf16_check(fp, steps):
    """The dtype each block's weights have when it computes, the dtype the gradients are
    reduce-scattered in, the shards' dtype, and the losses (or the error training hit)."""
    model = fp.shard_transformer(meta_model(fp), bf16=True)
    ref("09.19")(model, rank_device())
    compute = {}
    for i, block in enumerate(model.blocks):  # the block's first layer, its weights gathered
        block.norm1.register_forward_pre_hook(
            lambda m, args, i=i, block=block: compute.__setitem__(
                f"blocks.{i}", str(block.qkv.weight.dtype)))
    optimizer = fp.make_optimizer(model.parameters())
    out = {"losses": None, "error": None}
    with counting_collectives() as seen:
        try:
            out["losses"] = train(fp, model, optimizer, range(steps))
        except RuntimeError as exc:  # e.g. "mat1 and mat2 must have the same dtype"
            out["error"] = (str(exc).splitlines() or [""])[0]
    out.update(compute=compute, reduce=sorted(set(seen["reduce_dtypes"])),
               master=sorted({str(p.dtype) for p in model.parameters()}))
    return {"bf16": out}


def _prefetch_check(fp, ahead):
    model = ref("09.17")(meta_model(fp))
    enabled = fp.set_prefetch(list(model.blocks), ahead=ahead)
    ref("09.19")(model, rank_device())
    counts = {}
    with counting_collectives() as seen:
        for i, block in enumerate(model.blocks):  # inside the block: after FSDP2's pre-forward
            block.norm1.register_forward_pre_hook(
                lambda m, args, i=i: counts.__setitem__(i, seen["all_gather"]))
        x, _ = fp.global_batch(0)
        for _ in range(2):  # the second forward, after the lazy initialisation
            seen["all_gather"] = 0
            model(x[:2]).sum().backward()
    return {"enabled": enabled, "counts": [counts[i] for i in range(len(model.blocks))]}


def _init_check(fp, seed):
    model = ref("09.17")(meta_model(fp))
    with MemoryTracker(rank_device().type) as mem:
        fp.materialize(model, rank_device(), seed)
    local = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters()
                if isinstance(p, DTensor))
    return {"peak": mem.peak, "local": local,
            "types": sorted({type(p).__name__ for p in model.parameters()}),
            "devices": sorted({str(p.device) for p in model.parameters()}),
            "full": full_params(model)}


def _slice_check(fp, steps):
    model = build(fp)
    return {"losses": fp.train_steps(model, fp.make_optimizer(model.parameters()), steps)}


def _recipe_check(fp, steps):
    with MemoryTracker(rank_device().type) as mem:
        model = fp.build_sharded(0)
    build_peak = mem.peak
    r = fp.practice_worker(dist.get_rank(), dist.get_world_size(), steps=steps)
    rb = fp.practice_worker(dist.get_rank(), dist.get_world_size(), steps=steps, bf16=True)
    del model
    return {"build_peak": build_peak, "losses": r["losses"], "bf16_losses": rb["losses"],
            "memory": r["memory"], "held_after_forward": r["held_after_forward"]}


def _by_hand_check(fp, steps):
    """The notebook's comparison: the hand-written FSDP through the same loop, fp32 and bf16."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return {"losses": fp.by_hand_worker(rank, world_size, steps=steps, peak=False)["losses"],
            "bf16_losses": fp.by_hand_worker(rank, world_size, steps=steps, bf16=True,
                                             peak=False)["losses"]}


def practice_checks(rank, world_size, steps=3, init_seed=3):
    """Every 09.17-09.20 check in one launch: each part graded by its own test."""
    fp = practice()
    out = {"units": _part(_units_check, fp), "fp32": _part(_fp32_check, fp, steps),
           "bf16": _part(_bf16_check, fp, steps),
           "prefetch": {a: _part(_prefetch_check, fp, a) for a in (0, 1, 2)},
           "init": _part(_init_check, fp, init_seed),
           "slice": _part(_slice_check, fp, steps),
           "recipe": _part(_recipe_check, fp, steps),
           "by_hand": _part(_by_hand_check, fp, steps)}
    if rank != 0 and isinstance(out["init"].get("full"), dict):
        out["init"]["full"] = None  # rank 0's copy is enough
    return out


# --- 09.21-09.23: DCP ----------------------------------------------------------------------

def dcp_save_run(rank, world_size, folder, reference, export, steps=6, save_at=3):
    """The uninterrupted run: reference model and loop; at ``save_at`` the lesson's save into
    ``folder`` and torch's into ``reference`` (what the model and Adam held then is returned),
    the lesson's export at the end."""
    fp, ck = practice(), checkpointing()
    model = build(fp)
    optimizer = fp.make_optimizer(model.parameters())
    losses = train(fp, model, optimizer, range(save_at))
    saved = {"params": full_params(model), "adam": full_adam(model, optimizer)}
    save = _part(ck.save_checkpoint, model, optimizer, folder, save_at)
    dist.barrier()
    ref("09.21")(model, optimizer, reference, save_at)  # what the resume tests load
    losses += train(fp, model, optimizer, range(save_at, steps))
    final = full_params(model)
    exported = _part(ck.export_full, model, export)
    if rank == 0 and not (isinstance(exported, dict) and "error" in exported):
        import os

        exported = {"exists": os.path.exists(export)}
        if exported["exists"]:
            state = torch.load(export, weights_only=False)  # may hold DTensors: inspect them
            exported.update(
                types=sorted({type(v).__name__ for v in state.values()}),
                devices=sorted({str(v.device) for v in state.values()
                                if isinstance(v, torch.Tensor)}),
                shapes={k: tuple(v.to_local().shape if isinstance(v, DTensor) else v.shape)
                        for k, v in state.items() if isinstance(v, torch.Tensor)})
    return {"losses": losses, "save": save, "exported": exported,
            "saved": saved if rank == 0 else None, "final": final if rank == 0 else None}


def dcp_resume_run(rank, world_size, folder, steps=6, broken=(), lesson_saved=None):
    """A fresh model (another seed, so only a real load gives the saved weights) loads the
    checkpoint with the lesson's load_checkpoint, then trains to ``steps``; then the lesson's
    load_checkpoint on each ``broken`` folder, whose error is returned."""
    fp, ck = practice(), checkpointing()
    model = build(fp, seed=7)
    optimizer = fp.make_optimizer(model.parameters())
    out = {}

    def resume():
        start = ck.load_checkpoint(model, optimizer, folder)
        loaded = {"params": full_params(model), "adam": full_adam(model, optimizer)}
        losses = train(fp, model, optimizer, range(int(start), steps))
        return {"start": start, "losses": losses, "loaded": loaded if rank == 0 else None}

    out["resume"] = _part(resume)
    errors = {}
    for bad in broken:
        try:
            ck.load_checkpoint(model, optimizer, bad)
            errors[bad] = None
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the finding
            errors[bad] = {"type": type(exc).__name__, "message": str(exc)}
        dist.barrier()
    out["broken"] = errors
    if lesson_saved:  # the lesson's own checkpoint, read back by torch's load
        out["read_back"] = read_back(rank, world_size, lesson_saved)
    return out


def read_back(rank, world_size, folder):
    """torch's own load of a checkpoint the lesson saved, into a model of another seed."""
    fp = practice()
    model = build(fp, seed=7)
    optimizer = fp.make_optimizer(model.parameters())

    def read():
        start = ref("09.22")(model, optimizer, folder)
        return {"start": start, "params": full_params(model),
                "adam": full_adam(model, optimizer)}

    result = _part(read)
    return result if rank == 0 or "error" in result else {}


# --- at 3 ranks: uneven shards (09.19, 09.21-09.23) --------------------------------------------

@contextmanager
def counting_saves():
    """Every ``torch.save`` this rank makes while inside (a list of where it wrote)."""
    writes: list[str] = []
    real = torch.save

    def spy(obj, f, *args, **kwargs):
        writes.append(str(getattr(f, "name", f)))
        return real(obj, f, *args, **kwargs)

    torch.save = spy
    try:
        yield writes
    finally:
        torch.save = real


def three_rank_checks(rank, world_size, folder, reference, export, init_seed=3):
    """One launch at 3 ranks, where most parameters' rows do not split evenly (64 rows: 22,
    22 and 20): the lesson's materialize, a save after one step (its layout is read by the
    test), a load of the 2-rank ``reference`` checkpoint, and an export, counting who writes."""
    fp, ck = practice(), checkpointing()
    out = {"init": _part(_init_check, fp, init_seed)}
    if rank != 0 and isinstance(out["init"].get("full"), dict):
        out["init"]["full"] = None
    model = build(fp)
    optimizer = fp.make_optimizer(model.parameters())
    # Adam's state exists: it is saved too (a global batch of 6 splits over 3 ranks)
    train(fp, model, optimizer, range(1), batch=2 * world_size)
    out["save"] = _part(ck.save_checkpoint, model, optimizer, folder, 1)
    dist.barrier()
    fresh = build(fp, seed=7)
    fresh_optimizer = fp.make_optimizer(fresh.parameters())

    def resume():
        start = ck.load_checkpoint(fresh, fresh_optimizer, reference)
        loaded = {"params": full_params(fresh), "adam": full_adam(fresh, fresh_optimizer)}
        return {"start": start, "loaded": loaded if rank == 0 else None}

    out["resume"] = _part(resume)
    with counting_saves() as writes:
        exported = _part(ck.export_full, model, export)
    error = exported.get("error") if isinstance(exported, dict) else None
    out["export"] = {"writes": writes, "error": error,
                     "trace": exported.get("trace", "") if error else ""}
    dist.barrier()
    if rank == 0 and out["export"]["error"] is None:
        import os

        if os.path.exists(export):
            state = torch.load(export, weights_only=False)
            out["export"]["shapes"] = {
                k: tuple(v.to_local().shape if isinstance(v, DTensor) else v.shape)
                for k, v in state.items() if isinstance(v, torch.Tensor)}
    return out
