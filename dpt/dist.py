"""Process-group plumbing every multi-process lesson shares.

Lessons 03, 04 and 06 join the group themselves (``dist.init_process_group``) after a
one-line :func:`preflight` (threads, GPU, the ranks' agreement on the backend); later lessons
and the tests join through :func:`setup`, which chooses the device and backend too and joins.
Both run the same sequence before the join (:func:`_before_joining`). Nothing in this module
hard-codes a port.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dpt.device import (
    backend_for,
    gpu_for,
    mps_note,
    pick_device,
    shares_gpu,
)

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


def port_taken(exc: BaseException) -> bool:
    """Whether joining a process group failed because rank 0 could not listen on its port
    (another process took the free port :func:`find_free_port` found before rank 0 bound it)."""
    text = str(exc).lower()
    return "failed to listen" in text or "address already in use" in text or "eaddrinuse" in text


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
    CUDA, process ``local_rank`` of a machine uses its GPU ``local_rank`` (with
    ``DPT_SHARE_GPU=1``: GPU ``local_rank % device_count``, under gloo, see
    :func:`shares_gpu`); the CPU threads are split among the ``local_world_size`` processes of
    the machine. MASTER_ADDR defaults to localhost; MASTER_PORT must have been chosen by the
    launcher, one port for every rank. Before the group is made, the ranks check that they
    all chose the same backend (:func:`agree_on_backend`): a node without a GPU among GPU
    nodes is one clear error on every rank, not a hang.
    """
    rank = env_int("RANK") if rank is None else rank
    world_size = env_int("WORLD_SIZE") if world_size is None else world_size
    local_rank = env_int("LOCAL_RANK", rank) if local_rank is None else local_rank
    local_world = local_world_size or env_int("LOCAL_WORLD_SIZE", world_size)
    dev = pick_device(device, distributed=True)
    if dev.type == "cuda":
        dev = gpu_for(local_rank)
    backend = backend_for(dev)
    store = _before_joining(rank, world_size, local_rank, local_world, dev, backend, threads,
                            timeout_s)
    if store is None:  # already in a group
        return dev
    # as init_process_group("env://") would do with the store it makes itself
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s),
                            device_id=dev if backend == "nccl" else None)
    return dev


def _before_joining(rank: int, world_size: int, local_rank: int, local_world_size: int,
                    device: torch.device, backend: str, threads: int | None,
                    timeout_s: float) -> dist.Store | None:
    """The join sequence up to ``init_process_group``, for :func:`setup` and :func:`preflight`.

    Rank 0 says what MPS lacks; this process gets ``threads`` CPU threads (by default its share
    of the cores among the ``local_world_size`` processes of this machine), LOCAL_RANK is set
    and the rendezvous address checked; ``device``, a GPU, becomes the current one. Then, unless
    this process is in a group already (the result is None), the ranks meet on the store at
    MASTER_ADDR:MASTER_PORT (:func:`rendezvous_store`) and check they all chose ``backend``
    (:func:`agree_on_backend`); the store is returned, for ``init_process_group``.
    """
    device = torch.device(device)
    note = mps_note(device) if rank == 0 else None
    if note:
        print(note, flush=True)
    set_threads(threads or threads_per_rank(local_world_size))
    os.environ["LOCAL_RANK"] = str(local_rank)  # as torchrun would (mp.spawn does not)
    if "MASTER_PORT" not in os.environ:
        raise LaunchError("MASTER_PORT is not set: the launcher must choose one port for all "
                          "ranks (dpt.dist.find_free_port() gives a free one)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return None
    store = rendezvous_store(rank, world_size, timeout_s)
    agree_on_backend(store, rank, world_size, backend, device)
    return store


_PREFLIGHT_STORE: list = []  # rank 0's store, alive until init_process_group reuses it


def preflight(args, rank: int, world_size: int, local_rank: int, local_world_size: int,
              device: torch.device, backend: str) -> None:
    """What a rank does right before its own ``dist.init_process_group(backend, ...)``.

    This process gets its share of the CPU threads (``args.threads``, or the cores split among
    the ``local_world_size`` processes of this machine), its GPU is made the current one, and
    the ranks check that they all chose the same backend (:func:`agree_on_backend`): a node
    without a GPU among GPU nodes is one clear error on every rank instead of a hang. They meet
    on the store at MASTER_ADDR:MASTER_PORT that ``init_process_group`` then uses too (rank 0
    keeps it open; a TCPStore on the same port in the same process is shared).
    """
    _PREFLIGHT_STORE[:] = [_before_joining(rank, world_size, local_rank, local_world_size,
                                           device, backend, getattr(args, "threads", None),
                                           getattr(args, "timeout", DEFAULT_TIMEOUT_S))]


def rendezvous_store(rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S
                     ) -> dist.Store:
    """The store at MASTER_ADDR:MASTER_PORT that ``init_process_group("env://")`` would make.

    Rank 0 hosts it (or, under torchrun, its agent does); the other ranks connect to it.
    Pass it to :func:`agree_on_backend`, then to ``init_process_group`` as
    ``store=dist.PrefixStore("default_pg", store)``: the group then meets on the same port.
    A port another program holds fails here on rank 0 ("failed to listen").
    """
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return store


_AGREEMENTS = [0]  # how many times this process has agreed: a key space per round


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'; [3] -> 'rank 3'."""
    spans, first = [], ranks[0]
    for prev, cur in zip(ranks, [*ranks[1:], None]):
        if cur != prev + 1:
            spans.append(str(first) if first == prev else f"{first}-{prev}")
            first = cur
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def _what_they_use(backend: str, device_types: set[str], many: bool) -> str:
    s = "" if many else "s"
    if backend == "nccl":
        return f"use{s} NCCL on {'GPUs' if many else 'a GPU'}"
    if device_types == {"cpu"}:
        return f"run{s} on the CPU with gloo (no GPU there, or --device cpu)"
    if device_types == {"cuda"}:
        return f"share{s} GPUs with gloo (DPT_SHARE_GPU=1)"
    return f"use{s} {backend}"


def backend_mismatch(choices: dict[int, tuple[str, str]]) -> str | None:
    """One line naming which ranks chose which backend, or None when they all agree.

    ``choices`` maps each rank to its (backend, device type).
    """
    by_backend: dict[str, list[int]] = {}
    for rank in sorted(choices):
        by_backend.setdefault(choices[rank][0], []).append(rank)
    if len(by_backend) < 2:
        return None
    groups = sorted(by_backend.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    parts = [f"{_ranks_text(ranks)} "
             + _what_they_use(backend, {choices[r][1] for r in ranks}, len(ranks) > 1)
             for backend, ranks in groups]
    hint = "pass --device cpu on every node, or give every node a GPU"
    if any(choices[r] == ("gloo", "cuda") for r in choices):
        hint += ", and set DPT_SHARE_GPU the same on every node"
    # the minority first, as in "rank 2 runs on the CPU while ranks 0-1 use NCCL"
    return (f"the ranks disagree on the backend: {' while '.join(reversed(parts))}; they must "
            f"all use the same one: {hint}")


def agree_on_backend(store: dist.Store, rank: int, world_size: int, backend: str,
                     device: torch.device | str, grace_s: float = 10.0) -> None:
    """Check, before joining, that every rank chose the same backend; raise if not.

    With ``--device auto`` each machine picks its own device, so a node without a GPU would
    join with gloo while the others use NCCL: a hang, or an obscure failure inside the first
    collective. Here each rank writes its (backend, device type) to ``store`` (from
    :func:`rendezvous_store`) and reads everyone's; a mismatch raises :class:`LaunchError`
    on every rank, with one line naming which ranks use which. Before raising, a rank waits
    (at most ``grace_s`` seconds) until every rank has read the choices, so that no rank
    loses the store (hosted by rank 0) before it knows why. Waits for missing ranks as long
    as the store's timeout.
    """
    _AGREEMENTS[0] += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's store outlives us
    space = dist.PrefixStore(f"dpt_backend/{restart}/{_AGREEMENTS[0]}/", store)
    space.set(str(rank), f"{backend} {torch.device(device).type}")
    keys = [str(r) for r in range(world_size)]
    space.wait(keys)
    values = (space.multi_get(keys) if hasattr(space, "multi_get")  # one round trip
              else [space.get(key) for key in keys])
    choices = {r: tuple(value.decode().split()) for r, value in enumerate(values)}
    problem = backend_mismatch(choices)
    if problem is None:
        return
    done = space.add("read", 1)  # the last rank to read learns it here, with no more calls
    deadline = time.monotonic() + grace_s
    while done < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            done = space.add("read", 0)
        except (RuntimeError, OSError):  # the store's host left: it saw every rank had read
            break
    raise LaunchError(problem)


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
    (``torch.cuda.set_device(local_rank)``). Under gloo with ranks sharing the GPUs
    (``DPT_SHARE_GPU=1``, :func:`shares_gpu`), local rank r's GPU ``r % device_count``. Under
    gloo otherwise, or outside a process group, the CPU. Rank functions call this instead of
    assuming a device.
    """
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        if shares_gpu():
            return gpu_for(env_int("LOCAL_RANK", dist.get_rank()))
    return torch.device("cpu")


def device_mesh():
    """A 1-D DeviceMesh over every rank, on :func:`rank_device`'s device type.

    FSDP2's ``fully_shard`` without a mesh takes the machine's accelerator (``cuda`` wherever a
    GPU is visible), whatever the process group's backend: gloo ranks on a GPU machine would
    then shard onto GPU 0. Passing this mesh keeps the shards where the rank computes.
    """
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(rank_device().type, (dist.get_world_size(),))


def gathers_for_shared_gpu(force: bool = False):
    """A context for gathering DTensors (``full_tensor``, ``get_model_state_dict`` with
    ``full_state_dict=True``) while ranks share a GPU over gloo; a no-op otherwise.

    DTensor gathers with the functional ``all_gather_into_tensor``, which gloo runs as a
    coalesced all-gather with no CUDA path: gloo copies from the device pointer as if it were
    host memory and the rank dies of SIGSEGV (torch 2.11 on an H200, lessons 08 and 09). Its
    ``_out`` form runs gloo's plain all-gather, which stages CUDA tensors through host memory,
    as FSDP2's own gathers do. Inside this context every such gather of a CUDA tensor takes
    that form. ``force``: on every device (a test on the CPU).
    """
    if not (force or shares_gpu()):
        return contextlib.nullcontext()
    from torch.utils._python_dispatch import TorchDispatchMode

    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    gather_out = torch.ops._c10d_functional.all_gather_into_tensor_out.default

    class _StagedGathers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is gather and (force or args[0].is_cuda):
                inp, group_size, group_name = args
                out = inp.new_empty((inp.shape[0] * group_size, *inp.shape[1:]) if inp.dim()
                                    else (group_size,))
                return gather_out(inp, group_size, group_name, out=out)
            return func(*args, **(kwargs or {}))

    return _StagedGathers()


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
