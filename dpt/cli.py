"""The command line every training lesson shares: flags, checks, and one ``error:`` line.

Lessons 01-04 build their parser with :func:`parser`, check it with :func:`validate` and run
through :func:`main`, so a bad flag, missing data, a device the machine lacks or a broken
checkpoint end the same way everywhere: one line ``error: ...`` on stderr and exit code 2.
The progress bar and ``--limit-batches`` (:func:`batches`), the line a script prints before it
trains (:func:`describe`) and the checks around lesson 03's ``mp.spawn`` (``-n/-g/-nr``, the
rendezvous address, a free port: :func:`with_free_port`) live here too;
lesson 06's ``--precision`` is checked here as well (its values and rules are in
``dpt.precision``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from dpt.checkpoint import CheckpointError
from dpt.data import MNIST, DataError, add_dataset_argument, check_batch_size
from dpt.device import DEVICE_CHOICES, DeviceError, pick_device, shares_gpu
from dpt.dist import DEFAULT_TIMEOUT_S, LaunchError, find_free_port, port_taken
from dpt.errors import one_line, report_error
from dpt.models import MODELS
from dpt.precision import check_request
from dpt.ranks import RankFailure

__all__ = ["LaunchError", "batches", "describe", "main", "parser", "timed", "validate",
           "with_free_port"]


EXPECTED = (ValueError, DataError, DeviceError, CheckpointError)
POSITIVE = ("epochs", "limit_batches", "train_limit", "test_limit", "threads", "save_every")


def parser(description: str, *, epochs: int = 1, per_rank: bool = False
           ) -> argparse.ArgumentParser:
    """The flags every training lesson takes; a lesson adds its own to the result."""
    p = argparse.ArgumentParser(description=description)
    add_dataset_argument(p, default=MNIST)  # as the tutorials these lessons follow
    p.add_argument("--model", default="convnet", choices=sorted(MODELS))
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch-size", type=int, default=64,
                   help="per rank" if per_rank else "samples per step")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    p.add_argument("--limit-batches", type=int, default=None,
                   help="train on at most this many batches per epoch (quick runs)")
    p.add_argument("--train-limit", type=int, default=None, help="use the first N train samples")
    p.add_argument("--test-limit", type=int, default=None, help="use the first N test samples")
    p.add_argument("--save-every", type=int, default=1,
                   help="epochs between " + ("snapshots" if epochs > 1 else "checkpoints"))
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads" + (" per rank" if per_rank else " (default: all cores)"))
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels (cuDNN/cuBLAS), for bit-exact reruns on GPUs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    if per_rank:
        p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help="seconds to wait for the other processes (connect, collectives)")
    return p


def validate(args: argparse.Namespace) -> None:
    """Turn bad input into one clear exception before any work starts."""
    check_batch_size(args.batch_size)
    for name in POSITIVE:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for flag in ("checkpoint", "snapshot"):
        path = getattr(args, flag, None)
        if path and not Path(path).parent.is_dir():
            raise CheckpointError(f"cannot write {flag} {path}: folder {Path(path).parent} "
                                  "does not exist")
    if getattr(args, "timeout", 1) <= 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    if getattr(args, "precision", None) is not None:  # lesson 06 (dpt.precision)
        check_request(args.precision, getattr(args, "device", "auto"))
    if (getattr(args, "clip", None) or 0) < 0:
        raise ValueError(f"--clip (the largest gradient norm) must be positive, or 0 for no "
                         f"clipping; got {args.clip}")


def positive_ints(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers of at least 1 (``"1,8,32"``)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers of at least 1, got {text!r}")
    return values


def check_averaging_ranks(nproc: int) -> None:
    """One rank has nothing to average with: refuse ``--nproc`` below 2 in one line."""
    if nproc < 2:
        raise ValueError(f"--nproc must be at least 2 (one rank has nothing to average), "
                         f"got {nproc}")


def deterministic(on: bool = True) -> None:
    """Ask torch for deterministic kernels: cuDNN picks none of its nondeterministic
    algorithms, cuBLAS gets a fixed workspace. The CPU kernels used here already are."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def main(run: Callable[[argparse.Namespace], object], p: argparse.ArgumentParser,
         argv: list[str] | None = None) -> int:
    """Parse, validate, run; expected failures become ``error: ...`` and exit code 2."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        old = [a for a in argv if a.split("=")[0] in ("--local_rank", "--local-rank")]
        if old:
            raise LaunchError(f"{old[0].split('=')[0]} is the old torch.distributed.launch "
                              "argument; this script reads LOCAL_RANK from the environment: "
                              "launch it with torchrun")
        args = p.parse_args(argv)
        validate(args)
        run(args)
    except (RankFailure, *EXPECTED, dist.DistError) as exc:  # RankFailure: amp_inspect's ranks
        return report_error(exc)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


# ------------------------------------------------------------------ around the Trainer


def batches(loader, limit: int | None, desc: str, show: bool,
            every_rank: bool = False) -> Iterable:
    """The batches of one epoch: the first ``limit`` (``--limit-batches``), or all of them,
    behind a progress bar when ``show``. In a process group only rank 0 draws it (one bar per
    job: the ranks share a terminal, and their bars would overwrite each other on one line),
    unless ``every_rank``."""
    steps = len(loader) if limit is None else min(limit, len(loader))
    mine = every_rank or not dist.is_initialized() or dist.get_rank() == 0
    return tqdm(islice(loader, steps), total=steps, leave=False, desc=desc,
                disable=not (show and mine))


def describe(args: argparse.Namespace, device: torch.device) -> str:
    """The line a training script prints before it starts: what trains where, and how."""
    if dist.is_initialized():
        return (f"training {args.model} on {args.dataset}: world size "
                f"{dist.get_world_size()}, backend {dist.get_backend()}, {device}, "
                f"{torch.get_num_threads()} thread(s) and batch {args.batch_size} per rank")
    return (f"training {args.model} on {args.dataset} on {device} "
            f"({torch.get_num_threads()} threads, batch {args.batch_size})")


def timed(fn: Callable, *args) -> float:
    """Seconds ``fn(*args)`` took."""
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


@contextlib.contextmanager
def rank_errors(who: str):
    """In a process started by ``mp.spawn``: an expected failure prints one line naming the
    rank and exits 2, which :func:`spawn` passes on (instead of a pickled traceback)."""
    try:
        yield
    except (*EXPECTED, dist.DistError) as exc:
        if os.environ.get(_PORT_CHOSEN) == "1" and port_taken(exc):
            sys.exit(PORT_TAKEN)  # the launcher picked this port: it picks another and retries
        print(f"error: {who}: {one_line(exc)}", file=sys.stderr, flush=True)
        sys.exit(2)


# A free port found in the launcher (bind to port 0, release) is bound by rank 0 a few seconds
# later; another process can take it in between. Only for a port it chose itself, the launcher
# then starts again on a new one (a port the user gave is never changed).
PORT_TAKEN = 3
_PORT_CHOSEN = "DPT_PORT_CHOSEN"
PORT_TRIES = 3


# ------------------------------------------------------------------ lesson 03: mp.spawn


def add_spawn_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("-n", "--nodes", type=int, default=1, help="machines in the job")
    p.add_argument("-g", "--gpus", type=int, default=2,
                   help="processes to start on this machine (one per GPU, or CPU ranks)")
    p.add_argument("-nr", "--nr", type=int, default=0, help="this machine's rank, 0..nodes-1")
    p.add_argument("--master-addr", default=None,
                   help="address of node 0 (default: $MASTER_ADDR; on node 0, 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help="port on node 0 (default: $MASTER_PORT; on one node, a free port)")
    return p


def check_launch(nodes: int, procs_per_node: int, node_rank: int, device: str = "auto") -> int:
    """Refuse a launch that cannot work, with one sentence; return the world size.

    On a machine with GPUs, ``auto`` means one GPU per process too, so ``-g 2`` on one GPU is
    refused here, before any process starts, rather than late in rank 1; unless the ranks
    share the GPUs (``DPT_SHARE_GPU=1``, ``dpt.device.shares_gpu``: gloo, several per GPU).
    """
    if nodes < 1:
        raise LaunchError(f"--nodes must be at least 1, got {nodes}")
    if procs_per_node < 1:
        raise LaunchError(f"--gpus (processes per node) must be at least 1, got {procs_per_node}")
    if not 0 <= node_rank < nodes:
        raise LaunchError(f"node rank -nr {node_rank} is out of range: with --nodes {nodes} "
                          f"it must be 0..{nodes - 1}")
    if pick_device(device, distributed=True).type == "cuda" and not shares_gpu():
        gpus = torch.cuda.device_count()
        if procs_per_node > gpus:
            raise DeviceError(f"-g {procs_per_node} processes on this machine's {gpus} GPU(s): "
                              f"one GPU per process, so use -g {gpus} or fewer, or --device cpu "
                              "(or DPT_SHARE_GPU=1: ranks share the GPUs, with gloo)")
    return nodes * procs_per_node


def resolve_master(args: argparse.Namespace) -> tuple[str, int]:
    """Where rank 0 listens. One node may pick a free port; several must agree on one, and
    every node but node 0 must be told node 0's address (node 0 may default to itself)."""
    addr = args.master_addr or os.environ.get("MASTER_ADDR")
    port = args.master_port or os.environ.get("MASTER_PORT")
    if port is None:
        if args.nodes > 1:
            raise LaunchError("with --nodes > 1, give every node the same --master-port "
                              "(or MASTER_PORT), and --master-addr of node 0")
        port = find_free_port()
    if not addr:
        if args.nodes > 1 and args.nr > 0:
            raise LaunchError(f"with --nodes {args.nodes}, node {args.nr} must be told where "
                              "node 0 is: --master-addr ADDR (or MASTER_ADDR); 127.0.0.1 "
                              "would wait for a rendezvous on this machine itself")
        addr = "127.0.0.1"
    if not 0 < int(port) < 65536:
        raise LaunchError(f"--master-port must be 1..65535, got {port}")
    return addr, int(port)


def _guarded(local_rank: int, fn: Callable, args: argparse.Namespace) -> None:
    with rank_errors(f"process {local_rank} of node {args.nr}"):
        fn(local_rank, args)


def _port_taken(exc: BaseException) -> bool:
    """Whether a spawned process failed because rank 0 could not listen on the port."""
    import torch.multiprocessing as mp

    if isinstance(exc, mp.ProcessExitedException):
        return exc.exit_code == PORT_TAKEN
    return port_taken(exc)


def with_free_port(launch: Callable[[argparse.Namespace], object]
                   ) -> Callable[[argparse.Namespace], None]:
    """Lesson 03's launch (``launch(args)`` sets MASTER_ADDR/MASTER_PORT and calls
    ``mp.spawn``), with the checks and the polish around it.

    Before: the layout is checked (:func:`check_launch`), ``args.master_addr`` and
    ``args.master_port`` are filled in (:func:`resolve_master`: on one node a free port), and
    one line says which ranks start where. After: a process that failed becomes one
    ``error:`` line naming it. A free port found here is bound by rank 0 seconds later, and
    another program can take it in between: only for a port chosen here, ``launch`` then runs
    again on a new one (a port the user gave is never changed).
    """
    import torch.multiprocessing as mp

    def launcher(args: argparse.Namespace) -> None:
        world_size = check_launch(args.nodes, args.gpus, args.nr, args.device)
        chosen = args.master_port is None and "MASTER_PORT" not in os.environ
        args.master_addr, args.master_port = resolve_master(args)
        os.environ[_PORT_CHOSEN] = "1" if chosen else "0"
        # c10d's C++ retry warnings (with stack frames) would bury the one-line errors.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        first = args.nr * args.gpus
        print(f"node {args.nr} of {args.nodes}: starting {args.gpus} process(es), global ranks "
              f"{first}..{first + args.gpus - 1} of {world_size}; rendezvous at "
              f"{args.master_addr}:{args.master_port}", flush=True)
        for attempt in range(1, PORT_TRIES + 1):
            try:
                launch(args)
                return
            except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
                if not (chosen and _port_taken(exc)):
                    _launch_failed(exc, args.nr)
                if attempt == PORT_TRIES:
                    raise LaunchError(f"rank 0 could not listen on {PORT_TRIES} free ports in "
                                      "a row: another program takes them; give one with "
                                      "--master-port") from None
                taken, args.master_port = args.master_port, find_free_port()
                print(f"note: port {taken} was taken before rank 0 could listen on it; "
                      f"starting again on port {args.master_port}", flush=True)

    return launcher


def spawn(fn: Callable, args: argparse.Namespace) -> None:
    """Start ``fn(local_rank, args)`` in ``args.gpus`` processes through :func:`with_free_port`;
    an expected failure in a process prints its own ``error:`` line there (exit 2)."""
    import torch.multiprocessing as mp

    def launch(args: argparse.Namespace) -> None:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = (args.master_addr,
                                                                str(args.master_port))
        mp.spawn(_guarded, args=(fn, args), nprocs=args.gpus, join=True)

    with_free_port(launch)(args)


def _launch_failed(exc, node: int = 0) -> None:
    import torch.multiprocessing as mp

    who = f"process {exc.error_index} of node {node}"
    if isinstance(exc, mp.ProcessExitedException):
        if exc.exit_code == 2:  # the rank printed its error line already
            raise SystemExit(2) from None
        raise LaunchError(f"{who} died with exit code {exc.exit_code}; the other processes "
                          "were stopped") from None
    last = str(exc).strip().splitlines()[-1]
    kind, _, message = last.partition(": ")
    name = kind.rsplit(".", 1)[-1]
    if name in ("DistNetworkError", "DistStoreError"):
        message = (f"lost or never reached the rendezvous at {os.environ.get('MASTER_ADDR')}:"
                   f"{os.environ.get('MASTER_PORT')} ({message[:100]})")
    elif not message or name not in {e.__name__ for e in (*EXPECTED, LaunchError)}:
        message = last  # an unexpected error keeps its type
    raise LaunchError(f"{who}: {message}") from None
