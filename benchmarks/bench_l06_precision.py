"""Lesson 06: fp32 against bf16 autocast (and fp16 + GradScaler on CUDA), in one run.

Throughput (samples/s, all ranks) and peak memory of the same training step (lesson 06's
``Trainer._run_batch``, ConvNet in DDP, synthetic MNIST-shaped batches, SGD) for one process
(a DDP job of one) and for DDP with world size 2. Every measurement is a fresh process (so peak RSS is its own), 1 thread
per rank; variants alternate within each repeat and medians are compared. The CPU's flags
are recorded with the result: bf16 is only fast on CPUs with AMX or AVX512-BF16.

    python benchmarks/bench_l06_precision.py --repeats 3

Writes benchmarks/runs/lessons/l06_precision.json and .png
(git-ignored; the committed results are in benchmarks/reference/lessons/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dpt.lessons import load

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "runs" / "lessons"  # git-ignored; committed: reference/lessons


def _measure(rank: int, world_size: int, precision: str, batch: int, warmup: int,
             steps: int) -> dict:
    """One rank: build, warm up, time ``steps`` steps. Runs inside run_distributed or alone
    (then as a DDP job of one process: the Trainer wraps its model in DDP)."""
    import torch
    import torch.distributed as dist
    Trainer = load("06_mixed_precision", "ddp_amp", "solutions").Trainer

    from dpt.device import synchronize
    from dpt.dist import group_of_one
    from dpt.models import ConvNet

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with group_of_one(device):  # nothing when run_distributed made the group already
        torch.manual_seed(0)
        model = ConvNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        trainer = Trainer(model, None, opt, device, precision=precision)
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(batch, 1, 28, 28, generator=g).to(device),
                    torch.randint(0, 10, (batch,), generator=g).to(device)) for _ in range(4)]
        for i in range(warmup):
            trainer._run_batch(*batches[i % 4])
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        for i in range(steps):
            trainer._run_batch(*batches[i % 4])
        synchronize(device)
        seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else
            (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) * 1024)
    return {"seconds": seconds, "peak_bytes": peak, "device": str(device)}


def worker(precision: str, world_size: int, batch: int, warmup: int, steps: int) -> dict:
    if world_size == 1:
        results = [_measure(0, 1, precision, batch, warmup, steps)]
    else:
        from dpt.ranks import run_distributed

        results = run_distributed(_measure, world_size=world_size,
                                  args=(precision, batch, warmup, steps), timeout=600)
    seconds = max(r["seconds"] for r in results)
    return {"precision": precision, "world_size": world_size,
            "samples_per_s": world_size * batch * steps / seconds,
            "peak_mb_per_rank": max(r["peak_bytes"] for r in results) / 2 ** 20,
            "device": results[0]["device"]}


def cpu_info() -> dict:
    from dpt.precision import cpu_flags, cpu_has_fast_bf16

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"model": model or platform.processor(), "cores": os.cpu_count(),
            "relevant_flags": cpu_flags(), "fast_bf16": cpu_has_fast_bf16()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.world_size, args.batch, args.warmup,
                                args.steps)))
        return 0

    import torch

    precisions = ["fp32", "bf16"] + (["fp16"] if torch.cuda.is_available() else [])
    sizes = [1, 2] if (not torch.cuda.is_available() or torch.cuda.device_count() >= 2) else [1]
    runs: dict[str, list[dict]] = {}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for rep in range(args.repeats):
        for ws in sizes:
            for prec in precisions:
                cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", prec,
                       "--world-size", str(ws), "--batch", str(args.batch),
                       "--warmup", str(args.warmup), "--steps", str(args.steps)]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
                if proc.returncode != 0:
                    print(proc.stderr, file=sys.stderr)
                    return 1
                res = json.loads(proc.stdout.strip().splitlines()[-1])
                runs.setdefault(f"{prec}_ws{ws}", []).append(res)
                print(f"repeat {rep}: {prec} ws={ws}: {res['samples_per_s']:.1f} samples/s, "
                      f"peak {res['peak_mb_per_rank']:.1f} MB/rank", flush=True)
    summary = {}
    for key, rs in runs.items():
        summary[key] = {"samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                        "peak_mb_per_rank": statistics.median(r["peak_mb_per_rank"] for r in rs)}
    ratios = {}
    for ws in sizes:
        for prec in precisions[1:]:
            a, b = summary[f"fp32_ws{ws}"], summary[f"{prec}_ws{ws}"]
            ratios[f"{prec}_over_fp32_throughput_ws{ws}"] = round(b["samples_per_s"] / a["samples_per_s"], 3)
            ratios[f"{prec}_over_fp32_peak_memory_ws{ws}"] = round(
                b["peak_mb_per_rank"] / max(a["peak_mb_per_rank"], 1e-9), 3)
    result = {"cpu": cpu_info(), "torch": torch.__version__, "device": runs["fp32_ws1"][0]["device"],
              "batch_per_rank": args.batch, "steps": args.steps, "repeats": args.repeats,
              "threads_per_rank": 1, "model": "ConvNet", "summary": summary, "ratios": ratios,
              "runs": runs,
              "memory_note": "CPU: peak RSS growth of the process during the run (max over "
                             "ranks); CUDA: torch.cuda.max_memory_allocated"}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "l06_precision.json").write_text(json.dumps(result, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, metric, label in [(axes[0], "samples_per_s", "samples/s (all ranks)"),
                              (axes[1], "peak_mb_per_rank", "peak MB per rank")]:
        width = 0.8 / len(precisions)
        for i, prec in enumerate(precisions):
            vals = [summary[f"{prec}_ws{ws}"][metric] for ws in sizes]
            ax.bar([s + (i - (len(precisions) - 1) / 2) * width for s in range(len(sizes))], vals,
                   width, label=prec)
        ax.set_xticks(range(len(sizes)), [f"world size {ws}" for ws in sizes])
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(f"ConvNet, batch {args.batch}/rank, {result['device']}, "
                 f"fast bf16 in CPU: {result['cpu']['fast_bf16']}")
    fig.tight_layout()
    fig.savefig(OUT / "l06_precision.png", dpi=100)
    print(json.dumps({"ratios": ratios, "cpu_flags": result["cpu"]["relevant_flags"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
