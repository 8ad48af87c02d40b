"""Checkpoints that are written atomically and fail loudly when broken."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dpt.dist import get_rank, get_world_size


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


def exists_on_rank_0(path: str | os.PathLike) -> bool:
    """Whether ``path`` exists as rank 0 sees it, on every rank (collective: all ranks call it).

    Whether to resume is one decision for the whole job. Ranks that each looked for
    themselves could disagree (a snapshot written between two ranks' looks, a node whose disk
    lacks the file): they would start at different epochs and wait forever for each other.
    """
    rank, world_size = get_rank(), get_world_size()
    answer = [os.path.exists(path) if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(answer, src=0)
    return bool(answer[0])


def check_same_epoch(epoch: int, path: str | os.PathLike) -> None:
    """Collective: refuse, on every rank at once, a resume whose ranks read snapshots of
    different epochs (a node kept an old copy), which would train different numbers of epochs
    and wait forever for each other."""
    world_size = get_world_size()
    epochs = [epoch] * world_size
    if world_size > 1:
        dist.all_gather_object(epochs, epoch)
    if len(set(epochs)) > 1:
        raise CheckpointError(
            f"the ranks resumed from snapshots {path} of different epochs ({epochs}, in rank "
            "order): some node has an old copy; copy rank 0's snapshot to every node")


def dcp_problem(folder: str | os.PathLike) -> str | None:
    """What makes ``folder`` unreadable as a ``torch.distributed.checkpoint`` checkpoint, in
    one line, or None when it looks whole.

    ``dcp.save`` writes each rank's ``*.distcp`` files, then ``.metadata`` (the index of every
    tensor's bytes: file, offset, length) once they are all written. So a folder without
    ``.metadata`` is a save that did not finish, and a file shorter than the bytes the index
    lists is truncated (a full disk, a copy cut short).
    """
    folder = Path(folder)
    if not folder.exists():
        return f"checkpoint {folder} does not exist"
    if not folder.is_dir():
        return f"checkpoint {folder} is a file, not a dcp.save folder"
    if not (folder / ".metadata").is_file():
        shards = sorted(p.name for p in folder.glob("*.distcp"))
        return (f"checkpoint {folder} is partial: it has no .metadata (dcp.save writes it last, "
                f"so the save did not finish){'; shards: ' + ', '.join(shards) if shards else ''}")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a damaged index fails in many ways
        return (f"checkpoint {folder} has a corrupted .metadata ({type(exc).__name__}: "
                f"{(str(exc).splitlines() or [''])[0][:100]})")
    needed: dict[str, int] = {}  # file -> the bytes the index says it holds
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
            needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        path = folder / name
        if not path.is_file():
            return f"checkpoint {folder} is partial: {name} is missing (its .metadata lists it)"
        size = path.stat().st_size
        if size < end:
            return (f"checkpoint {folder} is truncated: {name} has {size} bytes, its .metadata "
                    f"lists {end}")
    return None


def check_dcp_checkpoint(folder: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` on every rank when the checkpoint is missing, partial or
    truncated (see :func:`dcp_problem`); collective: every rank calls it.

    The ranks compare what they see, so a folder one node lacks fails everywhere at once with
    one line, instead of one rank failing inside ``dcp.load`` while the others wait for it.
    """
    world_size = get_world_size()
    problem = dcp_problem(folder)
    if world_size > 1:
        problems: list = [None] * world_size
        dist.all_gather_object(problems, problem)
        bad = [(r, p) for r, p in enumerate(problems) if p]
        if bad:
            first_rank, problem = bad[0]
            if len(bad) < world_size:
                problem += f" (as rank {first_rank} sees it)"
    if problem:
        raise CheckpointError(problem)


@contextlib.contextmanager
def reading_checkpoint(folder: str | os.PathLike):
    """Turn a failure inside ``dcp.load`` (a damaged file that still has its length, a
    checkpoint of another model) into one :class:`CheckpointError` line naming ``folder``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        failures = getattr(exc, "failures", None) or {}
        first = next(iter(failures.values()), (exc, None))  # (exception, its traceback)
        cause = first[0] if isinstance(first, tuple) else first
        text = (str(cause).splitlines() or [""])[0][:160]
        raise CheckpointError(f"checkpoint {folder} could not be loaded "
                              f"({type(cause).__name__}: {text})") from exc
