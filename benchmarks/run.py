"""`make benchmark`: time every registered method at N = 1, 2, 4, ... and plot the speedups.

    python -m benchmarks.run                      # the default sweep (under 20 min on 2 cores)
    python -m benchmarks.run --quick              # under 5 minutes
    python -m benchmarks.run --methods single,ddp_spawn --nprocs 1,2
    python -m benchmarks.run --strong             # fixed global batch instead of per rank
    python -m benchmarks.run --project-bandwidth 25   # project the cost model onto 25 GB/s
    python -m benchmarks.run --interconnect nvlink4   # one GPU: project N GPUs onto NVLink 4

Every (method, N) is launched ``rounds`` times in fresh rank processes, with a hard timeout;
one round launches each method at N = 1 and N = k back to back (the order flipped every other
round, and the methods in a new shuffled order each round), so each speedup is a ratio taken
within a round and the rounds give its 95% interval (``benchmarks/analysis.py``). The
``independent`` control runs in the same rounds; the load of the machine is recorded around
every launch, and results taken on a busy machine are marked "unreliable: machine busy". A
method that fails or hangs is recorded with its error and the sweep goes on. On a CPU each
rank runs pinned to a core of its own (``dpt.dist.pin_rank``; ``--no-pin`` leaves it to the
OS), and each round's ranks fork from a new server, so each round samples a new memory layout.

Throughput is not the whole story: N ranks at a fixed per-rank batch train on an N times larger
global batch, which may need more samples to reach the same accuracy. After the throughput
rounds, a full run trains N = 1 and the largest N to a target test accuracy in rounds of their
own (``benchmarks/time_to_accuracy.py``; ``--no-tta`` skips it, ``--tta-target`` sets it) and
sets the time-to-target speedup beside the throughput speedup, with an MLPerf-style check of
the epochs the larger batch needed.

Results go to ``benchmarks/runs/<stamp>/`` (git-ignored): ``results.json``, ``results.csv``,
``summary.md`` and the PNG plots; ``benchmarks/runs/latest`` points at the last run with at
least one successful measurement. The committed reference results of a 2-core CPU are in
``benchmarks/reference/``; a run never touches them.

Where the ranks run follows ``dpt``: NCCL with a GPU per rank; gloo on the CPU where there is
no GPU or ``DPT_TEST_BACKEND=gloo`` (the test suite) says so; gloo with several ranks per GPU
under ``DPT_SHARE_GPU=1`` (:func:`rank_placement`). On one device there is no all-reduce to
time, so the cost model is a projection onto a named interconnect (``--interconnect``).
``--quick`` on GPUs plans its length before it starts (N = 1 and every GPU, as many rounds as
fit in ``QUICK_GPU_BUDGET_S``) and stops launching when that time is spent; it leaves out the
methods registered with ``quick=False`` (``--list`` marks them) unless ``--methods`` names them.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import random
import re
import resource
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.analysis import (
    BUSY,
    CONTROL,
    add_speedups,
    fmt_ci,
    fmt_ms,
    judge,
    machine_load,
    read_proc_stat,
    summarize_record,
    throughput_ratios,
)
from benchmarks.costmodel import (
    INTERCONNECTS,
    PRESETS,
    RingModel,
    crossover_from_lesson,
    default_interconnect,
    fit_ring,
)
from benchmarks.registry import REGISTRY, BenchContext, load_all
from benchmarks.time_to_accuracy import TTAConfig

HERE = Path(__file__).resolve().parent
RUNS = HERE / "runs"  # git-ignored: every run gets RUNS/<stamp>/, and RUNS/latest points at it
REFERENCE = HERE / "reference"  # committed: a 2-core CPU's results, shown until you run your own

# Throughput ratios worth an interval of their own (a, b): a's samples/s over b's, same N.
RATIO_PAIRS = [("single", "single_dataloader"), ("ddp_naive", "ddp_spawn"),
               ("ddp_overlap", "ddp_spawn"), ("ddp_bucketed", "ddp_spawn"),
               ("ddp_torchrun", "ddp_spawn"), ("lightning_ddp", "ddp_spawn"),
               ("amp_bf16", "ddp_spawn"), ("amp_fp16", "ddp_spawn"),
               # synchronised batch norm: one more all-reduce per batch norm per forward
               ("ddp_syncbn_by_hand", "ddp_spawn"), ("ddp_syncbn", "ddp_spawn"),
               # lesson 13: one sync every 8 steps (parameters, pseudo-gradients, int8 of them)
               ("local_sgd_h8", "ddp_spawn"), ("diloco_h8", "ddp_spawn"),
               ("diloco_h8_int8", "ddp_spawn"),
               # DDP against ranks that never communicate, at the same N: what communication
               # and waiting for each other cost, whatever ceiling the machine gave that run
               ("ddp_spawn", "independent")]


@dataclass
class Config:
    batch_size: int = 256  # per rank (weak scaling) or global (strong)
    warmup: int = 3  # per launch
    steps: int = 6  # per repeat, at most: see repeat_budget_s
    # A repeat of a slow step is cut to about this many seconds (never under 2 steps): bf16
    # emulated on a CPU without avx512_bf16 takes over a second a step, and 6 of them would
    # take a fifth of the default run without adding anything a shorter repeat cannot measure
    repeat_budget_s: float = 3.0
    # A repeat times at least this many seconds of steps (never more than MAX_STEPS): a GPU
    # step takes 1-2 ms, and 6 of them are too short a span to tell from the clock's noise
    min_repeat_s: float = 0.1
    repeats: int = 2  # per launch
    rounds: int = 5  # launches of every (method, N), interleaved
    control_floor: float = 0.85  # the control's efficiency below which the machine was busy
    strong: bool = False
    threads_per_rank: int = 1
    # CPU runs: each rank on cores of its own (dpt.dist.pin_rank); --no-pin leaves it to the OS
    pin: bool = True
    # Each round's ranks fork from a new server, so each round samples a new memory layout
    # (dpt.ranks.restart_fork_server); otherwise one layout would bias a whole run
    new_fork_server_each_round: bool = True
    model: str = "convnet"
    timeout: float = 300.0
    # The whole run's launches stop when this many seconds are spent (None: no limit);
    # --quick on GPUs sets QUICK_GPU_BUDGET_S and plans its rounds to fit (plan_run)
    time_budget_s: float | None = None
    sweep_batches: list[int] = field(default_factory=lambda: [32, 128, 512])
    # Time to accuracy (benchmarks/time_to_accuracy.py): N = 1 and the largest N trained to
    # a test accuracy, in rounds of their own after the throughput rounds (--no-tta: none)
    tta: bool = False
    tta_target: float = TTAConfig.target
    tta_rounds: int = 5
    tta_margin: float = TTAConfig.margin  # the epochs check's allowance over N = 1
    tta_max_epochs: float = TTAConfig.max_epochs
    allreduce_sizes: list[int] = field(default_factory=lambda: [2**k for k in range(12, 25, 2)])
    # The methods --methods named: these run even where bf16 is emulated (unmet_requirement)
    named: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------ rank side


def _reset_peaks(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)


def _peak_memory_mb(devices: list[torch.device]) -> tuple[float, str, dict]:
    """The largest peak over ``devices`` (each CUDA device this rank used), and each one's."""
    if devices and devices[0].type == "cuda":
        each = {str(d): torch.cuda.max_memory_allocated(d) / 2**20 for d in devices}
        return max(each.values()), "cuda max_memory_allocated", each
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return rss, "process peak RSS", {"cpu": rss}


def _timed(fn, steps: int, devices) -> float:
    """Seconds per call of ``fn`` over ``steps`` calls, every device in ``devices`` (one
    device or a list) drained before the clock starts and before it stops: a CUDA step
    returns before its kernels have run."""
    from dpt.device import synchronize

    devices = devices if isinstance(devices, (list, tuple)) else [devices]
    for d in devices:
        synchronize(d)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    for d in devices:
        synchronize(d)
    return (time.perf_counter() - t0) / steps


# The most steps a repeat takes to reach its floor (``Config.min_repeat_s``)
MAX_STEPS = 10_000


def steps_within_budget(step_s: float, most: int, budget_s: float | None,
                        least: int = 2, floor_s: float = 0.0) -> int:
    """Timed steps per repeat: ``most``, or fewer when a step takes so long (``step_s``) that
    ``most`` of them would outlast ``budget_s``; never fewer than ``least`` (nor than ``most``
    allows). ``budget_s`` None or 0 means no budget. When ``most`` steps would take less than
    ``floor_s`` (a fast GPU step), as many steps as fill ``floor_s`` (at most ``MAX_STEPS``;
    the floor never exceeds the budget)."""
    if step_s <= 0:
        return most
    steps = most if not budget_s else max(min(least, most), min(most, int(budget_s / step_s)))
    floor_s = min(floor_s, budget_s) if budget_s else floor_s
    if floor_s and steps * step_s < floor_s:
        steps = min(MAX_STEPS, math.ceil(floor_s / step_s))
    return steps


def agreed_step_seconds(seconds: list[float], world_size: int, device) -> float:
    """The warm-up's step time as every rank will use it: the last warm-up steps (the first
    carries one-time costs), the slowest rank's. Each rank must take the same number of timed
    steps, or a collective inside a step would wait for a partner that has stopped."""
    import torch.distributed as dist

    tail = seconds[1:] or seconds
    t = torch.tensor([statistics.median(tail) if tail else 0.0], dtype=torch.float64,
                     device=device)
    if world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench_rank(rank: int, world_size: int, method_name: str, cfg: dict) -> dict:
    """Runs on every rank inside an initialized process group (see dpt.ranks)."""
    import torch.distributed as dist

    from dpt.dist import env_int, pin_rank, rank_device

    methods = load_all()
    m = methods[method_name]
    # this rank's GPU under NCCL, its share of the GPUs under DPT_SHARE_GPU=1, else the CPU
    device = rank_device()
    cores = (pin_rank(env_int("LOCAL_RANK", rank), env_int("LOCAL_WORLD_SIZE", world_size),
                      cfg["threads_per_rank"]) if cfg.get("pin") and device.type == "cpu"
             else None)
    per_rank = cfg["batch_size"] // world_size if cfg["strong"] else cfg["batch_size"]
    ctx = BenchContext(rank, world_size, device, max(1, per_rank), cfg["model"],
                       options=cfg.get("options", {}))
    # One process driving every GPU (DataParallel) uses them all: record each one's peak,
    # and drain them all around the clock.
    devices = ([torch.device("cuda", i) for i in range(torch.cuda.device_count())]
               if device.type == "cuda" and world_size == 1 and m.max_procs == 1 else [device])
    _reset_peaks(devices)
    made = m.factory(ctx)
    step, extras = (made if isinstance(made, tuple) else (made, {}))
    # A call of ``step`` may be a round of H inner steps and one sync (lesson 13's LocalSGD and
    # DiLoCo): every time below is then divided by H, so a step is still one batch per rank
    inner = extras.get("inner_steps", 1)
    if not isinstance(inner, int) or isinstance(inner, bool) or inner < 1:
        raise ValueError(f"method {method_name!r}: extras['inner_steps'] must be a whole number "
                         f"of optimizer steps per call, at least 1, not {inner!r}")
    timers = extras.get("timers")
    warm = [_timed(step, 1, devices) for _ in range(cfg["warmup"])]
    # Every rank takes the same number of steps: the slowest rank's warm-up decides
    steps = steps_within_budget(agreed_step_seconds(warm, world_size, device), cfg["steps"],
                                cfg.get("repeat_budget_s"), floor_s=cfg.get("min_repeat_s", 0))
    step_times, comm_times, compute_times = [], [], []
    compute_step = extras.get("compute_step")
    for _ in range(cfg["repeats"]):
        if world_size > 1:
            dist.barrier()
        if timers is not None:
            timers.clear()
        step_times.append(_timed(step, steps, devices) / inner)
        if timers is not None and "comm" in timers:
            comm_times.append(timers["comm"] / steps / inner)
        if compute_step is not None:
            if world_size > 1:
                dist.barrier()
            compute_times.append(_timed(compute_step, steps, devices) / inner)
    # One more step, untimed and watched: the dtype its FLOPs are computed in (for MFU)
    from dpt.flops import DTYPE_NAMES, ComputeDtypes

    with ComputeDtypes() as seen:
        loss = step()
    # The slowest rank sets the pace: every rank reports, the parent takes the max.
    mem, mem_kind, mem_each = _peak_memory_mb(devices)
    usage = resource.getrusage(resource.RUSAGE_SELF)  # this process's CPU (reset at fork)
    out = {"rank": rank, "step_times": step_times, "steps": steps, "loss": float(loss),
           "per_rank_batch": ctx.batch_size, "peak_mem_mb": mem, "mem_kind": mem_kind,
           "peak_mem_mb_devices": mem_each, "threads": torch.get_num_threads(),
           "cpu_s": usage.ru_utime + usage.ru_stime, "cores": cores,
           "devices": [str(d) for d in devices], "flops_seen": seen.total() / inner,
           "compute_dtype": DTYPE_NAMES.get(seen.dtype())}
    if inner > 1:
        out["inner_steps"] = inner
    if extras.get("notes"):  # what the method says about this run (a dtype it chose, ...)
        out["notes"] = list(extras["notes"])
    if comm_times:
        out["comm_s"] = statistics.median(comm_times)
    if compute_times:
        out["compute_s"] = statistics.median(compute_times)
    return out


def allreduce_curve(rank: int, world_size: int, sizes: list[int], repeats: int = 5) -> list:
    """Median all-reduce time per message size (bytes), measured on this machine.

    The tensor lives on the rank's device (NCCL takes only CUDA tensors), and the clock is
    read only after the device has finished (an NCCL all-reduce returns before it is done).
    """
    import torch.distributed as dist

    from dpt.device import synchronize
    from dpt.dist import rank_device

    device = rank_device()
    curve = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), device=device)
        for _ in range(2):
            dist.all_reduce(t)
        times = []
        for _ in range(repeats):
            synchronize(device)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            synchronize(device)
            times.append(time.perf_counter() - t0)
        curve.append((nbytes, statistics.median(times)))
    return curve


# ------------------------------------------------------------------------ parent side


def rank_placement(n: int) -> tuple[str, str]:
    """(backend, device type) of the ranks of an N-rank launch, as ``dpt`` places them.

    ``run_distributed`` and the torchrun worker both follow it: DPT_TEST_BACKEND when set (the
    test suite forces gloo, so the ranks compute on the CPU even on a GPU machine); gloo on the
    GPUs when the ranks share them (``DPT_SHARE_GPU=1``, ``dpt.dist.shares_gpu``); NCCL with a
    GPU per rank on a GPU machine; gloo on the CPU without one. On a GPU machine with fewer GPUs
    than N, "auto" would fall back to gloo on the CPU: that is no comparison with N = 1 on a
    GPU, so this says NCCL, and :func:`unmet_requirement` skips the N.
    """
    from dpt.dist import shares_gpu
    from dpt.ranks import default_backend

    backend = default_backend(n)
    if backend == "nccl":
        return "nccl", "cuda"
    if shares_gpu():
        return "gloo", "cuda"
    forced = os.environ.get("DPT_TEST_BACKEND", "auto") not in ("", "auto")
    if torch.cuda.is_available() and not forced:
        return "nccl", "cuda"
    return "gloo", "cpu"


def _gpu_names() -> list[str]:
    try:
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except (RuntimeError, AssertionError):  # a CUDA that cannot name its devices
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def machine_info(threads_per_rank: int, nmax: int = 1) -> dict:
    flags = []
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    from dpt.dist import cpu_budget

    info = {
        "cpu": model, "cores": cpu_budget(),
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4"))),
        "torch": torch.__version__, "python": platform.python_version(),
        "gloo": torch.distributed.is_gloo_available(),
        "cuda_devices": _gpu_names() if torch.cuda.is_available() else [],
        "threads_per_rank": threads_per_rank, "hostname": platform.node(),
    }
    try:
        info["nccl"] = (".".join(map(str, torch.cuda.nccl.version()))
                        if torch.cuda.is_available() else None)
    except (RuntimeError, AttributeError):  # a torch built without NCCL
        info["nccl"] = None
    backend, device = rank_placement(nmax)
    info["backend"], info["rank_device"] = backend, device
    gpus = len(info["cuda_devices"])
    cpu = f"{info['cores']}-core CPU, gloo, {threads_per_rank} thread(s) per rank"
    if device == "cpu":
        info["label"] = cpu + (f" (DPT_TEST_BACKEND=gloo: the {gpus} GPU(s) unused)" if gpus
                               else "")
    elif backend == "gloo":
        info["label"] = f"{gpus} GPU(s) shared by the ranks, gloo (DPT_SHARE_GPU=1)"
    else:
        info["label"] = f"{gpus} GPU(s), NCCL"
    return info


def default_nprocs(quick: bool = False) -> list[int]:
    """1, 2, 4, ... up to the GPUs (one rank each), or to 4 ranks on each GPU's share when the
    ranks share them (DPT_SHARE_GPU=1), or to the cores on a CPU. ``quick`` on GPUs: N = 1 and
    the largest N only."""
    from dpt.dist import cpu_budget, shares_gpu

    _, device = rank_placement(1)
    if device == "cpu":
        limit = cpu_budget()
    elif shares_gpu():
        limit = max(4, torch.cuda.device_count())
    else:
        limit = torch.cuda.device_count()
    ns, n = [], 1
    while n <= max(1, limit):
        ns.append(n)
        n *= 2
    if quick and device == "cuda":
        return sorted({1, ns[-1]})
    return ns


# How --list names a requirement, where its short name says too little
REQUIREMENT_NAMES = {"bf16": "bf16 instructions on a CPU, unless named in --methods"}
EMULATED_BF16 = ("bf16 is emulated on this CPU (no AVX512-BF16 or AMX instructions), so it "
                 "would time the emulation, not the method")


def emulates_bf16(device_type: str) -> bool:
    """Whether ranks on ``device_type`` compute bf16 without bf16 instructions (a CPU lacking
    AVX512-BF16 and AMX; lesson 06's rule, :func:`dpt.precision.cpu_has_fast_bf16`)."""
    from dpt.precision import cpu_has_fast_bf16

    return device_type == "cpu" and not cpu_has_fast_bf16()


def unmet_requirement(req: tuple[str, ...], n: int, named: bool = False) -> str | None:
    """Why N ranks cannot run a method needing ``req`` here, or None. The GPU count limits N
    only under NCCL (one rank per GPU); the ranks' device is :func:`rank_placement`'s.

    ``"bf16"``: a method computing in bf16 is left out on a CPU without bf16 instructions
    (lesson 09's FSDP takes about 25 s a step there, most of a default run), unless the
    command ``named`` it (``--methods``), which times the emulation on purpose."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend, device = rank_placement(n)
    on_cpu = ""
    if device == "cpu" and gpus:
        on_cpu = " (DPT_TEST_BACKEND=gloo runs the ranks on the CPU)"
    for r in req:
        if r == "cuda" and device != "cuda":
            return "needs a CUDA GPU" + on_cpu
        if r.startswith("cuda>=") and (device != "cuda" or gpus < int(r.split(">=")[1])):
            return f"needs {r.split('>=')[1]} CUDA GPUs" + on_cpu
        if r == "apex":
            try:
                import apex.amp  # noqa: F401
            except ImportError:
                return "needs NVIDIA Apex"
        if r == "lightning":
            import importlib.util

            if importlib.util.find_spec("lightning_fabric") is None:
                return "needs Lightning (pip install pytorch-lightning)"
            if device == "cuda" and n > gpus:  # DPT_SHARE_GPU=1: ranks share the GPUs
                return (f"needs {n} CUDA GPUs: Lightning's ddp gives each rank a GPU of its "
                        f"own, and N={n} ranks would share {gpus}")
        if r == "compiler":  # torch.compile's inductor backend for the ranks' device
            from dpt.device import compiler_problem

            problem = compiler_problem(device)
            if problem:
                return problem
        if r == "bf16" and not named and emulates_bf16(device):
            return EMULATED_BF16 + "; --methods NAME times it anyway"
        if r == "data":
            from dpt.data import is_present

            if not is_present("fashion-mnist"):
                return "needs Fashion-MNIST (make data)"
    if backend == "nccl" and n > gpus:
        return (f"N={n} exceeds the {gpus} GPUs (NCCL takes one rank per GPU; DPT_SHARE_GPU=1 "
                "lets ranks share them, with gloo)")
    return None


def skip_reason(m, n: int, named: bool = False) -> str | None:
    """Why a method cannot run at N here (a missing GPU, Apex, ...), or None. ``named``: the
    command named the method (see :func:`unmet_requirement`)."""
    why = unmet_requirement(m.requires, n, named)
    if why is None and n < m.min_procs:
        why = f"needs at least {m.min_procs} ranks"
    if why is None and m.max_procs is not None and n > m.max_procs:
        why = f"runs on at most {m.max_procs} rank(s)"
    return why


def snapshot() -> dict:
    """The machine's CPU counters, load and this process's (and its children's) CPU time."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"t": time.monotonic(), "stat": read_proc_stat(),
            "load1": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "self_cpu": me.ru_utime + me.ru_stime, "child_cpu": kids.ru_utime + kids.ru_stime}


def _hz() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):
        return 100


def launch(name: str, n: int, cfg: Config, methods, round_no: int = 0) -> dict:
    """One measurement: start N fresh ranks, time the method, record the machine's load.

    Returns ``status`` ("ok", "failed", "timeout"), and when ok the slowest rank's time per
    repeat (``step_times``), the throughput, memory, loss and ``load`` (see
    ``analysis.machine_load``) over this launch.
    """
    from dpt.errors import one_line
    from dpt.ranks import RankFailure, run_distributed

    m = methods[name]
    out = {"round": round_no, "status": "ok"}
    before = snapshot()
    try:
        if m.launcher == "torchrun":
            ranks = run_torchrun(name, n, cfg)
        else:
            ranks = run_distributed(bench_rank, world_size=n, args=(name, asdict(cfg)),
                                    timeout=cfg.timeout, threads=cfg.threads_per_rank,
                                    echo=False)
    except RankFailure as exc:
        text = str(exc)
        out.update(status="timeout" if "timed out" in text or "hung" in text else "failed",
                   error=one_line(exc)[:300], detail=text[-2000:])
        return out
    except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be unpickled
        out.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:300])
        return out
    after = snapshot()
    # Our CPU: the ranks' own (forkserver children are not ours to wait for) or, under
    # torchrun, the launcher's children; plus this process.
    ours = (max(after["child_cpu"] - before["child_cpu"], sum(r.get("cpu_s", 0) for r in ranks))
            + after["self_cpu"] - before["self_cpu"])
    # Per repeat, the slowest rank's time: the slowest rank sets the pace.
    per_repeat = [max(r["step_times"][i] for r in ranks) for i in range(len(ranks[0]["step_times"]))]
    per_rank = ranks[0]["per_rank_batch"]
    out.update(
        wall_s=round(after["t"] - before["t"], 2), per_rank_batch=per_rank,
        step_times=per_repeat, timed_steps=[r.get("steps", cfg.steps) for r in ranks],
        samples_per_s=per_rank * n / statistics.median(per_repeat),
        peak_mem_mb=max(r["peak_mem_mb"] for r in ranks), mem_kind=ranks[0]["mem_kind"],
        peak_mem_mb_devices={f"rank{r['rank']} {d}": v for r in ranks
                             for d, v in r.get("peak_mem_mb_devices", {}).items()},
        final_loss=statistics.mean(r["loss"] for r in ranks), threads=ranks[0]["threads"],
        cores=[r.get("cores") for r in ranks],
        load=machine_load(before, after, ours, hz=_hz()))
    notes = [note for r in ranks for note in r.get("notes", [])]
    if notes:
        out["notes"] = notes
    # For MFU: the devices computing (each rank's share of the CPU, or each distinct GPU) and
    # what rank 0's last step computed in
    gpus = {d for r in ranks for d in r.get("devices", []) if d.startswith("cuda")}
    out.update(devices=len(gpus) or n, compute_dtype=ranks[0].get("compute_dtype"),
               flops_seen=ranks[0].get("flops_seen"))
    if ranks[0].get("inner_steps"):
        out["inner_steps"] = ranks[0]["inner_steps"]
    step_s = statistics.median(per_repeat)
    if all("compute_s" in r for r in ranks):
        compute = max(r["compute_s"] for r in ranks)
        out.update(compute_s=compute, comm_s=max(0.0, step_s - compute))
    elif all("comm_s" in r for r in ranks):
        comm = max(r["comm_s"] for r in ranks)
        out.update(comm_s=comm, compute_s=max(0.0, step_s - comm))
    return out


def round_schedule(n_groups: int, rnd: int) -> list[tuple[int, bool]]:
    """The launch order of round ``rnd``: (group index, N's reversed?) for every group once.

    A group is one method's launches at every N, back to back. The groups are shuffled anew
    each round (seeded by the round, so a rerun repeats the order), and N's order flips every
    other round. Without the shuffle, round r launches method m at about the same offset
    into the round every time: a disturbance that recurs with the period of a round (a host
    job, a frequency change) hits the same method in every round and shifts its result
    without widening its interval, so two runs disagree. Shuffled, it lands on a different
    method each round and shows up in the intervals instead.
    """
    order = list(range(n_groups))
    random.Random(7919 * (rnd + 1)).shuffle(order)
    return [(g, rnd % 2 == 1) for g in order]


def run_one(name: str, n: int, cfg: Config, methods, rounds: int = 1) -> dict:
    """``rounds`` launches of one (method, N) in a row, summarized (no interleaving)."""
    rec = new_record(name, n, cfg, methods)
    for i in range(rounds):
        if rec["status"] == "ok":
            add_round(rec, launch(name, n, cfg, methods, i))
    finish_record(rec)
    return rec


def new_record(name: str, n: int, cfg: Config, methods, sweep: int | None = None) -> dict:
    m = methods[name]
    rec = {"method": name, "nprocs": n, "description": m.description,
           "scaling": "strong" if cfg.strong else "weak", "status": "ok", "rounds": []}
    if sweep is not None:
        rec["sweep"] = sweep
    named = name in cfg.named
    why = skip_reason(m, n, named)
    if why:
        rec.update(status="skipped", error=why)
    elif named and "bf16" in m.requires and emulates_bf16(rank_placement(n)[1]):
        rec["notes"] = [EMULATED_BF16 + ": timed because --methods named it"]
    return rec


def add_round(rec: dict, res: dict) -> None:
    """Keep a launch's result; a failure ends the record (later rounds skip it)."""
    if res["status"] != "ok":
        rec.update(status=res["status"], error=f"round {res['round'] + 1}: {res.get('error', '')}")
        if "detail" in res:
            rec["detail"] = res["detail"]
        return
    rec["rounds"].append(res)
    for note in res.get("notes", []):
        rec.setdefault("notes", []).append(f"round {res['round'] + 1}: {note}")


def finish_record(rec: dict) -> None:
    ok = rec["rounds"]
    if rec["status"] != "ok" or not ok:
        return
    per_rank = ok[0]["per_rank_batch"]
    rec.update(per_rank_batch=per_rank, global_batch=per_rank * rec["nprocs"],
               wall_s=round(sum(r["wall_s"] for r in ok), 2),
               peak_mem_mb=max(r["peak_mem_mb"] for r in ok), mem_kind=ok[0]["mem_kind"],
               peak_mem_mb_devices=ok[-1].get("peak_mem_mb_devices", {}),
               final_loss=statistics.mean(r["final_loss"] for r in ok),
               threads_per_rank=ok[0]["threads"],
               timed_steps=min(min(r.get("timed_steps") or [0]) for r in ok))
    for key in ("devices", "compute_dtype", "flops_seen"):
        if key in ok[0]:
            rec[key] = ok[0][key]
    if ok[0].get("inner_steps"):
        rec["inner_steps"] = ok[0]["inner_steps"]
        rec.setdefault("notes", []).append(
            f"a timed call is a round of {rec['inner_steps']} inner steps and one sync: step "
            "times and samples/s are per inner step, the sync's cost spread over the round")
    summarize_record(rec)


def run_torchrun(name: str, n: int, cfg: Config) -> list[dict]:
    """Start N ranks with torchrun (``benchmarks/torchrun_worker.py``) and read their results.

    The same ``bench_rank`` runs in each; only the launcher differs. A failed rank's traceback,
    or a timeout, raises RankFailure like the spawn path, so the sweep records it and goes on.
    """
    import signal
    import subprocess
    import tempfile

    from dpt.ranks import RankFailure

    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="dpt-bench-torchrun-") as tmp:
        out = Path(tmp)
        (out / "config.json").write_text(json.dumps(asdict(cfg)))
        # --standalone: the agent binds its rendezvous store to a port the OS picks (port 0),
        # so no port chosen here can be taken by another run before torchrun binds it.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", "--max-restarts=0",
               "-m", "benchmarks.torchrun_worker", name, str(out)]
        env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads_per_rank),
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=cfg.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            raise RankFailure(f"{log[-1500:]}\ntorchrun: {name} at N={n} timed out after "
                              f"{cfg.timeout:.0f} s and was killed") from None
        errors = sorted(out.glob("rank*.error"))
        if errors:
            raise RankFailure("\n".join(f"--- {e.stem} ---\n{e.read_text()}" for e in errors))
        return torchrun_results(out, n, proc.returncode, log)


def torchrun_root_cause(log: str) -> str:
    """One line from torchrun's failure report: which rank died and how, and a fatal message
    the worker printed before it (``terminate called ...``, ``Fatal Python error``)."""
    parts = []
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", log, re.S)
    if root:
        code = int(root.group(2))
        try:
            how = signal.Signals(-code).name if code < 0 else f"exit code {code}"
        except ValueError:
            how = f"exit code {code}"
        parts.append(f"rank {root.group(1)} died with {how}")
    fatal = re.search(r"(terminate called[^\n]*|Fatal Python error[^\n]*)", log)
    if fatal:
        parts.append(repr(fatal.group(1).strip()))
    return "; ".join(parts) or "torchrun failed without naming a rank"


def torchrun_results(out: Path, n: int, returncode: int, log: str) -> list[dict]:
    """The N ranks' results from ``out``. When torchrun failed but every rank had already
    written its results (and reported no error), the rank crashed at exit, after the
    measurement (the gloo teardown abort in docs/troubleshooting.md): the results stand,
    with a note saying so. Otherwise the failure is raised, its root cause as the last line."""
    from dpt.ranks import RankFailure

    paths = [out / f"rank{r}.json" for r in range(n)]
    if returncode != 0 and not all(p.exists() for p in paths):
        raise RankFailure(f"{log[-2000:]}\ntorchrun exited with {returncode}: "
                          f"{torchrun_root_cause(log)}")
    ranks = [json.loads(p.read_text()) for p in paths]
    if returncode != 0:
        ranks[0]["notes"] = [f"torchrun exited with {returncode} after every rank had written "
                             f"its results ({torchrun_root_cause(log)}): a crash at exit, "
                             "not during the measurement"]
    return ranks


def grad_bytes(model_name: str) -> int:
    from dpt.models import build_model

    return sum(p.numel() * p.element_size() for p in build_model(model_name).parameters()
               if p.requires_grad)


_clock = time.monotonic  # the run's clock for its time budget (a test replaces it)


def fit_cost_model(curve: list, n: int) -> RingModel | None:
    if not curve:
        return None
    sizes, times = zip(*curve)
    try:
        return fit_ring(list(sizes), list(times), n)
    except ValueError:
        return None


# ----------------------------------------------------------------------------- output


# ------------------------------------------------------------------------ MFU


def model_flops_per_step(model_name: str, per_rank_batch: int, cache: dict | None = None) -> int:
    """Model FLOPs of one training step of ``model_name`` at this per-rank batch.

    Forward and backward, counted by FlopCounterMode (``dpt.flops.step_flops``) on the meta
    device, so nothing is computed, with the benchmark's own batch shape
    (``BenchContext.batch``); no optimizer, no communication, no recomputation. Once per
    (model, batch) in ``cache``.
    """
    from dpt.flops import step_flops

    key = (model_name, per_rank_batch)
    if cache is not None and key in cache:
        return cache[key]
    ctx = BenchContext(0, 1, torch.device("cpu"), per_rank_batch, model_name)
    flops = step_flops(ctx.model().to("meta"), ctx.batch()[0].to("meta"))
    if cache is not None:
        cache[key] = flops
    return flops


def device_peak(device_type: str, dtype_name: str, threads: int,
                probe=None) -> tuple[float, str]:
    """(FLOP/s, label): one device's peak for ``dtype_name`` (``dpt.flops.peak_flops``).

    A GPU's from its datasheet (the probe on a GPU without an entry); on the CPU the matmul
    probe with ``threads`` threads, one rank's share, since each rank computes on its own.
    ``probe``: see ``dpt.flops.peak_flops``.
    """
    from dpt.flops import peak_flops

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    if device_type == "cuda":
        return peak_flops(torch.device("cuda", 0), dtype, probe=probe)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        peak, label = peak_flops("cpu", dtype, probe=probe)
    finally:
        torch.set_num_threads(before)
    return peak, f"{label}, {threads} thread(s): one rank's share"


def add_mfu(records: list[dict], model_name: str, device_type: str, threads: int,
            peak_fn=device_peak, flops_fn=model_flops_per_step) -> dict:
    """Achieved FLOP/s and MFU for every record measured; returns the peaks used.

    ``flops_per_sample`` is the model's step FLOPs over its per-rank batch, so the FLOP/s
    achieved by all ranks is ``flops_per_sample * samples_per_s`` and the MFU that over the
    peak of one device in the record's compute dtype times the devices computing (the N ranks,
    or the GPUs one DataParallel process drives). Each dtype's peak is got once per run.
    """
    import dpt.flops

    cache: dict = {}
    peaks: dict[str, tuple[float, str]] = {}
    probes: dict = {}

    def probe(device, dtype, seconds):  # one measurement per (device, dtype) in a run
        key = (str(device), dtype)
        if key not in probes:
            probes[key] = dpt.flops.measure_peak(device, dtype, seconds)
        return probes[key]

    for r in records:
        if r["status"] != "ok" or "samples_per_s" not in r:
            continue
        if r.get("flops_seen") == 0:
            r.setdefault("notes", []).append(
                "no MFU: its step computed no matmul or convolution that the harness could "
                "see on the rank's own thread")
            continue
        dtype = r.get("compute_dtype") or "fp32"
        if dtype not in peaks:
            peaks[dtype] = peak_fn(device_type, dtype, threads, probe)
        peak, label = peaks[dtype]
        own = REGISTRY.get(r.get("method"))
        if own is not None and own.step_flops is not None:  # it trains a model of its own
            key = (own.flops_model, r["per_rank_batch"])
            if key not in cache:
                cache[key] = own.step_flops(r["per_rank_batch"])
            flops = cache[key]
            r["flops_model"] = own.flops_model
        else:
            flops = flops_fn(model_name, r["per_rank_batch"], cache)
        per_sample = flops / r["per_rank_batch"]
        devices = r.get("devices") or r["nprocs"]
        r.update(compute_dtype=dtype, flops_per_step=flops, flops_per_sample=per_sample,
                 achieved_tflops=per_sample * r["samples_per_s"] / 1e12,
                 achieved_tflops_per_rank=per_sample * r["samples_per_s"] / 1e12 / r["nprocs"],
                 peak_tflops=peak / 1e12, peak_label=label)
        for key, rate in (("mfu", "samples_per_s"), ("mfu_lo", "samples_per_s_lo"),
                          ("mfu_hi", "samples_per_s_hi")):
            if r.get(rate) is not None:
                r[key] = per_sample * r[rate] / (peak * devices)
        seen = r.get("flops_seen")
        if seen and abs(seen - flops) > 0.1 * flops:
            r.setdefault("notes", []).append(
                f"MFU counts {r.get('flops_model', 'the model')}'s {flops / 1e9:.3g} GFLOP a "
                f"step; rank 0's own step "
                f"computed {seen / 1e9:.3g} (recomputation, another model, or work on other "
                "threads)")
    return {"model": model_name, "device": device_type,
            "flops": (f"model FLOPs per step: forward + backward of {model_name!r} (or of "
                      "the model a method trains instead, named in its record) at the "
                      "per-rank batch, counted by FlopCounterMode (dpt.flops.step_flops); no "
                      "optimizer, communication or recomputation"),
            "peaks": {d: {"tflops": p / 1e12, "label": lab} for d, (p, lab) in peaks.items()}}


def mfu_text(block: dict) -> str:
    """The summary's sentence on MFU: what was counted and which peak, got how."""
    if block.get("error"):
        return f"MFU not computed: {block['error']}"
    peaks = "; ".join(f"{d}: {_sig(v['tflops'])} TFLOP/s ({v['label']})"
                      for d, v in block.get("peaks", {}).items())
    return (f"MFU = achieved FLOP/s / (peak of one {block.get('device')} device x devices), "
            f"with {block.get('flops')}. Peak per device: {peaks or 'none needed'}.")


def _sig(value: float | None) -> str:
    """Three significant figures (``fmt_ms`` works on thousandths)."""
    return "" if value is None else fmt_ms(value / 1000)


def _mfu_cells(r: dict) -> str:
    if r.get("mfu") is None:
        return " | "
    flops = f"{_sig(r['achieved_tflops'])} ({_sig(r['achieved_tflops_per_rank'])})"
    pct = (f"{_sig(100 * r['mfu'])}%" if r.get("mfu_lo") is None else
           f"{_sig(100 * r['mfu'])}% [{_sig(100 * r['mfu_lo'])}, {_sig(100 * r['mfu_hi'])}]")
    return f"{flops} | {pct} {r['compute_dtype']}"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def latest_results(runs: Path = RUNS, reference: Path = REFERENCE) -> tuple[Path, str]:
    """The results to show: your latest run if there is one, else the committed reference.
    ``DPT_BENCH_SHOW=reference`` shows the reference even when you have runs (the website)."""
    if os.environ.get("DPT_BENCH_SHOW") == "reference":
        return reference / "results.json", "the committed reference (a 2-core CPU)"
    for cand in (runs / "latest" / "results.json",):
        if cand.is_file():
            return cand.resolve(), "your latest run"  # the stamped folder: when it ran
    pointer = runs / "LATEST"  # where the file system has no symbolic links
    if pointer.is_file() and (runs / pointer.read_text().strip() / "results.json").is_file():
        return runs / pointer.read_text().strip() / "results.json", "your latest run"
    return reference / "results.json", "the committed reference (a 2-core CPU)"


def _ok(result: dict, sweep: bool = False) -> list[dict]:
    return [r for r in result["records"] if r["status"] == "ok" and "samples_per_s" in r
            and (r.get("sweep") is not None) == sweep]


def placement_note(result: dict) -> str:
    """How the ranks were placed on the cores and started, in a sentence (empty when unknown)."""
    cfg = result["config"]
    launches = [x for r in result["records"] for x in r.get("rounds", []) if "cores" in x]
    if not launches:
        return ""
    pinned = sum(all(launch["cores"]) for launch in launches)
    if pinned == len(launches):
        text = "Each rank ran pinned to its own core(s) (`--no-pin` leaves them to the OS)"
    elif pinned:
        text = f"{pinned} of {len(launches)} launches ran with each rank pinned to its own core(s)"
    else:
        text = "The ranks were not pinned to cores"
    if cfg.get("new_fork_server_each_round"):
        text += "; each round's ranks were forked from a new server (a new memory layout)"
    return text + "."


def budget_note(result: dict) -> str:
    """Which results took fewer timed steps than asked, their step being slow (or "")."""
    cfg = result["config"]
    cut = [f"{r['method']}{' batch=' + str(r['sweep']) if r.get('sweep') else ''} "
           f"N={r['nprocs']}: {r['timed_steps']}" for r in result["records"]
           if r.get("status") == "ok" and 0 < r.get("timed_steps", cfg["steps"]) < cfg["steps"]]
    if not cut:
        return ""
    return (f"Slow steps, so fewer than {cfg['steps']} timed steps per repeat (a repeat is cut "
            f"to about {cfg.get('repeat_budget_s')} s): {', '.join(cut)}.")


def cost_model_text(cm: dict) -> str:
    """The cost model in a sentence: fitted here, or projected onto which interconnect."""
    figures = (f"alpha = {cm['alpha_s'] * 1e6:.0f} us, bandwidth = "
               f"{cm['bandwidth_Bps'] / 1e9:.2f} GB/s; gradients {cm['grad_bytes'] / 1e3:.0f} KB; "
               f"compute {fmt_ms(cm['compute_s'])} ms a step ({cm['compute_from']} at N=1)")
    if cm.get("source") == "projection":
        head = (f"Cost model PROJECTED, not measured ({cm.get('why', '')}), onto "
                f"{cm.get('preset_label', cm.get('preset'))} (`--interconnect {cm.get('preset')}`)")
    else:
        head = f"Cost model (fitted from all-reduce on {cm['fit_nprocs']} ranks)"
    pred = cm.get("predicted_speedup")
    tail = ""
    if pred:
        tail = (f". Predicted {cm.get('scaling', 'weak')}-scaling speedup: "
                + ", ".join(f"N={n}: {v:.2f}" for n, v in pred.items()))
    return f"{head}: {figures}{tail}."


def summary_markdown(result: dict) -> str:
    m, cfg = result["machine"], result["config"]
    rounds = cfg.get("rounds", 1)
    how = (f"{rounds} interleaved round(s) of" if "rounds" in cfg
           else "one launch per (method, N) of")
    lines = [f"# Benchmark: {m['label']}", "",
             f"{m['cpu']}; torch {m['torch']}; {cfg['scaling']} scaling, batch "
             f"{cfg['batch_size']} {'global' if cfg['strong'] else 'per rank'}; "
             f"{how} {cfg.get('repeats')} x {cfg.get('steps')} timed steps; "
             f"{result['stamp']}", ""]
    if rounds > 1:
        lines += ["Figures in brackets are 95% intervals over the rounds (paired: each "
                  "ratio is taken within a round).", ""]
    placement = placement_note(result)
    if placement:
        lines += [placement, ""]
    cut = budget_note(result)
    if cut:
        lines += [cut, ""]
    lines += ["| method | N | status | samples/s | speedup | efficiency | step ms | comm ms | "
              "TFLOP/s all (per rank) | MFU | peak MB/rank | final loss | machine |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    for r in result["records"]:
        if r.get("sweep") is not None:
            continue
        if r["status"] != "ok" or "samples_per_s" not in r:
            lines.append(f"| {r['method']} | {r['nprocs']} | {r['status']}: "
                         f"{r.get('error', '')} | | | | | | | | | | |")
            continue
        rel = r.get("reliability", "")
        if rel == BUSY:
            rel = f"**{BUSY}**: {r['flags'][0]}"
        lines.append(
            f"| {r['method']} | {r['nprocs']} | ok | "
            f"{fmt_ci(r['samples_per_s'], r.get('samples_per_s_lo'), r.get('samples_per_s_hi'), '.0f')} | "
            f"{fmt_ci(r.get('speedup'), r.get('speedup_lo'), r.get('speedup_hi'))} | "
            f"{fmt_ci(r.get('efficiency'), r.get('efficiency_lo'), r.get('efficiency_hi'))} | "
            f"{fmt_ms(r['step_s'])} | {fmt_ms(r.get('comm_s'))} | {_mfu_cells(r)} "
            f"| {r['peak_mem_mb']:.0f} | {r['final_loss']:.3f} | {rel} |")
    if result.get("ratios"):
        lines += ["", "Throughput ratios, same N, paired by round:", "",
                  "| a over b | N | ratio |", "|---|---|---|"]
        for q in result["ratios"]:
            lines.append(f"| {q['a']} over {q['b']} | {q['nprocs']} | "
                         f"{fmt_ci(q['value'], q['lo'], q['hi'])} |")
    tta = result.get("time_to_accuracy")
    if tta:
        from benchmarks.time_to_accuracy import tta_markdown

        lines += tta_markdown(tta)
    if result.get("mfu"):
        lines += ["", mfu_text(result["mfu"])]
    cm = result.get("cost_model")
    if cm:
        lines += ["", cost_model_text(cm)]
    sweep = [r for r in _ok(result, sweep=True) if r["nprocs"] > 1]
    if sweep:
        lines += ["", f"Per-rank batch sweep ({sweep[0]['method']}): batch -> speedup at "
                      f"N={sweep[0]['nprocs']} over N=1: " + ", ".join(
                          f"{r['per_rank_batch']}: "
                          f"{fmt_ci(r.get('speedup', r.get('sweep_speedup')), r.get('speedup_lo'), r.get('speedup_hi'))}"
                          + (" (busy)" if r.get("reliability") == BUSY else "")
                          for r in sweep)]
    verdict = result.get("verdict")
    if verdict:
        lines += ["", "## Can these numbers be trusted?", ""]
        lines += [f"- {msg}" for msg in verdict["messages"]]
        if tta:
            from benchmarks.time_to_accuracy import epochs_check_line

            lines.append(f"- {epochs_check_line(tta.get('epochs_check'))}")
        lines += [f"- Note, {r['method']} N={r['nprocs']}, {note}" for r in result["records"]
                  for note in r.get("notes", [])]
        loads = [r["load"] for r in result["records"] if r.get("load")]
        fc = [x["foreign_cores"] for x in loads if x.get("foreign_cores") is not None]
        l1 = [x["load1"] for x in loads if x.get("load1") is not None]
        st = [x["steal"] for x in loads if x.get("steal") is not None]
        if fc:
            lines.append(f"- Other processes used {min(fc):.2f} to {max(fc):.2f} cores during "
                         f"the methods' runs (mean per method); 1-minute load average up to "
                         f"{max(l1):.1f}" + (f"; CPU steal up to {100 * max(st):.1f}%" if st else "")
                         + ".")
    else:
        lines += ["", "Measured before the harness interleaved rounds: one run per (method, N), "
                      "no intervals and no busy-machine check."]
    return "\n".join(lines) + "\n"


# One colour and one marker per method, the same in every plot (order of registration).
_MARKERS = "osD^vP*Xph<>d8H"


def method_styles(names: list[str]) -> dict[str, tuple]:
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    order = list(dict.fromkeys(list(load_all()) + list(names)))
    colours = [cmap(i) for i in range(0, 20, 2)] + [cmap(i) for i in range(1, 20, 2)]
    return {name: (colours[i % 20], _MARKERS[i % len(_MARKERS)]) for i, name in enumerate(order)}


def _busy_note(fig, result: dict, marked: str, shown: list[dict] | None = None) -> None:
    """The figure's footnote when the run had busy results; with ``shown`` (the records the
    figure draws), only when one of them was busy."""
    busy = (result.get("verdict") or {}).get("busy")
    if shown is not None:
        busy = any(r.get("reliability") == BUSY for r in shown)
    if busy:
        fig.text(0.01, 0.005, f"{marked}: {BUSY} (the reasons are in summary.md)",
                 color="firebrick", fontsize=8, ha="left", va="bottom")


def _grouped_bars(ax, recs, methods, styles, key: str, ideal, ylabel: str) -> None:
    """Bars per method, one per N > 1, with 95% error bars and each bar's ideal marked."""
    from matplotlib.patches import Patch

    nks = sorted({r["nprocs"] for r in recs if r["nprocs"] > 1 and r.get(key) is not None})
    width = 0.8 / max(1, len(nks))
    for j, mname in enumerate(methods):
        colour, marker = styles[mname]
        for i, n in enumerate(nks):
            r = next((q for q in recs if q["method"] == mname and q["nprocs"] == n), None)
            if r is None or r.get(key) is None:
                continue
            x = j + (i - (len(nks) - 1) / 2) * width
            busy = r.get("reliability") == BUSY
            v, lo, hi = r[key], r.get(f"{key}_lo"), r.get(f"{key}_hi")
            ax.bar(x, v, width * 0.9, color=colour, alpha=0.4 if busy else 0.9,
                   hatch="///" if busy else None, edgecolor="firebrick" if busy else colour)
            yerr = None if lo is None else [[v - lo], [hi - v]]
            ax.errorbar(x, v, yerr=yerr, fmt=marker, color="black", ms=5, capsize=3, lw=1)
            ax.hlines(ideal(n), x - width * 0.45, x + width * 0.45, colors="black",
                      linestyles="--", lw=1.2)
            if len(nks) > 1:
                ax.annotate(f"N={n}", (x, 0), fontsize=6, ha="center", va="bottom")
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels(methods, rotation=35, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(methods) - 0.4)
    ax.set_ylabel(ylabel)
    handles = [Patch(facecolor="white", edgecolor="black", ls="--", label="ideal (dashed)")]
    if any(r.get("reliability") == BUSY for r in recs):
        handles.append(Patch(facecolor="white", edgecolor="firebrick", hatch="///",
                             label=BUSY))
    ax.legend(handles=handles, fontsize=7, loc="best", framealpha=0.9)


def cost_model_figure(result: dict, cm: dict, recs: list[dict], styles: dict,
                      project_ns=(1, 2, 4, 8, 16, 64)):
    """costmodel.png: this machine's measured speedups and the cost model fitted to them (or
    projected), and beside them lesson 12's crossover for real model sizes, drawn by the
    lesson tree's own crossover.py (a stub leaves one line in its place)."""
    import matplotlib.pyplot as plt

    cm = {"scaling": result["config"].get("scaling", "weak"), **cm}
    crossover, rows, crossover_note = crossover_from_lesson()
    if rows:
        fig, (ax, ax_split, ax_hide) = plt.subplots(
            1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [1, 1.3, 1.3]})
        crossover.plot_crossover(rows, ax_split, ax_hide)
    else:
        fig, ax = plt.subplots(figsize=(6.5, 4.6))
        fig.text(0.01, 0.99, crossover_note, fontsize=7, ha="left", va="top",
                 color="firebrick", wrap=True)
    ax.plot(project_ns, project_ns, "k:", label="ideal")
    where = (f"projected, {cm.get('preset_label', cm.get('preset'))}"
             if cm.get("source") == "projection" else "predicted, this machine")
    ax.plot(project_ns, predicted_speedups(cm, project_ns), "--", color="gray",
            label=f"{where} ({cm['bandwidth_Bps'] / 1e9:.2f} GB/s)")
    for pname, gbps in (cm.get("projections") or {}).items():
        ax.plot(project_ns, predicted_speedups(cm, project_ns, bandwidth_Bps=gbps * 1e9),
                "--", label=f"predicted, {pname}")
    for mname in ("ddp_spawn", CONTROL):
        pts = sorted((r["nprocs"], r["speedup"]) for r in recs
                     if r["method"] == mname and r.get("speedup") is not None)
        if len(pts) > 1:
            colour, marker = styles[mname]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, color=colour,
                    label=f"measured {mname}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("N (ranks)")
    ax.set_ylabel("speedup")
    ax.set_title(f"Cost model of {cm['grad_bytes'] / 1e3:.0f} KB of gradients, "
                 f"{cm['scaling']} scaling\n(dashed = predicted, not measured)", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def make_plots(result: dict, out: Path, project_ns=(1, 2, 4, 8, 16, 64)) -> list[Path]:
    """speedup, efficiency, step split, throughput, memory, cost model, batch sweep and
    time-to-accuracy PNGs
    (and scaling lines over N when the run went beyond N = 2). Returns the paths."""
    import matplotlib.pyplot as plt

    recs = _ok(result)
    label = result["machine"]["label"]
    paths = []
    names = list(dict.fromkeys(r["method"] for r in recs))
    styles = method_styles(names)
    multi = [mm for mm in names if any(r["method"] == mm and r["nprocs"] > 1 for r in recs)]
    rounds = result["config"].get("rounds", 1)
    ci_note = (f"95% intervals over {rounds} interleaved rounds" if rounds > 1
               else "one run, no intervals")
    cm = result.get("cost_model")

    def save(fig, name, marked="hatched bars", shown=None):
        _busy_note(fig, result, marked, shown)
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    if multi:
        for key, ideal, ylabel, fname, what in (
                ("speedup", lambda n: n, "speedup (samples/s over N=1)", "speedup.png",
                 "Speedup"),
                ("efficiency", lambda n: 1.0, "efficiency (speedup / N)", "efficiency.png",
                 "Scaling efficiency")):
            fig, ax = plt.subplots(figsize=(max(7.0, 0.55 * len(multi) + 2.5), 4.6))
            _grouped_bars(ax, recs, multi, styles, key, ideal, ylabel)
            ax.set_title(f"{what} over N=1 ({ci_note}): {label}", fontsize=9)
            save(fig, fname)

    if len({r["nprocs"] for r in recs}) > 2:  # lines over N only with more than 2 devices
        fig, ax = plt.subplots(figsize=(7, 4.6))
        ns_all = sorted({r["nprocs"] for r in recs})
        ax.plot(ns_all, ns_all, "k--", lw=1, label="ideal (N x)")
        for mname in multi:
            pts = sorted((r["nprocs"], r) for r in recs if r["method"] == mname
                         and r.get("speedup") is not None)
            if len(pts) < 2:
                continue
            xs = [p[0] for p in pts]
            ys = [p[1]["speedup"] for p in pts]
            err = [[y - (p[1].get("speedup_lo") or y) for y, p in zip(ys, pts)],
                   [(p[1].get("speedup_hi") or y) - y for y, p in zip(ys, pts)]]
            colour, marker = styles[mname]
            ax.errorbar(xs, ys, yerr=err, color=colour, marker=marker, capsize=3, label=mname)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns_all)
        ax.set_xticklabels([str(n) for n in ns_all])
        ax.set_xlabel("N (ranks)")
        ax.set_ylabel("speedup")
        ax.set_title(f"Speedup over N ({ci_note}): {label}", fontsize=9)
        ax.legend(fontsize=7, ncol=2)
        save(fig, "scaling.png", marked="some results")

    split = [r for r in recs if "comm_s" in r and r["nprocs"] > 1]
    if split:
        fig, ax = plt.subplots(figsize=(max(7.0, 0.6 * len(split) + 2), 4))
        xnames = [f"{r['method']}\nN={r['nprocs']}" for r in split]
        comp = [1000 * r["compute_s"] for r in split]
        comm = [1000 * r["comm_s"] for r in split]
        xs = range(len(split))
        ax.bar(xs, comp, color="tab:blue", label="compute")
        ax.bar(xs, comm, bottom=comp, color="tab:orange", label="communication + waiting")
        ax.set_xticks(xs)
        ax.set_xticklabels(xnames, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("ms per step (median)")
        ax.set_title(f"Where a step's time goes at N > 1: {label}", fontsize=9)
        ax.legend(fontsize=8, loc="lower right", framealpha=0.9)
        save(fig, "step_split.png", marked="some results")

    for key, ylabel, fname in (("samples_per_s", "samples / s", "throughput.png"),
                               ("peak_mem_mb", "peak memory per rank (MB)", "memory.png")):
        fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(names) + 2.5), 4))
        ns_all = sorted({r["nprocs"] for r in recs})
        width = 0.8 / max(1, len(ns_all))
        for j, mname in enumerate(names):
            colour, marker = styles[mname]
            for i, n in enumerate(ns_all):
                r = next((q for q in recs if q["method"] == mname and q["nprocs"] == n), None)
                if r is None:
                    continue
                x = j + (i - (len(ns_all) - 1) / 2) * width
                busy = r.get("reliability") == BUSY
                ax.bar(x, r[key], width * 0.9, color=colour,
                       alpha=(0.35 + 0.6 * (i + 1) / len(ns_all)) * (0.6 if busy else 1),
                       hatch="///" if busy else None)
                lo, hi = r.get(f"{key}_lo"), r.get(f"{key}_hi")
                if lo is not None:
                    ax.errorbar(x, r[key], yerr=[[r[key] - lo], [hi - r[key]]], fmt=marker,
                                color="black", ms=4, capsize=2, lw=1)
                ax.annotate(str(n), (x, 0), fontsize=6, ha="center", va="bottom")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(ylabel + (f" [{recs[0]['mem_kind']}]" if key == "peak_mem_mb" and recs
                                else ""))
        ax.set_title(f"{ylabel} (the figure at each bar's foot is N): {label}", fontsize=9)
        save(fig, fname)

    if cm:
        save(cost_model_figure(result, cm, recs, styles, project_ns), "costmodel.png",
             marked="measured points",
             shown=[r for r in recs if r["method"] in ("ddp_spawn", CONTROL)])

    sweep = _ok(result, sweep=True)
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4))
        bs = sorted({r["per_rank_batch"] for r in sweep})
        for n in sorted({r["nprocs"] for r in sweep}):
            pts = sorted((r["per_rank_batch"], r) for r in sweep if r["nprocs"] == n)
            ys = [p[1]["samples_per_s"] for p in pts]
            err = [[y - (p[1].get("samples_per_s_lo") or y) for y, p in zip(ys, pts)],
                   [(p[1].get("samples_per_s_hi") or y) - y for y, p in zip(ys, pts)]]
            ax.errorbar([p[0] for p in pts], ys, yerr=err, marker="os^D"[n % 4], capsize=3,
                        label=f"{sweep[0]['method']} N={n}")
            for b, r in pts:
                sp = r.get("speedup", r.get("sweep_speedup"))
                if sp is not None and n > 1:
                    ax.annotate(f"{sp:.2f}x" + (" busy" if r.get("reliability") == BUSY else ""),
                                (b, r["samples_per_s"]), textcoords="offset points",
                                xytext=(0, 6), fontsize=7, ha="center")
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs)
        ax.set_xticklabels([str(b) for b in bs])
        ax.set_xlabel("batch per rank")
        ax.set_ylabel("samples / s")
        ax.set_title("Per-rank batch size: compute against communication (labels: speedup)",
                     fontsize=9)
        ax.legend(fontsize=8)
        save(fig, "batch_sweep.png", marked="labels ending in 'busy'")
    tta = result.get("time_to_accuracy")
    if tta and any(r.get("seconds") is not None for r in tta["by_n"]):
        from benchmarks.time_to_accuracy import plot as plot_tta

        paths.append(out / "time_to_accuracy.png")
        plot_tta(tta, paths[-1], label)
    return paths


# ------------------------------------------------------------------------------- CLI


def parse_list(text: str | None, kind=str):
    return [kind(x) for x in text.split(",") if x.strip()] if text else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Time 1-vs-N runs of every method; plot speedups.")
    p.add_argument("--quick", action="store_true",
                   help="a short run (under 5 min on 2 cores; on GPUs N = 1 and all of them, "
                        "as many rounds as fit in 4.5 min)")
    p.add_argument("--methods", default=os.environ.get("METHODS") or None,
                   help="comma-separated subset (default: all registered; with --quick, "
                        "those not marked full-run only)")
    p.add_argument("--nprocs", default=os.environ.get("NPROCS") or None,
                   help="comma-separated N values (default: 1, 2, 4, ... up to the devices; "
                        "with DPT_SHARE_GPU=1 up to 4 ranks on one GPU)")
    p.add_argument("--strong", action="store_true", help="fixed global batch (strong scaling)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--model", default="convnet", help="convnet, mlp or fashioncnn")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--no-pin", action="store_true",
                   help="CPU runs: let the OS place the ranks instead of giving each its own "
                        "core(s)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per launch")
    p.add_argument("--repeat-budget", type=float, default=None, metavar="SECONDS",
                   help="cut a repeat of a slow step to about this long, never under 2 steps "
                        "(default 3, 1.5 with --quick; 0: always --steps)")
    p.add_argument("--min-repeat", type=float, default=None, metavar="SECONDS",
                   help="time at least this long a repeat, taking more steps than --steps when "
                        "a step is fast (default 0.1: a GPU step of 1-2 ms)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop launching once the run has spent this long (default: no limit; "
                        f"{QUICK_GPU_BUDGET_S:.0f} with --quick on GPUs; 0: no limit)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved launches of every (method, N); intervals need 2 or more")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--timeout", type=float, default=None, help="seconds per launch")
    p.add_argument("--control-floor", type=float, default=None,
                   help="efficiency the `independent` control must reach, else the machine "
                        "was busy (default 0.85)")
    p.add_argument("--no-control", action="store_true",
                   help="do not add the `independent` control to a --methods subset")
    p.add_argument("--no-sweep", action="store_true", help="skip the per-rank batch sweep")
    p.add_argument("--sweep-method", default="ddp_spawn")
    p.add_argument("--no-tta", action="store_true",
                   help="skip time to accuracy (N = 1 and the largest N trained to a target "
                        "test accuracy after the throughput rounds)")
    p.add_argument("--tta-target", type=float, default=None, metavar="ACCURACY",
                   help=f"time to accuracy's target, between 0 and 1 (default "
                        f"{TTAConfig.target:g}); with --methods it also turns it on")
    p.add_argument("--project-bandwidth", type=float, action="append", default=[],
                   help="GB/s of a target interconnect to project onto (repeatable)")
    p.add_argument("--project", action="append", default=[], choices=sorted(INTERCONNECTS),
                   help="a named interconnect to project onto (repeatable)")
    p.add_argument("--interconnect", default=None, choices=sorted(PRESETS),
                   help="the interconnect the cost model projects onto instead of fitting this "
                        "machine's all-reduce (on one device the default is the GPUs' likely "
                        "one: NVLink 4 for an H100 SXM, NVLink 3 for an A100, else PCIe 4 x16)")
    p.add_argument("--out", type=Path, default=RUNS,
                   help="folder for the runs: each goes to OUT/<stamp>/, OUT/latest links to "
                        "the last good one (default benchmarks/runs, ignored by git)")
    p.add_argument("--list", action="store_true", help="list the registered methods and exit")
    return p


def link_latest(root: Path, run_dir: Path) -> None:
    """Point ``root/latest`` at ``run_dir`` (atomically); ``root/LATEST`` names it in text."""
    tmp = root / f".latest-{os.getpid()}"
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(run_dir.name, tmp, target_is_directory=True)
        os.replace(tmp, root / "latest")
    except OSError:  # no symbolic links here (or `latest` is a real folder): the text pointer
        if tmp.is_symlink():
            tmp.unlink()
    write_atomic(root / "LATEST", run_dir.name + "\n")


class UsageError(ValueError):
    """Bad command-line input: main prints it as one ``error:`` line and exits with 2."""


# Planning a run's length (--quick on GPUs, --time-budget): what one launch costs beyond its
# timed repeats. Starting the ranks (a fork of a server that has imported torch, or a new
# interpreter under torchrun), CUDA and NCCL start-up, building the model and the warm-up
# steps. Generous figures for a GPU machine; whatever launches really cost, the run stops
# launching when its budget is spent (TimeBudget).
LAUNCH_OVERHEAD_S = {"spawn": 6.0, "torchrun": 15.0}
CURVE_S = 20.0  # the all-reduce curve: one launch at the largest N
# --quick on GPUs: seconds of launches, so that the run (imports, plots) ends within 5 minutes
QUICK_GPU_BUDGET_S = 270.0


def launch_estimate_s(launcher: str, cfg: Config) -> float:
    """The planned cost of one launch: its start-up, then each repeat of the step and of its
    compute-only twin, each repeat cut to about ``repeat_budget_s`` (or ``min_repeat_s``)."""
    repeat = max(cfg.repeat_budget_s or cfg.min_repeat_s, cfg.min_repeat_s)
    return LAUNCH_OVERHEAD_S.get(launcher, LAUNCH_OVERHEAD_S["torchrun"]) + cfg.repeats * 2 * repeat


class TimeBudget:
    """Launches stop once the next one would end past ``seconds`` from the start.

    The next launch's cost is its planned estimate, scaled by the largest ratio of a launch's
    real cost to its estimate so far (a slower machine than planned shows in its first
    launch), and never less than the longest launch of the same kind (launcher, N) so far.
    Only a launch slower than every one before it can end past the budget. ``seconds`` None:
    no limit.
    """

    def __init__(self, seconds: float | None, clock=time.monotonic):
        self.seconds, self.clock = seconds, clock
        self.start = clock()
        self.longest: dict[tuple, float] = {}
        self.slowdown = 1.0
        self.refused = 0

    def elapsed(self) -> float:
        return self.clock() - self.start

    def cost(self, kind: tuple, estimate_s: float) -> float:
        return max(estimate_s * self.slowdown, self.longest.get(kind, 0.0))

    def allows(self, kind: tuple, estimate_s: float) -> bool:
        if self.seconds is None:
            return True
        if self.elapsed() + self.cost(kind, estimate_s) > self.seconds:
            self.refused += 1
            return False
        return True

    def spent(self, kind: tuple, estimate_s: float, seconds: float) -> None:
        self.longest[kind] = max(seconds, self.longest.get(kind, 0.0))
        if estimate_s > 0:
            self.slowdown = max(self.slowdown, seconds / estimate_s)


@dataclass
class Plan:
    cfg: Config
    names: list[str]
    ns: list[int]
    groups: list  # (records of one method at every N, that group's Config)
    records: list[dict]
    planned_s: float  # the launches' planned length, curve included
    per_round_s: float
    placement: tuple[str, str]  # (backend, device type) at the largest N
    tta_ns: list[int] = field(default_factory=list)  # time to accuracy's N values, or none

    def text(self) -> str:
        launches = sum(r["status"] == "ok" for r in self.records)
        budget = self.cfg.time_budget_s
        return (f"plan: {launches} launch(es) a round x {self.cfg.rounds} round(s)"
                + (" + the all-reduce curve" if max(self.ns) > 1 else "")
                + (f" + {len(self.tta_ns)} time-to-accuracy launch(es) a round"
                   if self.tta_ns else "")
                + f", planned {'at most' if budget else 'about'} {self.planned_s / 60:.1f} min"
                + (f" (budget {budget / 60:.1f} min: launches stop when it is spent)"
                   if budget else ""))


def plan_run(args: argparse.Namespace, methods) -> Plan:
    """The run ``args`` ask for, without running it: the configuration, N values, records
    and the planned length. ``--quick`` on GPUs takes N = 1 and the largest N, no batch sweep,
    and as many rounds (at most 3, at least 1) as fit in ``QUICK_GPU_BUDGET_S``. Raises
    :class:`UsageError` on bad input."""
    cfg = Config(threads_per_rank=args.threads_per_rank, strong=args.strong, model=args.model,
                 pin=not args.no_pin, named=parse_list(args.methods) or [])
    names = parse_list(args.methods) or [n for n, m in methods.items()
                                         if m.quick or not args.quick]
    unknown = [n for n in names if n not in methods]
    if unknown:
        raise UsageError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(methods)}")
    try:
        asked_ns = parse_list(args.nprocs, int)
    except ValueError:
        raise UsageError(f"--nprocs takes integers like 1,2,4, got {args.nprocs!r}") from None
    ns = sorted(set(asked_ns or default_nprocs(quick=args.quick)))
    if any(n < 1 for n in ns):
        raise UsageError("every N in --nprocs must be at least 1")
    placement = rank_placement(max(ns))
    on_gpu = placement[1] == "cuda"
    sweep = not args.no_sweep and not args.methods and max(ns) > 1
    # Time to accuracy: in a full run, or a --methods subset that asks for it with a target
    cfg.tta = (not args.no_tta and max(ns) > 1
               and (not args.methods or args.tta_target is not None))
    if args.tta_target is not None:
        if not 0 < args.tta_target < 1:
            raise UsageError(f"--tta-target is a test accuracy between 0 and 1, got "
                             f"{args.tta_target:g}")
        cfg.tta_target = args.tta_target
    if args.quick:
        cfg.warmup, cfg.steps, cfg.repeats, cfg.rounds, cfg.timeout = 2, 4, 1, 3, 180.0
        cfg.repeat_budget_s = 1.5
        cfg.batch_size = 128
        cfg.sweep_batches = [64, 512]
        cfg.allreduce_sizes = [2**k for k in range(12, 23, 2)]
        if on_gpu:  # steps of milliseconds: a repeat of 0.1-0.5 s measures them
            cfg.repeat_budget_s, cfg.timeout = 0.5, 120.0
            cfg.time_budget_s = QUICK_GPU_BUDGET_S
            sweep = False
    for key in ("batch_size", "steps", "repeats", "warmup", "rounds"):
        if getattr(args, key) is not None:
            if getattr(args, key) < (0 if key == "warmup" else 1):
                raise UsageError(f"--{key.replace('_', '-')} must be positive")
            setattr(cfg, key, getattr(args, key))
    for flag, key in (("--repeat-budget", "repeat_budget"), ("--min-repeat", "min_repeat"),
                      ("--time-budget", "time_budget")):
        value = getattr(args, key)
        if value is not None and not value >= 0:
            raise UsageError(f"{flag} is seconds, 0 or more")
    if args.repeat_budget is not None:
        cfg.repeat_budget_s = args.repeat_budget
    if args.min_repeat is not None:
        cfg.min_repeat_s = args.min_repeat
    if args.time_budget is not None:
        cfg.time_budget_s = args.time_budget or None  # 0: no limit
    if args.timeout:
        cfg.timeout = args.timeout
    if args.control_floor is not None:
        if not 0 < args.control_floor <= 1:
            raise UsageError("--control-floor is an efficiency between 0 and 1")
        cfg.control_floor = args.control_floor
    cfg.tta_rounds = cfg.rounds
    if max(ns) > 1 and CONTROL not in names and not args.no_control and CONTROL in methods:
        names.insert(0, CONTROL)  # the control runs in the same rounds as everything else

    # Every (method, N) is a record; a round launches each once, N=1 and N=k back to back,
    # the order flipped every other round, so slow drifts of the machine hit both alike, and
    # the methods shuffled anew each round (round_schedule).
    records, groups = [], []
    for name in names:
        group = [new_record(name, n, cfg, methods) for n in ns]
        records += group
        groups.append((group, cfg))
    if sweep and args.sweep_method in methods:
        for b in cfg.sweep_batches:
            group = [new_record(args.sweep_method, n, cfg, methods, sweep=b)
                     for n in sorted({1, max(ns)})]
            records += group
            groups.append((group, replace(cfg, batch_size=b)))
    per_round = sum(launch_estimate_s(methods[r["method"]].launcher, gcfg)
                    for group, gcfg in groups for r in group if r["status"] == "ok")
    tta_ns = sorted({1, max(ns)}) if cfg.tta else []
    per_round += len(tta_ns) * tta_estimate_s(cfg)
    curve = CURVE_S if max(ns) > 1 else 0.0
    if args.quick and on_gpu and args.rounds is None and cfg.time_budget_s and per_round:
        cfg.rounds = max(1, min(cfg.rounds, int((cfg.time_budget_s - curve) // per_round)))
        cfg.tta_rounds = cfg.rounds
    for i, (group, gcfg) in enumerate(groups):  # the sweep's copies take the final rounds
        groups[i] = (group, replace(gcfg, rounds=cfg.rounds, time_budget_s=cfg.time_budget_s))
    return Plan(cfg, names, ns, groups, records, curve + per_round * cfg.rounds, per_round,
                placement, tta_ns)


def tta_config(cfg: Config) -> TTAConfig:
    """Time to accuracy's configuration, from the run's."""
    return TTAConfig(target=cfg.tta_target, rounds=cfg.tta_rounds, margin=cfg.tta_margin,
                     max_epochs=cfg.tta_max_epochs, timeout=cfg.timeout)


def tta_estimate_s(cfg: Config) -> float:
    from benchmarks.time_to_accuracy import estimate_s

    return estimate_s(tta_config(cfg), LAUNCH_OVERHEAD_S["spawn"])


def cost_model_of(curve: list, nmax: int, records: list[dict], cfg: Config,
                  machine: dict, interconnect: str | None,
                  extra: dict[str, float]) -> dict | None:
    """The cost model the results carry, or None without an N = 1 step time.

    Fitted to this machine's all-reduce curve when there was one (``source: measured``);
    on one device (or when the fit fails) a projection onto a named interconnect
    (``source: projection``): ``interconnect``, else the likely one of these GPUs
    (:func:`benchmarks.costmodel.default_interconnect`). ``predicted_speedup`` is the
    model's speedup at N = 2, 4, 8 under the run's scaling.
    """
    one = next((r for r in records if r["status"] == "ok" and r["nprocs"] == 1 and
                r.get("sweep") is None and "step_s" in r and
                r["method"] in (CONTROL, "ddp_spawn", "single")), None)
    if one is None:
        return None
    model = None if interconnect else fit_cost_model(curve, nmax)
    cm: dict = {"scaling": "strong" if cfg.strong else "weak", "compute_s": one["step_s"],
                "compute_from": one["method"], "grad_bytes": grad_bytes(cfg.model)}
    if model is not None:
        cm.update(source="measured", fit_nprocs=nmax)
    else:
        name = interconnect or default_interconnect(machine.get("cuda_devices") or [])
        model = RingModel.preset(name)
        why = ("chosen with --interconnect" if interconnect else
               "one device: no all-reduce to time" if nmax < 2 else
               "the all-reduce curve could not be fitted")
        cm.update(source="projection", preset=name, preset_label=PRESETS[name].label,
                  fit_nprocs=None, why=why)
    cm.update(alpha_s=model.alpha_s, bandwidth_Bps=model.bandwidth_Bps, projections=extra)
    cm["predicted_speedup"] = {str(n): v for n, v in zip(
        (2, 4, 8), predicted_speedups(cm, (2, 4, 8)))}
    return cm


def predicted_speedups(cm: dict, ns, bandwidth_Bps: float | None = None,
                       alpha_s: float | None = None) -> list[float]:
    """The cost model's speedup at each N of ``ns``, under the scaling it was measured with
    (weak: compute per rank fixed; strong: the global batch split N ways). ``bandwidth_Bps``
    and ``alpha_s`` replace the model's, to project onto another interconnect."""
    model = RingModel(cm["alpha_s"] if alpha_s is None else alpha_s,
                      cm["bandwidth_Bps"] if bandwidth_Bps is None else bandwidth_Bps)
    strong = cm.get("scaling") == "strong"
    return [model.speedup(n, cm["compute_s"], cm["grad_bytes"], strong=strong) for n in ns]


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")  # files only; a notebook calling make_plots keeps its own backend
    args = build_parser().parse_args(argv)
    methods = load_all()
    if args.list:
        for m in methods.values():
            needs = [REQUIREMENT_NAMES.get(r, r) for r in m.requires]
            req = f" (requires {', '.join(needs)})" if needs else ""
            full = "" if m.quick else " [full run only: not in --quick]"
            print(f"{m.name:<26}{m.description}{req}{full}")
        return 0
    try:
        plan = plan_run(args, methods)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg, names, ns, groups, records = plan.cfg, plan.names, plan.ns, plan.groups, plan.records
    from dpt.dist import cpu_budget

    if plan.placement[1] == "cpu" and max(ns) * cfg.threads_per_rank > cpu_budget():
        print(f"warning: {max(ns)} ranks x {cfg.threads_per_rank} threads exceeds the "
              f"{cpu_budget()} cores: those runs are oversubscribed", file=sys.stderr)

    from tqdm.auto import tqdm

    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    machine = machine_info(cfg.threads_per_rank, max(ns))
    print(f"benchmark on {machine['label']}: methods {', '.join(names)}; N in {ns}; "
          f"{cfg.rounds} interleaved round(s)", flush=True)
    print(plan.text(), flush=True)
    runnable = sum(r["status"] == "ok" for r in records)
    bar = tqdm(total=runnable * cfg.rounds + (1 if max(ns) > 1 else 0), unit="run",
               dynamic_ncols=True)
    curve = []
    budget = TimeBudget(cfg.time_budget_s, clock=_clock)
    started = time.monotonic()
    if max(ns) > 1:
        bar.set_description(f"all-reduce curve N={max(ns)}")
        try:
            from dpt.ranks import run_distributed

            curve = run_distributed(allreduce_curve, world_size=max(ns),
                                    args=(cfg.allreduce_sizes,), timeout=cfg.timeout,
                                    threads=cfg.threads_per_rank, echo=False)[0]
        except Exception as exc:  # noqa: BLE001 - the sweep goes on without a cost model
            tqdm.write(f"all-reduce curve failed: {exc}")
        bar.update()
    from dpt.ranks import restart_fork_server

    for rnd in range(cfg.rounds):
        if cfg.new_fork_server_each_round:
            try:  # a new address-space layout for this round's ranks
                restart_fork_server()
            except Exception as exc:  # noqa: BLE001 - the round goes on with the old server
                tqdm.write(f"round {rnd + 1}: could not restart the fork server: {exc}")
        for g, flip in round_schedule(len(groups), rnd):
            group, gcfg = groups[g]
            for rec in (group[::-1] if flip else group):
                if rec["status"] != "ok":
                    continue
                launcher = methods[rec["method"]].launcher
                kind = (launcher, rec["nprocs"])
                estimate = launch_estimate_s(launcher, gcfg)
                if not budget.allows(kind, estimate):
                    rec["budget_cut"] = True
                    bar.update()
                    continue
                tag = f" batch={rec['sweep']}" if "sweep" in rec else ""
                bar.set_description(f"round {rnd + 1}/{cfg.rounds} {rec['method']}{tag} "
                                    f"N={rec['nprocs']}")
                t0 = _clock()
                res = launch(rec["method"], rec["nprocs"], gcfg, methods, rnd)
                budget.spent(kind, estimate, _clock() - t0)
                add_round(rec, res)
                if res["status"] == "ok":
                    msg = (f"{rec['method'] + tag:<28} N={rec['nprocs']} round {rnd + 1}: "
                           f"{res['samples_per_s']:8.0f} samples/s")
                else:
                    msg = (f"{rec['method'] + tag:<28} N={rec['nprocs']} round {rnd + 1}: "
                           f"{res['status']}: {res.get('error', '')}")
                    bar.total -= cfg.rounds - rnd - 1
                tqdm.write(msg)
                bar.update()
    bar.close()
    for rec in records:
        cut = rec.pop("budget_cut", False)
        if rec["status"] == "ok" and not rec["rounds"]:
            rec.update(status="skipped" if cut else "failed",
                       error=(f"not run: the time budget of {cfg.time_budget_s:.0f} s was "
                              "spent (--time-budget)") if cut else "no round ran")
        elif cut:
            rec.setdefault("notes", []).append(
                f"{len(rec['rounds'])} of {cfg.rounds} rounds: the time budget of "
                f"{cfg.time_budget_s:.0f} s was spent")
        finish_record(rec)
    tta_runs = []
    if plan.tta_ns:
        from benchmarks.time_to_accuracy import run_rounds

        tcfg = tta_config(cfg)
        print(f"time to accuracy: N in {plan.tta_ns}, {tcfg.rounds} round(s), target "
              f"{tcfg.target:g} test accuracy", flush=True)
        tbar = tqdm(total=len(plan.tta_ns) * tcfg.rounds, unit="run", dynamic_ncols=True)
        tta_runs = run_rounds(plan.tta_ns, tcfg, cfg.threads_per_rank, budget=budget, bar=tbar,
                              say=tqdm.write, overhead_s=LAUNCH_OVERHEAD_S["spawn"],
                              snapshot=snapshot, hz=_hz())
        tbar.close()
    if budget.refused:
        print(f"the time budget ({cfg.time_budget_s:.0f} s) was spent: {budget.refused} "
              "launch(es) not run", file=sys.stderr)
    add_speedups(records)
    for r in records:  # the batch sweep's speedup under its old name too
        if r.get("sweep") is not None and r.get("speedup") is not None and r["nprocs"] > 1:
            r["sweep_speedup"] = r["speedup"]
    try:
        mfu = add_mfu(records, cfg.model, plan.placement[1], cfg.threads_per_rank)
    except Exception as exc:  # noqa: BLE001 - the results stand without MFU
        mfu = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"MFU not computed: {mfu['error']}", file=sys.stderr)
    verdict = judge(records, cfg.control_floor)

    result = {"stamp": stamp, "machine": machine,
              "config": {**asdict(cfg), "scaling": "strong" if cfg.strong else "weak",
                         "methods": names, "nprocs": ns, "quick": args.quick,
                         "planned_s": round(plan.planned_s, 1)},
              "wall_s": round(time.monotonic() - started, 1),
              "allreduce_curve": curve, "records": records,
              "ratios": throughput_ratios(records, RATIO_PAIRS), "verdict": verdict,
              "mfu": mfu}
    extra = {f"{g:g} GB/s": g for g in args.project_bandwidth}
    extra.update({name: INTERCONNECTS[name] for name in args.project})
    cm = cost_model_of(curve, max(ns), records, cfg, machine, args.interconnect, extra)
    if cm:
        result["cost_model"] = cm
    if plan.tta_ns:
        from benchmarks.time_to_accuracy import block_of

        result["time_to_accuracy"] = block_of(tta_config(cfg), tta_runs, records)

    run_dir = args.out / stamp
    run_dir.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r["status"] == "ok" and "samples_per_s" in r]
    write_atomic(run_dir / "results.json", json.dumps(result, indent=1))
    write_atomic(run_dir / "results.csv", records_csv(records))
    summary = summary_markdown(result)
    write_atomic(run_dir / "summary.md", summary)
    print("\n" + summary)
    if ok:  # an empty or failed run never becomes `latest`
        for p in make_plots(result, run_dir):
            print(f"wrote {p}")
        link_latest(args.out, run_dir)
    else:
        print("no method succeeded: `latest` still points at the last good run",
              file=sys.stderr)
    print(f"wrote {run_dir / 'results.json'}, results.csv and summary.md "
          f"({result['wall_s'] / 60:.1f} min)")
    print("\n" + "\n".join(verdict["messages"]))
    return 0 if ok else 1


CSV_FIELDS = ["method", "nprocs", "status", "reliability", "scaling", "per_rank_batch",
              "global_batch", "samples_per_s", "samples_per_s_lo", "samples_per_s_hi",
              "speedup", "speedup_lo", "speedup_hi", "efficiency", "efficiency_lo",
              "efficiency_hi", "rounds_ok", "step_s", "step_s_min", "step_s_max", "compute_s",
              "comm_s", "compute_dtype", "flops_per_step", "flops_per_sample",
              "achieved_tflops", "achieved_tflops_per_rank", "peak_tflops", "mfu", "mfu_lo",
              "mfu_hi", "peak_label", "peak_mem_mb", "mem_kind", "final_loss",
              "threads_per_rank", "sweep", "timed_steps",
              "flags", "notes", "error"]


def records_csv(records: list[dict]) -> str:
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in records:
        w.writerow({**r, "flags": "; ".join(r.get("flags", [])),
                    "notes": "; ".join(r.get("notes", []))})
    return buf.getvalue()


if __name__ == "__main__":
    sys.exit(main())
