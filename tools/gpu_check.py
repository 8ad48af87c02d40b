"""The GPU acceptance run: every GPU path of the course, side by side, under one time cap.

    make gpu-check                 # or: python tools/gpu_check.py [--budget S] [--only a,b]

Run it first on a GPU machine (one GPU or N). The items are the lesson scripts on cuda (the
multi-rank ones at N=2 and at the largest N; on one GPU at N=2 and N=4 with the ranks sharing
it, ``DPT_SHARE_GPU=1``), the whole test suite, every notebook and the quick benchmark. A
scheduler runs them side by side: each item gets its own cores (CPU affinity, so the ranks of
two items do not fight over threads), items that time something get the GPUs to themselves,
and the whole run stops at one overall cap (10 minutes on one GPU, 20 on eight; ``--budget``).
An item still running at the cap is stopped, its whole process tree killed, and reported as
failed. The checklist (pass, fail, or skipped with the reason) is written as JSON and
Markdown to ``--out`` (default ``runs/gpu-check/``, untracked), with the machine it ran on;
``--commit`` also copies the Markdown to ``docs/gpu-check/<gpus>-<date>.md``, the tracked
record that the GPU column of docs/machines.md quotes. On a machine without CUDA it says so in
one line and exits with status 3.

The suite and the notebooks are required items: a check without them checks nothing. When
this Python cannot import what they need (pytest and its plugins, the Jupyter stack, the
course's own dependencies) the run stops before starting anything, with one line naming what
is missing and how to get it, and exits with status 4; ``--commit`` refuses a checklist in
which a required item did not run to the end. Items written in a low precision compute in the
one the course's rule picks for the GPUs (``dpt.precision.low_precision_for``: bf16 from
compute capability 8, fp16 below, where bf16 is emulated), and say which.

A GPU machine with torch preinstalled and no network (a cluster node, a container) lacks the
data and, often, the Jupyter stack the notebooks need: ``tools/offline_bundle.sh`` packs both on
a machine with PyPI, and ``--install`` unpacks them there (its header shows the commands).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORDS = REPO / "docs" / "gpu-check"
NO_GPU_EXIT = 3
MISSING_TOOLS_EXIT = 4
S = "solutions"
CAP_ONE_GPU_S = 600.0  # the overall cap on one GPU ...
CAP_EIGHT_GPUS_S = 1200.0  # ... and on eight; in between (and beyond) it grows linearly
SHARE = {"DPT_SHARE_GPU": "1"}
NOTEBOOKS = "tests/harness/test_notebooks.py::test_notebook_runs_top_to_bottom"  # each one
# What the suite and the notebooks import besides torch (tests/harness/test_gpu_check.py scans
# the course's imports to keep this complete), by module name; pip's name where it differs.
COURSE_NEEDS = ("pytest", "pytest_timeout", "xdist", "nbformat", "nbclient", "ipykernel",
                "IPython", "jupytext", "matplotlib", "tqdm", "torchvision", "pytorch_lightning",
                "lightning_fabric", "torchmetrics")
DISTRIBUTIONS = {"pytest_timeout": "pytest-timeout", "xdist": "pytest-xdist",
                 "IPython": "ipython", "pytorch_lightning": "pytorch-lightning",
                 "lightning_fabric": "pytorch-lightning"}
# They depend on torch (torchvision on one release of it): tools/offline_bundle.sh packs them
# only for a torch version it is given, without torch; every other one, with its dependencies.
WITH_TORCH = ("torchvision", "pytorch-lightning", "torchmetrics")
LIGHTNING_SHARED = ("Lightning's strategies start NCCL themselves, and NCCL refuses two ranks "
                    "on one GPU: needs {n} GPUs")


# The quick benchmark's summary on GPUs: a row's MFU (with its dtype) and the sentence naming
# the peak, from the datasheet (dpt.flops.PEAK_TFLOPS) or the probe on a GPU without an entry
BENCH_MFU = (r"\| [\d.]+%( \[[^\]]*\])? (fp32|bf16|fp16) \|",
             r"MFU = achieved FLOP/s .* TFLOP/s \(([^()]* datasheet, dense|measured peak)")


@dataclass
class Item:
    """One command of the check.

    ``gpu``: "exclusive" (NCCL over every GPU, or a timing: no other exclusive or shared item
    beside it), "shared" (a few ranks: beside other shared items, the course's models being a
    few MB) or "light" (CPU only, or one process briefly on one GPU: beside anything).
    ``cpus``: the cores it gets to itself. ``estimate``: the seconds it is expected to take on
    a GPU machine, for the plan; ``timeout``: the most it may take.
    """

    name: str
    what: str
    argv: list[str]
    gpu: str = "shared"
    cpus: int = 1
    estimate: float = 30
    timeout: float = 240
    env: dict[str, str] = field(default_factory=dict)
    expect: tuple[str, ...] = ()  # regular expressions the output must match
    needs: tuple[str, ...] = ()  # modules the Python running the check must import
    xdist: tuple[str, ...] = ()  # pytest's -n flag, used when pytest-xdist is installed
    skip: str | None = None  # a reason this item cannot run on this machine
    required: bool = False  # the check means nothing without it: it may not be skipped
    bench_ns: tuple[int, ...] = ()  # the benchmark: each N needs an ok record


def overall_cap(n_gpus: int) -> float:
    """Seconds the whole check may take: 10 minutes on one GPU, 20 on eight."""
    per_gpu = (CAP_EIGHT_GPUS_S - CAP_ONE_GPU_S) / 7
    return CAP_ONE_GPU_S + per_gpu * (max(n_gpus, 1) - 1)


def rank_counts(n_gpus: int) -> tuple[list[int], bool]:
    """The N of every multi-rank item, and whether the ranks share GPUs to get there."""
    if n_gpus >= 2:
        return sorted({2, n_gpus}), False
    return [2, 4], True


def suite_workers(cores: int) -> int:
    """pytest-xdist workers for the suite: a quarter of the cores (its tests start 2-3 ranks
    each), leaving the rest to the GPU items."""
    return max(1, min(16, cores // 4))


def notebook_workers(cores: int) -> int:
    return max(1, min(4, cores // 6))


def dp_by_hand_argv(py: str, n_gpus: int, tmp: Path) -> list[str]:
    """Lesson 02's DataParallel written by hand (scatter, replicate, gather) on the GPUs: on
    2+ GPUs the timing study times ``DataParallelByHand`` over every GPU beside
    ``nn.DataParallel`` and one GPU (on one GPU it would time CPU replicas instead)."""
    return [py, f"{S}/02_data_parallel/dp_timing.py", "--devices", str(n_gpus),
            "--batch-sizes", "8,64,512", "--repeats", "3", "--warmup", "1",
            "--out", str(tmp / "dp_timing")]


def ddp_line(n: int, shared: bool) -> str:
    """The line dpt.cli prints when N ranks start: their backend and rank 0's device."""
    return rf"world size {n}, backend {'gloo' if shared else 'nccl'}, cuda:\d"


def low_precision(capability: tuple[int, int]) -> tuple[str, str]:
    """The 16-bit format the course's rule picks for GPUs whose lowest compute capability is
    ``capability``, and why, in the words an item's ``what`` gives."""
    from dpt.precision import low_precision_for

    name = low_precision_for(tuple(capability))
    cc = ".".join(map(str, capability))
    return name, f"compute capability {cc}: " + ("bf16 emulated below 8" if name == "fp16"
                                                   else "bf16 in hardware")


def items(n_gpus: int, cores: int, tmp: Path, capability: tuple[int, int] = (8, 0)
          ) -> list[Item]:
    """Every item for a machine with ``n_gpus`` GPUs and ``cores`` cores, in start order.

    ``capability``: the lowest compute capability of the GPUs, which picks the low precision
    of the items that compute in one (the default plans for an Ampere-class GPU).
    Pure: it only names files under ``tmp``; the runner makes nothing but ``tmp`` itself.
    """
    low, low_why = low_precision(capability)
    py = sys.executable
    torchrun = [py, "-m", "torch.distributed.run", "--standalone"]
    ns, shared = rank_counts(n_gpus)
    tag = "-shared" if shared else ""
    workers = suite_workers(cores)
    nb_workers = notebook_workers(cores)
    top = max(ns)
    out = [
        Item("suite", "the whole test suite (rank functions on gloo/CPU, tests/gpu on the "
             "GPUs; the notebooks are their own item)",
             [py, "-m", "pytest", "-q", "-p", "no:randomly", "tests", "--deselect", NOTEBOOKS,
              f"--basetemp={tmp / 'suite-pytest'}"],
             gpu="light", cpus=2 * workers, estimate=300, timeout=600,
             needs=COURSE_NEEDS, xdist=("-n", str(workers)), required=True),
        # On GPUs QUICK picks N=1 and every GPU itself (and keeps under 5 minutes); on one
        # GPU the ranks share it at N=2 and N=4.
        Item("benchmark-quick",
             "benchmarks.run --quick " + ("at N=2 and N=4, the ranks sharing the GPU" if shared
                                          else f"at N={n_gpus}")
             + ": no failed record, cost model present, MFU against the GPU's peak",
             [py, "-m", "benchmarks.run", "--quick",
              *(["--nprocs", ",".join(map(str, [1, *ns]))] if shared else []),
              "--out", str(tmp / "bench")],
             gpu="exclusive", cpus=top, estimate=240, timeout=600,
             env=dict(SHARE) if shared else {},
             needs=("matplotlib",), bench_ns=tuple(ns) if shared else (n_gpus,),
             expect=BENCH_MFU),
        Item("notebooks" + tag,
             "every notebook, the ranks on the GPUs" + (" (sharing it)" if shared else
                                                        " where there are enough"),
             [py, "-m", "pytest", "-q", "-p", "no:randomly", NOTEBOOKS,
              f"--basetemp={tmp / 'notebooks-pytest'}"],
             gpu="light", cpus=2 * nb_workers, estimate=180, timeout=600,
             env={"DPT_TEST_BACKEND": "auto", **(SHARE if shared else {})},
             needs=COURSE_NEEDS, xdist=("-n", str(nb_workers)), required=True),
    ]

    def lane(n: int) -> str:  # NCCL over every GPU gets them to itself
        return "light" if n == 1 else "exclusive" if n == n_gpus and not shared else "shared"

    # One GPU: one rank on NCCL, then 2 and 4 ranks sharing the GPU on gloo.
    for n in ([1] if shared else []) + ns:
        sharing = shared and n > 1
        name, ck = f"-n{n}{'-shared' if sharing else ''}", tmp / f"n{n}"
        common = {"gpu": lane(n), "cpus": n}
        rdzv = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        env = dict(SHARE) if sharing else {}
        batch = [
            Item(f"l03-ddp-spawn-resume{name}", f"lesson 03: mp.spawn, {n} ranks, resume",
                 ["bash", "-c",
                  f"{py} {S}/03_ddp_spawn/ddp_spawn.py -g {n} --device cuda --epochs 1 "
                  f"--limit-batches 20 --checkpoint {ck}-l03.pt --no-progress && "
                  f"{py} {S}/03_ddp_spawn/ddp_spawn.py -g {n} --device cuda --epochs 2 "
                  f"--limit-batches 20 --resume {ck}-l03.pt --no-progress"],
                 **common, estimate=40, env=dict(env),
                 expect=("resumed from", ddp_line(n, sharing))),
            Item(f"l04-torchrun-restart{name}",
                 f"lesson 04: torchrun, {n} ranks, a worker killed, restarted, resumed",
                 [*torchrun, f"--nproc-per-node={n}", "--max-restarts=1",
                  "tests/l04_ddp_torchrun/faulty_worker.py", "--epochs", "3",
                  "--limit-batches", "20", "--snapshot", f"{ck}-l04.pt", "--deterministic",
                  "--no-progress"],
                 **common, estimate=60, timeout=300,
                 env={**rdzv, "DPT_FAULT": "1:5:0", **env}, expect=("resumed",)),
            Item(f"l04-torchrun{name}", f"lesson 04 under torchrun, {n} ranks",
                 [*torchrun, f"--nproc-per-node={n}", f"{S}/04_ddp_torchrun/ddp_torchrun.py",
                  "--epochs", "1", "--limit-batches", "20", "--no-progress"],
                 **common, estimate=25, env={**rdzv, **env}, expect=(ddp_line(n, sharing),)),
            Item(f"l05-ring{name}", f"the hand-written ring all-reduce, {n} ranks",
                 [py, f"{S}/05_ddp_from_scratch/collectives.py", "--world-size", str(n),
                  "--max-mb", "16", "--repeats", "3", "--out", f"{ck}-ring.json", "--plot",
                  f"{ck}-ring.png"],
                 **common, estimate=30, timeout=180, env=dict(env), expect=("ring",)),
            Item(f"l06-ddp-amp{name}", f"lesson 06: DDP + autocast, {n} ranks",
                 [py, f"{S}/06_mixed_precision/ddp_amp.py", "--device", "cuda", "-g", str(n),
                  "--precision", "auto", "--dataset", "fashion-mnist", "--limit-batches", "10",
                  "--no-progress"],
                 **common, estimate=30, env=dict(env), expect=(ddp_line(n, sharing),)),
            Item(f"l08-fsdp2{name}", f"lesson 08: FSDP2 fully_shard, {n} ranks",
                 [py, f"{S}/08_sharding/fsdp2_train.py", "--nproc", str(n), "--steps", "10",
                  "--data", "synthetic"],
                 **common, estimate=30, env=dict(env), expect=(rf"fsdp2 on {n} rank",)),
            Item(f"l09-fsdp-by-hand{name}",
                 f"lesson 09: FSDP by hand, {low} compute ({low_why}), {n} ranks",
                 [py, f"{S}/09_fsdp/fsdp_by_hand.py", "--nproc", str(n), "--steps", "10",
                  "--dtype", low],
                 **common, estimate=20, env=dict(env),
                 expect=(rf"FSDP by hand on {n} rank\(s\), {low} compute",)),
        ]
        # Lesson 09's FSDP2 splits one global batch of 8 sequences. Its mixed-precision
        # policy is bf16 only: where the rule picks fp16 it runs its fp32 policy instead.
        policy = "bf16" if low == "bf16" else "fp32"
        if n in (1, 2, 4):
            batch.append(Item(f"l09-fsdp2-{policy}{name}",
                              f"lesson 09: FSDP2, {policy} policy ({low_why}"
                              + ("" if policy == low else "; its policy has no fp16")
                              + f"), {n} ranks",
                              [py, f"{S}/09_fsdp/fsdp2_practice.py", "--nproc", str(n),
                               "--steps", "10", *(["--bf16"] if policy == "bf16" else [])],
                              **common, estimate=20, env=dict(env),
                              expect=(rf"FSDP2 on {n} rank\(s\)"
                                      + (", bf16" if policy == "bf16" else "(?!, bf16)"),)))
        batch += [
            Item(f"l10-traces{name}", f"lesson 10: one traced step of each method, {n} ranks",
                 [py, f"{S}/10_inside_a_step/traces.py", "--nproc", str(n), "--out",
                  f"{ck}-traces", "--figure", f"{ck}-timeline.png"],
                 **common, estimate=25, timeout=300, env=dict(env),
                 expect=(r"hidden: share of the communication", "timeline:")),
            Item(f"l10-compile{name}", f"lesson 10: DDP around an inductor-compiled model, "
                 f"{n} ranks, against eager", [py, f"{S}/10_inside_a_step/compile_ddp.py",
                                               "--nproc", str(n), "--backend", "inductor",
                                               "--caps", "default", "--bench", "2"],
                 **common, estimate=80, timeout=480, env=dict(env),
                 expect=("losses, inductor", "ms/step eager")),
            Item(f"l10-hooks{name}", f"lesson 10: DDP comm hooks (bf16, PowerSGD), {n} ranks",
                 [py, f"{S}/10_inside_a_step/comm_hooks.py", "--nproc", str(n), "--seeds",
                  "1", "--epochs", "0.2", "--hooks", "none", "bf16", "bf16_by_hand",
                  "powersgd"],
                 **common, estimate=25, timeout=300, env=dict(env),
                 expect=("bf16_by_hand", "powersgd")),
            Item(f"l11-global-batch{name}", f"lesson 11: DDP with accumulation on {n} ranks "
                 "against one process on the whole batch",
                 [py, f"{S}/11_time_to_accuracy/global_batch.py", "--nproc", str(n), "--accum",
                  "2", "--batch", str(16 * n)],
                 **common, estimate=20, timeout=240, env=dict(env),
                 expect=("the three ways take the same steps",)),
            Item(f"l11-sharded-lamb{name}", f"lesson 11: LAMB on element shards, {n} ranks",
                 [py, f"{S}/11_time_to_accuracy/large_batch.py", "--nproc", str(n)],
                 **common, estimate=20, timeout=240, env=dict(env),
                 expect=(r"largest weight difference \d\.\d+e-(?:0[89]|[1-9]\d)",)),
        ]
        # 2+ ranks. Lessons 10 and 11 at the smallest N only; lesson 10's compiled DDP and
        # lesson 11 at 2 ranks only where they share the GPUs with other items (on 2 GPUs
        # NCCL needs both, and the plan must fit the cap: l10-compile-1gpu compiles on one of
        # them there; lesson 11's NCCL path is then tests/gpu, in the suite item)
        out += [it for it in batch
                if (n > 1 or not it.name.startswith(("l05-ring", "l10-", "l11-")))
                and (n == min(ns) or not it.name.startswith(("l10-", "l11-")))
                and not (it.name.startswith(("l10-compile", "l11-")) and lane(n) == "exclusive")]
    for strategy in ("ddp", "ddp_spawn", "fsdp"):
        for n in [1] if shared else ns:  # one GPU: Lightning gets it alone
            out.append(Item(f"l07-{strategy}-n{n}",
                            f"Lightning strategy={strategy!r} on {n} GPU(s)",
                            [py, f"{S}/07_lightning/lit_train.py", "--accelerator", "cuda",
                             "--devices", str(n), "--strategy", strategy,
                             "--limit-train-batches", "20"],
                            gpu=lane(n), cpus=n, estimate=45, needs=("pytorch_lightning",)))
        for n in ns if shared else []:
            out.append(Item(f"l07-{strategy}-n{n}-shared",
                            f"Lightning strategy={strategy!r}, {n} ranks on one GPU", [],
                            skip=LIGHTNING_SHARED.format(n=n)))
    out += [
        Item("l01-cuda-resume", "lesson 01 on cuda, checkpoint, then resume",
             ["bash", "-c",
              f"{py} {S}/01_single_device/single_device.py --device cuda --epochs 1 "
              f"--limit-batches 50 --checkpoint {tmp}/l01.pt --no-progress && "
              f"{py} {S}/01_single_device/single_device.py --device cuda --epochs 2 "
              f"--limit-batches 50 --resume {tmp}/l01.pt --no-progress"],
             gpu="light", estimate=30, expect=("resumed from", "on cuda")),
        Item("l10-compile-1gpu", "lesson 10: compiled DDP, one NCCL rank on one GPU",
             [py, f"{S}/10_inside_a_step/compile_ddp.py", "--nproc", "1", "--backend",
              "inductor", "--caps", "default", "--bench", "3"],
             gpu="light", estimate=90, timeout=480, expect=("losses, inductor",)),
        Item("l10-hang-clinic", "lesson 10: every hang reproduced, diagnosed and fixed (gloo)",
             [py, f"{S}/10_inside_a_step/hang_clinic.py", "--check"],
             gpu="light", cpus=2, estimate=60, timeout=240, expect=("every case checked",)),
        Item("l02-dataparallel", "nn.DataParallel across every GPU",
             [py, f"{S}/02_data_parallel/data_parallel.py", "--limit-batches", "20",
              "--no-progress"], gpu="light", estimate=20),
        Item("l02-dp-by-hand", "DataParallel by hand (scatter, replicate, gather) on the GPUs",
             dp_by_hand_argv(py, n_gpus, tmp), gpu="light", estimate=30,
             expect=(rf"DP by hand, {n_gpus} GPUs",),
             skip=None if n_gpus >= 2 else "needs 2 GPUs: on one GPU there is nothing to "
             "scatter to (the suite's CPU tests cover DataParallel by hand)"),
        Item("l12-bandwidth", f"lesson 12: busbw of the four collectives on NCCL, N = 2 to "
             f"{n_gpus}, 1 KB to 64 MB",
             [py, f"{S}/12_step_cost/bandwidth.py", "--max-nproc", str(max(2, n_gpus)),
              "--max-mb", "64", "--out", f"{tmp}/l12-bandwidth.json", "--plot",
              f"{tmp}/l12-bandwidth.png"],
             gpu="exclusive", cpus=max(2, n_gpus), estimate=10 + 10 * max(1, n_gpus - 1),
             timeout=300, expect=(r"all_reduce .* 64 MB", r"all-reduce: alpha = .* GB/s"),
             skip="needs 2 GPUs: NCCL takes one GPU per rank (the suite times the collectives "
             "on gloo)" if n_gpus < 2 else "2 GPUs: the plan's NCCL items fill the cap; run "
             f"{S}/12_step_cost/bandwidth.py by hand" if n_gpus == 2 else None),
        Item("l06-fp16-inf", "fp16 + GradScaler on cuda with an injected inf",
             [py, f"{S}/06_mixed_precision/amp_train.py", "--device", "cuda", "--precision",
              "fp16", "--steps", "30", "--inject-inf", "10"],
             gpu="light", estimate=20, expect=("skipped",)),
        Item("l07-16-mixed", "Lightning precision='16-mixed' on one GPU",
             [py, f"{S}/07_lightning/lit_train.py", "--accelerator", "cuda", "--devices", "1",
              "--precision", "16-mixed", "--limit-train-batches", "20"],
             gpu="light", estimate=40, needs=("pytorch_lightning",)),
    ]
    # The long ones first, then the lesson items: those sharing the GPUs side by side, then
    # those that need every GPU one after another, and the short single-GPU ones in the gaps.
    order = {"shared": 0, "exclusive": 1, "light": 2}
    return out[:3] + sorted(out[3:], key=lambda it: order[it.gpu])


# ------------------------------------------------------------------------------ scheduling


def can_start(item: Item, running: list[Item], free_cores: int) -> bool:
    """Whether ``item`` may start beside ``running`` with ``free_cores`` cores unused."""
    if item.gpu == "exclusive" and any(r.gpu != "light" for r in running):
        return False
    if item.gpu == "shared" and any(r.gpu == "exclusive" for r in running):
        return False
    return not running or item.cpus <= free_cores


def to_start(pending: list[Item], running: list[Item], cores: int) -> list[Item]:
    """The pending items to start now, in list order. An exclusive item that has to wait
    holds back the GPU items after it, so that the running ones drain and it gets its turn."""
    chosen: list[Item] = []
    gpu_held = False
    for item in pending:
        if item.gpu != "light" and gpu_held:
            continue
        free = cores - sum(min(r.cpus, cores) for r in running + chosen)
        if can_start(item, running + chosen, free):
            chosen.append(item)
        elif item.gpu == "exclusive":
            gpu_held = True
    return chosen


def plan(todo: list[Item], cores: int) -> list[tuple[Item, float, float]]:
    """(item, start, end) for every runnable item when each takes its estimate."""
    pending = [it for it in todo if not it.skip]
    running: list[tuple[Item, float]] = []
    out, now = [], 0.0
    while pending or running:
        for it in to_start(pending, [r for r, _ in running], cores):
            pending.remove(it)
            running.append((it, now + it.estimate))
            out.append((it, now, now + it.estimate))
        if not running:
            raise RuntimeError(f"nothing can start: {[it.name for it in pending]}")
        now = min(end for _, end in running)
        running = [(r, end) for r, end in running if end > now]
    return out


def planned_seconds(todo: list[Item], cores: int) -> float:
    return max((end for _, _, end in plan(todo, cores)), default=0.0)


# ------------------------------------------------------------------------------ processes


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux's /proc; just ``pid`` elsewhere)."""
    if not Path("/proc/self/stat").exists():
        return [pid]
    kids, tree, todo = _children_map(), [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += kids.get(p, [])
    return tree


def stop_tree(proc: subprocess.Popen) -> None:
    """Kill an item: its process group and every descendant, including those that left the
    group (a Jupyter kernel starts its own session). Frozen first, so none forks meanwhile."""
    frozen: set[int] = set()
    for _ in range(20):
        tree = set(process_tree(proc.pid)) - frozen
        if not tree:
            break
        for p in tree:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        frozen |= tree
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in frozen:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


@dataclass
class Running:
    item: Item
    proc: subprocess.Popen
    log: Path
    start: float
    cores: list[int]


def missing_modules(item: Item) -> list[str]:
    return [m for m in item.needs if importlib.util.find_spec(m) is None]


def how_to_get(modules: list[str]) -> str:
    """What is missing, by pip's names, and how to get it: one line."""
    names = list(dict.fromkeys(DISTRIBUTIONS.get(m, m) for m in modules))
    torch_bound = [n for n in names if n in WITH_TORCH]
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", "<this torch's version>").split("+")[0]
    builds = f" ({', '.join(torch_bound)}: the builds for torch {version})" if torch_bound \
        else ""
    offline = f"TORCH={version} " if torch_bound else ""
    return (f"{sys.executable} lacks {', '.join(names)}: `{sys.executable} -m pip install "
            f"{' '.join(names)}`{builds}; with no network here, `{offline}bash "
            "tools/offline_bundle.sh` on a machine with PyPI, copy .offline/ here, then "
            "`bash tools/offline_bundle.sh --install`")


def missing_required(todo: list[Item]) -> list[str]:
    """The modules that the required items of ``todo`` need and this Python lacks."""
    return list(dict.fromkeys(m for it in todo if it.required and not it.skip
                              for m in missing_modules(it)))


def command(item: Item) -> list[str]:
    return [*item.argv, *item.xdist]


def launch(item: Item, cores: list[int], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DPT_SHARE_GPU", "DPT_TEST_BACKEND", "DPT_TARGET")}
    env.update(PYTHONUNBUFFERED="1", TQDM_DISABLE="1", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                        os.environ.get("PYTHONPATH")])),
               **item.env)
    if not item.required:  # a failed lesson item's log shows the rank's whole traceback
        env.setdefault("DPT_TRACEBACK", "1")  # (the suite's own tests check the one line)

    def pin() -> None:  # the item's ranks size their threads from the cores they see
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)

    with open(log, "w") as fh:
        return subprocess.Popen(command(item), cwd=REPO, env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=pin)


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def verdict(item: Item, returncode: int, out: str, tmp: Path) -> tuple[str, str | None]:
    if returncode != 0:
        last = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or [""]
        return "fail", f"exit {returncode}: {last[0][:200]}"
    for pattern in item.expect:
        if not re.search(pattern, out):
            return "fail", f"output lacks {pattern!r}"
    if item.bench_ns:
        why = check_benchmark(tmp / "bench", item.bench_ns)
        if why:
            return "fail", why
    return "pass", None


def check_benchmark(out_dir: Path, ns: tuple[int, ...] = ()) -> str | None:
    """None when the quick benchmark ran every method without failure, ran at each N of
    ``ns``, and fitted its model."""
    files = sorted(out_dir.rglob("results.json")) or sorted(out_dir.rglob("latest.json"))
    if not files:
        return "no results JSON written"
    result = json.loads(files[0].read_text())
    records = result.get("records", [])
    failed = [f"{r['method']}@{r['nprocs']}: {r.get('error', '')[:80]}"
              for r in records if r.get("status") in ("failed", "timeout")]
    if failed:
        return "failed records: " + "; ".join(failed)
    missing = [n for n in ns if not any(r.get("status") == "ok" and r.get("nprocs") == n
                                        for r in records)]
    if missing:
        return f"no record ran at N={','.join(map(str, missing))}"
    if not result.get("cost_model"):
        return "no cost model in the results"
    return None


def run_all(todo: list[Item], cores: list[int], cap: float, tmp: Path, logs: Path,
            say=print, poll: float = 0.2) -> list[dict]:
    """Run ``todo`` side by side under the overall ``cap`` (seconds); one record per item."""
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results: dict[str, dict] = {}
    pending: list[Item] = []
    for it in todo:
        base = {"name": it.name, "what": it.what, "command": " ".join(command(it)),
                "estimate": it.estimate, "required": it.required}
        gone = missing_modules(it)
        if it.required and (it.skip or gone):  # not run: that is a failure, never a skip
            why = it.skip or f"not run: {how_to_get(gone)}"
            results[it.name] = {**base, "status": "fail", "reason": why}
            say(f"[{_clock(t0)}] fail  {it.name}: {why}")
        elif it.skip or gone:
            why = it.skip or (f"needs {', '.join(gone)}, which {sys.executable} cannot import")
            results[it.name] = {**base, "status": "skipped", "reason": why}
            say(f"[{_clock(t0)}] skip  {it.name}: {why}")
        else:
            results[it.name] = base
            pending.append(it)
    running: list[Running] = []
    free = list(cores)

    def finish(r: Running, status: str, reason: str | None, code: int | None = None) -> None:
        running.remove(r)
        free.extend(r.cores)
        rec = results[r.item.name]
        rec.update(status=status, seconds=round(time.monotonic() - r.start, 1),
                   tail=tail(r.log), log=str(r.log))
        if code is not None:  # it ran to its end (else it was stopped)
            rec["exit"] = code
        if reason:
            rec["reason"] = reason
        note = f": {reason}" if reason else ""
        say(f"[{_clock(t0)}] {status:5} {r.item.name} ({rec['seconds']:.0f} s){note}  "
            f"[{len(running)} running, {len(pending)} waiting]")

    try:
        while pending or running:
            for it in to_start(pending, [r.item for r in running], len(cores)):
                pending.remove(it)
                mine = free[:max(1, min(it.cpus, len(free)))]
                del free[:len(mine)]
                log = logs / f"{it.name}.log"
                r = Running(it, launch(it, mine, log), log, time.monotonic(), mine)
                running.append(r)
                say(f"[{_clock(t0)}] start {it.name} ({it.gpu} GPU, {len(mine)} core(s), "
                    f"about {it.estimate:.0f} s)")
            time.sleep(poll)
            now = time.monotonic()
            for r in list(running):
                code = r.proc.poll()
                if code is not None:
                    try:  # whatever it left behind in its group goes too
                        os.killpg(r.proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    status, reason = verdict(r.item, code, tail(r.log, 200_000), tmp)
                    finish(r, status, reason, code)
                elif now - r.start > r.item.timeout:
                    stop_tree(r.proc)
                    finish(r, "fail", f"timed out after {r.item.timeout:.0f} s")
            if now - t0 > cap:
                for r in list(running):
                    stop_tree(r.proc)
                    finish(r, "fail", "stopped at the overall cap")
                for it in pending:
                    results[it.name].update(status="fail",
                                            reason="not started before the overall cap")
                    say(f"[{_clock(t0)}] fail  {it.name}: not started before the overall cap")
                pending.clear()
    finally:
        for r in list(running):  # Ctrl-C, or an error here: leave nothing behind
            stop_tree(r.proc)
            finish(r, "fail", "interrupted")
    return [results[it.name] for it in todo]


def _clock(t0: float) -> str:
    s = int(time.monotonic() - t0)
    return f"{s // 60:2d}:{s % 60:02d}"


# ------------------------------------------------------------------------------ the record


def driver_version() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "unknown (no nvidia-smi)"
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (out.strip().splitlines() or ["unknown"])[0]


def machine(cores: int) -> dict:
    import torch

    n = torch.cuda.device_count()
    return {"gpus": [torch.cuda.get_device_name(i) for i in range(n)],
            "capabilities": [".".join(map(str, torch.cuda.get_device_capability(i)))
                             for i in range(n)],
            "torch": torch.__version__, "cuda": torch.version.cuda, "driver": driver_version(),
            "cores": cores, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def gpus_label(info: dict) -> str:
    groups: dict[tuple[str, str], int] = {}
    for name, cap in zip(info["gpus"], info["capabilities"]):
        groups[(name, cap)] = groups.get((name, cap), 0) + 1
    return ", ".join(f"{k} x {name} (compute capability {cap})"
                     for (name, cap), k in groups.items()) or "no GPU"


def summary(results: list[dict]) -> str:
    count = {s: sum(r.get("status") == s for r in results) for s in ("pass", "fail", "skipped")}
    return (f"{count['pass']} of {len(results)} items passed, {count['fail']} failed, "
            f"{count['skipped']} skipped")


def markdown(results: list[dict], info: dict, elapsed: float, cap: float) -> str:
    lines = [f"# GPU check: {gpus_label(info)}", "",
             f"**{summary(results)}**, in {elapsed / 60:.1f} min of the {cap / 60:.1f} min "
             f"cap (`make gpu-check`, tools/gpu_check.py).", "",
             "| machine | |", "|---|---|",
             f"| GPUs | {gpus_label(info)} |",
             f"| torch | {info['torch']}, CUDA {info['cuda']}, driver {info['driver']} |",
             f"| cores | {info['cores']} |",
             f"| Python | {info['python']} |",
             f"| date | {info['date']} |",
             f"| time | {elapsed:.0f} s of a {cap:.0f} s cap |", "",
             "| item | result | seconds | what |", "|---|---|---|---|"]
    for r in results:
        result = r.get("status", "?") + (f": {r['reason']}" if r.get("reason") else "")
        result = result.replace("|", "\\|")
        lines.append(f"| {r['name']} | {result} | {r.get('seconds', '')} | {r['what']} |")
    return "\n".join(lines) + "\n"


def write(results: list[dict], info: dict, out: Path, elapsed: float, cap: float) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": info, "elapsed_s": round(elapsed, 1), "cap_s": cap,
           "summary": summary(results), "items": results}
    (out / "checklist.json").write_text(json.dumps(doc, indent=2))
    md = out / "checklist.md"
    md.write_text(markdown(results, info, elapsed, cap))
    return md


def record_name(info: dict) -> str:
    """docs/gpu-check/<gpus>-<date>.md, e.g. ``1x-nvidia-h200-2026-11-26.md``."""
    first = info["gpus"][0] if info["gpus"] else "no-gpu"
    slug = re.sub(r"[^a-z0-9]+", "-", first.lower()).strip("-")
    return f"{len(info['gpus'])}x-{slug}-{info['date'][:10]}.md"


# ------------------------------------------------------------------------------ main


def _shown(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check")
    ap.add_argument("--only", default=None, help="comma-separated item names (see --list)")
    ap.add_argument("--list", action="store_true", help="show the plan and exit")
    ap.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="the overall cap (default: 600 s on one GPU, up to 1200 s on 8)")
    ap.add_argument("--commit", action="store_true",
                    help=f"also copy the checklist to {_shown(RECORDS)}/ (then commit that file)")
    args = ap.parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        print(f"error: --budget must be a positive number of seconds, got {args.budget:g}",
              file=sys.stderr)
        return 2
    import torch

    from dpt.dist import cpu_budget

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus == 0 and not args.list:
        print("gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is "
              "False); nothing to check here", file=sys.stderr)
        return NO_GPU_EXIT
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(cpu_budget()))
    cap = args.budget or overall_cap(n_gpus)
    # The lowest compute capability: every rank of an item must run its precision well.
    capability = min((tuple(torch.cuda.get_device_capability(i)) for i in range(n_gpus)),
                     default=(8, 0))
    with tempfile.TemporaryDirectory(prefix="dpt-gpu-check-") as tmp_name:
        tmp = Path(tmp_name)
        todo = items(max(n_gpus, 1), len(cores), tmp, capability=capability)
        required = [it.name for it in todo if it.required]
        if args.only:
            names = set(args.only.split(","))
            unknown = names - {it.name for it in todo}
            if unknown:
                print(f"error: unknown item(s) {', '.join(sorted(unknown))}; see --list",
                      file=sys.stderr)
                return 2
            todo = [it for it in todo if it.name in names]
            left_out = [name for name in required if name not in names]
            if args.commit and left_out:
                print(f"error: --commit records the whole check; --only leaves out the "
                      f"required item(s) {', '.join(left_out)}", file=sys.stderr)
                return 2
        planned = planned_seconds(todo, len(cores))
        gone = missing_required(todo)
        if args.list:
            if n_gpus == 0:
                print("no CUDA GPU here: the plan for one GPU of compute capability "
                      f"{'.'.join(map(str, capability))}")
            for it, start, end in plan(todo, len(cores)):
                print(f"{start:5.0f}-{end:5.0f} s  {it.name:34} {it.gpu:9} {it.cpus:2} core(s)"
                      f"  {it.what}")
            for it in todo:
                if it.skip:
                    print(f"  skipped    {it.name:34} {it.skip}")
            print(f"planned: {planned:.0f} s, cap {cap:.0f} s, {len(cores)} cores")
            if gone:
                print(f"cannot run here yet: {how_to_get(gone)}")
            return 0
        if gone:  # before anything starts: the run would check nothing
            print(f"gpu-check: cannot check: {how_to_get(gone)}", file=sys.stderr)
            return MISSING_TOOLS_EXIT
        info = machine(len(cores))
        print(f"gpu-check: {gpus_label(info)}; {len(todo)} items on {len(cores)} cores, "
              f"planned about {planned / 60:.1f} min, stopped at {cap / 60:.1f} min", flush=True)
        if planned > cap:
            print(f"note: the plan ({planned / 60:.1f} min) is longer than the cap on this "
                  "machine's cores: what still runs at the cap is stopped and fails", flush=True)
        t0 = time.monotonic()
        results = run_all(todo, cores, cap, tmp, args.out / "logs",
                          say=lambda line: print(line, flush=True))
        elapsed = time.monotonic() - t0
    md = write(results, info, args.out, elapsed, cap)
    print("\nchecklist:")
    for r in results:
        print(f"  [{r['status']:7}] {r['name']}" + (f": {r['reason']}" if r.get("reason") else ""))
    print(f"{summary(results)} in {elapsed / 60:.1f} min; written: {md} and checklist.json "
          f"(logs in {args.out / 'logs'})")
    unfinished = [f"{r['name']} ({r.get('reason', r['status'])})" for r in results
                  if r.get("required") and "exit" not in r]
    if args.commit and unfinished:
        print(f"error: --commit refused: the required item(s) {'; '.join(unfinished)} did "
              f"not run to the end; nothing recorded under {_shown(RECORDS)}/", file=sys.stderr)
        return 1
    if args.commit:
        RECORDS.mkdir(parents=True, exist_ok=True)
        dest = RECORDS / record_name(info)
        shutil.copyfile(md, dest)
        print(f"recorded: {_shown(dest)}; commit it, and quote it in the GPU column of "
              "docs/machines.md")
    return 1 if any(r["status"] == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
