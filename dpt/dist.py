"""Process-group plumbing every multi-process lesson shares.

Lessons 03 and 04 join the group through :func:`setup` (what they teach is who each process
is: its global rank, and where that comes from); later lessons call it too. Nothing in this
module hard-codes a port.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dpt.device import DeviceError, backend_for, mps_note, pick_device

DEFAULT_TIMEOUT_S = float(os.environ.get("DPT_DIST_TIMEOUT", "120"))


class LaunchError(ValueError):
    """The job, as launched, cannot run: bad ranks, no shared port, not started by torchrun."""


@dataclass(frozen=True)
class TorchrunEnv:
    """Who a process started by torchrun is (lesson 04's ``torchrun_env`` reads it)."""

    rank: int  # global rank: 0 .. world_size-1 across every node
    local_rank: int  # rank on this machine: which GPU to use
    world_size: int  # processes in the whole job
    local_world_size: int  # processes on this machine (they share its CPU cores)
    restart_count: int  # 0 on the first attempt, then 1, 2, ... after each elastic restart


def find_free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a port nobody is listening on (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_budget() -> int:
    """Cores this process may use (respects taskset/cgroups where Python can see them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def threads_per_rank(local_world_size: int, cores: int | None = None) -> int:
    """Split the cores among the ranks on this machine, at least one thread each."""
    cores = cores or cpu_budget()
    return max(1, cores // max(1, local_world_size))


def set_threads(n: int) -> int:
    """Give this process ``n`` intra-op threads, so N ranks do not oversubscribe the CPU.

    Also exports OMP_NUM_THREADS/MKL_NUM_THREADS for any child this process starts.
    """
    n = max(1, int(n))
    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # may only be set before any parallel work
        torch.set_num_interop_threads(n)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    return n


def pin_rank(local_rank: int, local_world_size: int, threads: int) -> list[int] | None:
    """Bind this rank, and every thread it has or will start, to cores of its own.

    Rank r gets cores [r*t, (r+1)*t) of those this process may use, t threads per rank, as
    torch's CPU launcher does (``python -m torch.backends.xeon.run_cpu``). Left alone, the OS
    moves threads between cores: a rank's gloo threads, waking to send its gradients, can land
    on the other rank's core and stall its compute, and a synchronous step then waits for it.
    Returns the cores, or None where it does not pin: more threads than cores, or no
    ``sched_setaffinity`` (macOS, Windows).
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if local_world_size * threads > len(allowed):
        return None
    mine = allowed[local_rank * threads:(local_rank + 1) * threads]
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]  # gloo's threads exist already
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mine)
        except OSError:  # a thread that has just ended
            pass
    return mine


def env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise LaunchError(f"{name} is not set; launch this script with torchrun")
        return default
    return int(value)


def setup(rank: int | None = None, world_size: int | None = None, local_rank: int | None = None,
          device: str | torch.device | None = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
          threads: int | None = None, local_world_size: int | None = None) -> torch.device:
    """Join the process group and return this rank's device.

    Missing arguments come from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE). The backend follows the device (NCCL for CUDA, gloo otherwise); on
    CUDA, process ``local_rank`` of a machine uses its GPU ``local_rank``; the CPU threads are
    split among the ``local_world_size`` processes of the machine. MASTER_ADDR defaults to
    localhost; MASTER_PORT must have been chosen by the launcher, one port for every rank.
    """
    rank = env_int("RANK") if rank is None else rank
    world_size = env_int("WORLD_SIZE") if world_size is None else world_size
    local_rank = env_int("LOCAL_RANK", rank) if local_rank is None else local_rank
    local_world = local_world_size or env_int("LOCAL_WORLD_SIZE", world_size)
    dev = pick_device(device, distributed=True)
    note = mps_note(dev) if rank == 0 else None
    if note:
        print(note, flush=True)
    if dev.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise DeviceError(f"local rank {local_rank} needs GPU {local_rank}, but this machine "
                              f"has {torch.cuda.device_count()}; start fewer processes per node")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    set_threads(threads or threads_per_rank(local_world))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))  # as torchrun would (mp.spawn does not)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        raise LaunchError("MASTER_PORT is not set: the launcher must choose one port for all "
                          "ranks (dpt.dist.find_free_port() gives a free one)")
    if not dist.is_initialized():
        dist.init_process_group(backend_for(dev), rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
    return dev


def cleanup() -> None:
    """Leave the process group if we are in one (safe to call twice, or after a failure)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(**kwargs):
    """``with process_group(...) as device:`` sets up, and tears down even on an exception."""
    device = setup(**kwargs)
    try:
        yield device
    finally:
        cleanup()


@contextlib.contextmanager
def group_of_one(device: str | torch.device = "cpu"):
    """``with group_of_one(device):`` this process alone is a whole job (rank 0 of 1).

    For code written for DDP (a ``Trainer`` that wraps its model) run in one process: no
    launcher, no port (an in-memory store). Inside an existing group it does nothing.
    """
    if dist.is_initialized():
        yield
        return
    dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        cleanup()


def rank_device() -> torch.device:
    """The device this rank's tensors and modules belong on, decided in one place.

    Under NCCL, which takes only CUDA tensors, the GPU this process was pinned to
    (``torch.cuda.set_device(local_rank)``); under gloo, or outside a process group, the CPU.
    Rank functions call this instead of assuming a device.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_mesh():
    """A 1-D DeviceMesh over every rank, on :func:`rank_device`'s device type.

    FSDP2's ``fully_shard`` without a mesh takes the machine's accelerator (``cuda`` wherever a
    GPU is visible), whatever the process group's backend: gloo ranks on a GPU machine would
    then shard onto GPU 0. Passing this mesh keeps the shards where the rank computes.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(rank_device().type, (dist.get_world_size(),))


def get_rank() -> int:
    """This process's rank, or 0 outside a process group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The number of ranks, or 1 outside a process group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    """Wait for every rank; nothing to wait for outside a process group."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def is_main_process() -> bool:
    return get_rank() == 0


def rank0_print(*args, **kwargs) -> None:
    if is_main_process():
        print(*args, **kwargs, flush=True)
