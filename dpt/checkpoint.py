"""Checkpoints that are written atomically and fail loudly when broken."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message says which file and why."""


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """Save to a temporary file in the same folder, then rename over ``path``.

    A crash mid-save leaves the previous file intact: the rename is atomic on POSIX.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise CheckpointError(f"cannot save checkpoint {path}: folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """``torch.load`` with a clear error for a missing, truncated or foreign file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds on bad files
        raise CheckpointError(
            f"checkpoint {path} is corrupted or not a torch checkpoint "
            f"({type(exc).__name__}: "
            f"{(str(exc).splitlines() or ['empty or truncated file'])[0][:120]})") from exc


def strip_module_prefix(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop the ``module.`` that DataParallel/DDP wrappers add to every key."""
    prefix = "module."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state_dict.items()}


def _world() -> tuple[int, int]:
    """``(rank, world size)`` in the process group, ``(0, 1)`` outside one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def exists_on_rank_0(path: str | os.PathLike) -> bool:
    """Whether ``path`` exists as rank 0 sees it, on every rank (collective: all ranks call it).

    Whether to resume is one decision for the whole job. Ranks that each looked for
    themselves could disagree (a snapshot written between two ranks' looks, a node whose disk
    lacks the file): they would start at different epochs and wait forever for each other.
    """
    rank, world_size = _world()
    answer = [os.path.exists(path) if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(answer, src=0)
    return bool(answer[0])


def check_same_epoch(epoch: int, path: str | os.PathLike) -> None:
    """Collective: refuse, on every rank at once, a resume whose ranks read snapshots of
    different epochs (a node kept an old copy), which would train different numbers of epochs
    and wait forever for each other."""
    _, world_size = _world()
    epochs = [epoch] * world_size
    if world_size > 1:
        dist.all_gather_object(epochs, epoch)
    if len(set(epochs)) > 1:
        raise CheckpointError(
            f"the ranks resumed from snapshots {path} of different epochs ({epochs}, in rank "
            "order): some node has an old copy; copy rank 0's snapshot to every node")
