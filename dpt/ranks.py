"""Run a function on N ranks, fail fast, never hang.

:func:`run_distributed` is the one way the course's tests (and some notebooks) start several
processes. It promises:

- a free port per call, never a fixed one, so parallel tests (``pytest -n 2``) do not collide;
  when another process takes it before rank 0 listens, every rank starts again on a new one;
- gloo on CPU, or NCCL with one GPU per rank when the machine has enough GPUs; with
  ``DPT_SHARE_GPU=1`` on a GPU machine, gloo with rank r on GPU ``r % device_count``, and
  the same (said in one line) when a GPU machine has fewer GPUs than ranks
  (:func:`placement`);
- one intra-op thread per rank by default, so ranks do not fight over the cores;
- when a rank raises or dies, the others are killed at once and :class:`RankFailure` carries
  that rank's traceback and the tail of its output (for a crash below Python, a segfault, the
  signal and the Python stack ``faulthandler`` wrote);
- a hard timeout: a hung rank is killed, and its Python stack is in the error.

``fn`` must be importable (defined at module level in a file), because the ranks are fresh
processes started by a fork server that has already imported torch.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dpt.device import SHARE_GPU_VAR, gpu_for, shares_gpu
from dpt.dist import find_free_port, port_taken

_CTX = None
# A free port found here (bind to port 0, release) is bound by rank 0 a moment later; another
# process can take it in between. Rank 0 then reports PORT_TAKEN before fn runs, and
# run_distributed starts every rank again on a new port, PORT_TRIES times at most.
PORT_TAKEN = "port taken"
PORT_TRIES = 3


class _PortTaken(Exception):
    pass



class RankFailure(RuntimeError):
    """A rank raised, died or hung. The message holds its traceback or stack.

    Where :func:`run_distributed` raises it, it also says what failed, for a one-line report
    (``dpt.errors.one_line``): ``rank`` and ``world_size`` (``rank`` None for a timeout, whose
    message names the ranks it waited for), ``kind`` (the exception's type name, None when the rank died or hung),
    ``message`` (the exception's message, or what happened: "hung and was stopped"),
    ``traceback`` (the rank's traceback, or its stack when it hung) and ``peers``: the other
    ranks that reported a failure too, as RankFailures.
    """

    def __init__(self, text: str, *, rank: int | None = None, world_size: int | None = None,
                 kind: str | None = None, message: str | None = None,
                 traceback: str | None = None, peers: list[RankFailure] | None = None) -> None:
        super().__init__(text)
        self.rank, self.world_size, self.kind = rank, world_size, kind
        self.message, self.traceback, self.peers = message, traceback, list(peers or [])


def _raised(exc: BaseException) -> tuple[str, str, str]:
    """What a rank sends when ``fn`` raised: its traceback, the exception's type and message."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a __str__ that fails must not hide the failure
        message = ""
    return traceback.format_exc(), type(exc).__name__, message


def process_context():
    """The multiprocessing context the ranks are started from: a fork server that has
    already imported torch (``DPT_MP_START`` picks another start method).

    For code that starts and watches its own processes, where :func:`run_distributed`'s
    rule (one rank dies, every rank is stopped) is not wanted: lesson 13's supervisor keeps
    the survivors of a death running and starts a replacement beside them.
    """
    return _context()


def _context():
    global _CTX
    if _CTX is None:
        method = os.environ.get("DPT_MP_START", "forkserver")
        _CTX = mp.get_context(method)
        if method == "forkserver":
            # torch._dynamo is imported by the first optimizer step and by DDP: seconds per rank.
            _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "dpt.dist"])
    return _CTX


def _nothing(rank: int, world_size: int) -> None:
    return None


def restart_fork_server() -> bool:
    """Start the ranks of the next :func:`run_distributed` calls from a new fork server.

    Every rank is a fork of the server, so every rank inherits its address-space layout, and
    a layout that happens to be slow (a buffer that aliases in the cache) is the same in every
    launch. A benchmark that restarts the server between rounds samples a new layout each
    round, and the spread shows in its interval instead of as a bias in every round. Waits
    until the new server has imported torch. False when the ranks are not forked from a
    server (``DPT_MP_START``) or this Python has no way to stop it.
    """
    import multiprocessing.forkserver as forkserver

    server = getattr(forkserver, "_forkserver", None)
    if _context().get_start_method() != "forkserver" or not hasattr(server, "_stop"):
        return False
    server._stop()
    run_distributed(_nothing, world_size=1, backend=None, timeout=120, echo=False)
    return True


class Placement(NamedTuple):
    """Where the ranks of one launch compute: ``backend``, ``device`` (``"cuda"`` or
    ``"cpu"``), whether several ranks share a GPU, and ``label``, the words a table or a
    figure that shows the run prints beside it."""

    backend: str
    device: str
    shared: bool
    label: str


def placement(world_size: int, backend: str | None = "auto") -> Placement:
    """Where :func:`run_distributed` puts ``world_size`` ranks started with ``backend``.

    ``"auto"``: NCCL with a GPU per rank when the machine has enough GPUs; on a GPU machine
    with fewer GPUs than ranks, gloo with rank r on GPU ``r % device_count`` (the ranks share
    the GPUs, as with ``DPT_SHARE_GPU=1``: NCCL refuses two ranks on one GPU, and the CPU
    would make one table mix GPU runs with CPU runs); gloo on the CPU without CUDA.
    ``DPT_TEST_BACKEND`` (gloo or nccl) overrides ``"auto"``: the test suite sets gloo, so its
    rank functions run on the CPU on every machine. An explicit ``"gloo"`` computes on the
    CPU unless ``DPT_SHARE_GPU=1`` (:func:`dpt.device.shares_gpu`).
    """
    if backend == "auto":
        forced = os.environ.get("DPT_TEST_BACKEND", "auto")
        backend = forced if forced not in ("", "auto") else None
        if backend is None:
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if gpus >= world_size and not shares_gpu():
                return Placement("nccl", "cuda", False, "nccl, a GPU per rank")
            if gpus:
                return Placement("gloo", "cuda", True,
                                 f"gloo, {world_size} rank(s) sharing {gpus} GPU(s)")
            return Placement("gloo", "cpu", False, "gloo (CPU)")
    if backend == "nccl":
        return Placement("nccl", "cuda", False, "nccl, a GPU per rank")
    if backend == "gloo" and shares_gpu():
        gpus = torch.cuda.device_count()
        return Placement("gloo", "cuda", True,
                         f"gloo, {world_size} rank(s) sharing {gpus} GPU(s)")
    if backend is None:
        return Placement("", "cpu", False, "its own process group")
    return Placement(backend, "cpu", False, f"{backend} (CPU)")


def default_backend(world_size: int) -> str:
    """``backend="auto"``: NCCL when there is a GPU per rank, gloo otherwise (on the shared
    GPUs of a GPU machine, else the CPU: :func:`placement`)."""
    return placement(world_size).backend


_SAID: set[tuple[int, int]] = set()


def _say_shared(world_size: int) -> None:
    """One line, once per process and size, when ``auto`` made ranks share the GPUs."""
    gpus = torch.cuda.device_count()
    if (world_size, gpus) in _SAID:
        return
    _SAID.add((world_size, gpus))
    print(f"note: {world_size} ranks on {gpus} GPU(s): NCCL needs a GPU per rank, so the ranks "
          f"share the GPUs with gloo (rank r on cuda:r % {gpus})", file=sys.stderr, flush=True)


def rank_cuda_device(rank: int, backend: str | None) -> torch.device | None:
    """The GPU rank ``rank`` is pinned to before it joins: its own under NCCL, its share under
    gloo when the ranks share the GPUs; None when it computes on the CPU (or joins itself)."""
    if backend == "nccl":
        return torch.device("cuda", rank)
    if backend == "gloo" and shares_gpu():
        return gpu_for(rank)
    return None


def _thread_lock_for_progress_bars() -> None:
    """tqdm's default lock is a multiprocessing semaphore; a rank leaves with ``os._exit``, so
    the resource tracker would warn at shutdown about a "leaked semaphore". A rank's bars
    only need a thread lock."""
    try:
        import threading

        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict,
            conn, backend: str | None, threads: int, log_path: str, stack_path: str,
            hang_after: float, env: dict[str, str]) -> None:
    # Everything this rank prints goes to its own log file, which the parent reads back.
    log = open(log_path, "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    stack_file = open(stack_path, "w")  # noqa: SIM115
    faulthandler.dump_traceback_later(hang_after, exit=True, file=stack_file)
    # A crash in C++ (a segfault in a collective, say) kills the rank before it can report:
    # its Python stack then goes to its log, which the parent shows.
    faulthandler.enable(file=log)
    os.environ.update(env)
    _thread_lock_for_progress_bars()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch.distributed as dist

    from dpt.dist import set_threads

    set_threads(threads)
    status, payload = "ok", None
    try:
        if backend is not None:
            gpu = rank_cuda_device(rank, backend)
            if gpu is not None:
                torch.cuda.set_device(gpu)
            try:
                dist.init_process_group(backend, rank=rank, world_size=world_size,
                                        timeout=timedelta(seconds=max(hang_after, 5)),
                                        device_id=gpu if backend == "nccl" else None)
            except Exception as exc:  # noqa: BLE001 - sorted below
                if rank == 0 and port_taken(exc):  # before fn ran: the parent tries a new port
                    status, payload = PORT_TAKEN, str(exc)
                raise
        result = fn(rank, world_size, *args, **kwargs)
        buf = io.BytesIO()
        torch.save(result, buf)
        payload = buf.getvalue()
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        if status != PORT_TAKEN:
            status, payload = "error", _raised(exc)
    try:
        conn.send((status, payload))
    finally:
        conn.close()
    faulthandler.cancel_dump_traceback_later()
    if status == "ok" and backend is not None and dist.is_initialized():
        dist.destroy_process_group()
    log.flush()
    os._exit(0 if status == "ok" else 1)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").rstrip()
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _other_errors(pending: dict, world_size: int, grace: float = 2.0) -> list[RankFailure]:
    """After a first failure, give the other ranks a moment to report theirs.

    When one rank raises, its peers often fail too, with a connection error in a collective;
    whichever report arrives first, the root cause is then in the message as well.
    """
    found, deadline = [], time.monotonic() + grace
    while pending and time.monotonic() < deadline:
        for conn in wait(list(pending), timeout=max(0.0, deadline - time.monotonic())):
            rank = pending.pop(conn)
            try:
                status, payload = conn.recv()
            except EOFError:
                continue
            if status == PORT_TAKEN:  # the first failure followed from it: start again
                raise _PortTaken(payload)
            if status == "error":
                text, kind, message = payload
                found.append(RankFailure(text, rank=rank, world_size=world_size, kind=kind,
                                         message=message, traceback=text))
    return found


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=2)


def run_distributed(fn: Callable, world_size: int = 2, args: tuple = (),
                    kwargs: dict | None = None, timeout: float = 90.0,
                    backend: str | None = "auto", threads: int = 1,
                    env: dict[str, str] | None = None, echo: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes.

    Returns the ranks' return values, in rank order. ``backend=None`` leaves the process
    group to ``fn`` (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE are set for it); ``"auto"``
    picks NCCL when there is a GPU per rank, gloo otherwise, on the GPUs of a GPU machine
    (said in one line) and on the CPU without one (:func:`placement`). The
    ranks see this process's ``DPT_SHARE_GPU`` as it is now (the fork server may have been
    started before it was set); ``env`` adds to, and overrides, their environment.
    """
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    env = {SHARE_GPU_VAR: os.environ.get(SHARE_GPU_VAR, ""), **(env or {})}
    if backend == "auto":
        where = placement(world_size)
        backend = where.backend
        if where.shared and not shares_gpu():  # more ranks than GPUs: they share them
            env = {**env, SHARE_GPU_VAR: "1"}
            _say_shared(world_size)
    for attempt in range(1, PORT_TRIES + 1):
        try:
            return _launch(fn, world_size, args, kwargs, timeout, backend, threads, env, echo,
                           find_free_port())
        except _PortTaken as exc:
            if attempt == PORT_TRIES:
                raise RankFailure(f"rank 0 could not listen on {PORT_TRIES} free ports in a "
                                  f"row (another program takes them): {exc}", rank=0,
                                  world_size=world_size, kind="DistNetworkError",
                                  message=str(exc)) from None


def _launch(fn: Callable, world_size: int, args: tuple, kwargs: dict | None, timeout: float,
            backend: str | None, threads: int, env: dict[str, str], echo: bool,
            port: int) -> list[Any]:
    """One start of :func:`run_distributed`'s ranks, rank 0 listening on ``port``."""
    ctx = _context()
    tmp = Path(tempfile.mkdtemp(prefix="dpt-ranks-"))
    hang_after = max(1.0, timeout - 1.5)  # ranks dump their stacks just before we give up
    procs, conns, logs, stacks = [], [], [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            log, stack = tmp / f"rank{rank}.log", tmp / f"rank{rank}.stack"
            p = ctx.Process(target=_worker, name=f"rank{rank}", daemon=True, args=(
                rank, world_size, port, fn, args, kwargs or {}, child_end, backend, threads,
                str(log), str(stack), hang_after, dict(env or {})))
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
            logs.append(log)
            stacks.append(stack)

        def _died(rank: int) -> RankFailure:
            """A rank ended without a result: it crashed, or hung and dumped its stack."""
            procs[rank].join(timeout=2)
            _kill(procs)
            stack = _tail(stacks[rank], 60)
            code = procs[rank].exitcode
            what = "hung and was stopped" if stack else (
                f"died with exit code {code} before reporting" + (
                    f" (killed by {signal.Signals(-code).name}: a crash below Python; its "
                    "Python stack, if any, is in its output)"
                    if code is not None and code < 0 and -code in signal.valid_signals()
                    else ""))
            why = f"{what}; its stack:\n{stack}" if stack else what
            return RankFailure(f"rank {rank} of {world_size} {why}\n"
                               f"--- rank {rank} output (last lines) ---\n{_tail(logs[rank], 60)}",
                               rank=rank, world_size=world_size, message=what,
                               traceback=stack or None)

        results: dict[int, Any] = {}
        pending = {c: r for r, c in enumerate(conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(procs)}
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = wait(list(pending) + list(sentinels), timeout=remaining)
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        status, payload = obj.recv()
                    except EOFError:
                        status, payload = "died", None
                    if status == "ok":
                        results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                        continue
                    if status == PORT_TAKEN:
                        _kill(procs)
                        raise _PortTaken(payload)
                    if status == "error":
                        text, kind, message = payload
                        try:
                            others = _other_errors(pending, world_size)
                        finally:
                            _kill(procs)
                        raise RankFailure(
                            f"rank {rank} of {world_size} failed:\n{text}\n"
                            f"--- rank {rank} output (last lines) ---\n{_tail(logs[rank])}"
                            + "".join(f"\n--- rank {o.rank} also failed ---\n{o}"
                                      for o in others),
                            rank=rank, world_size=world_size, kind=kind, message=message,
                            traceback=text, peers=others)
                    raise _died(rank)
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    if rank in results:
                        continue
                    conn = conns[rank]
                    if conn in pending and conn.poll(1.0):
                        continue  # it reported just before exiting; read it next round
                    raise _died(rank)
        if len(results) < world_size:
            _kill(procs)
            missing = [r for r in range(world_size) if r not in results]
            stacks_text = "\n".join(f"--- rank {r} stack ---\n{_tail(stacks[r], 60)}"
                                    for r in missing)
            what = f"timed out after {timeout:.0f}s waiting for rank(s) {missing}"
            raise RankFailure(f"{what}\n{stacks_text}", world_size=world_size, message=what,
                              traceback=stacks_text)
        if echo:
            for rank, log in enumerate(logs):
                text = _tail(log, 200)
                if text:
                    print(f"--- rank {rank} ---\n{text}")
        return [results[r] for r in range(world_size)]
    finally:
        _kill(procs)
        for c in conns:
            c.close()
        for f in tmp.iterdir():
            f.unlink(missing_ok=True)
        tmp.rmdir()
