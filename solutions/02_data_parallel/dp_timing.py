"""Lesson 02: the timing question, measured. Does DataParallel make inference faster?

Time the forward pass of the same model on 1 device and on N devices over a sweep of batch
sizes, and plot latency against batch size. A fair clock needs three things:

- **warm-up** runs first (allocator, kernel selection, thread-pool start-up, caches);
- **synchronization** before each clock read: GPU kernels are queued, and a clock read right
  after ``model(x)`` measures the queueing, not the work;
- the **median** of repeats, which one slow outlier (another process, a page fault) cannot move.

Where there are at least two GPUs it compares the model on ``cuda:0`` with ``nn.DataParallel``
and with your ``DataParallelByHand`` over N GPUs. Without them, a "device" is a share of the
CPU cores: the 1-device line is the model with ``cores // N`` intra-op threads, the N-device
line is ``DataParallelByHand`` with N replicas in threads, ``cores // N`` threads each, and a
third line gives the single model all N shares as intra-op threads (the CPU's own way to use
them).

Why DataParallel can be slower for small batches: every forward pays a fixed cost before any
useful work: copying all the weights to each device (the replicas are rebuilt every call),
splitting the batch and sending the chunks, starting N threads, then gathering the outputs
onto one device. That cost does not shrink with the batch. With a small batch each device gets
a few samples, too little work to keep it busy, so the fixed cost dominates and N devices lose
to one. As the batch grows the compute grows with it while the overhead stays put, and the
split starts to pay, approaching (never reaching) N times faster.

Run it::

    .venv/bin/python solutions/02_data_parallel/dp_timing.py                       # N: every GPU, or core
    .venv/bin/python solutions/02_data_parallel/dp_timing.py --devices 2 --batch-sizes 8,64,512
    .venv/bin/python solutions/02_data_parallel/dp_timing.py --out /tmp/dp_timing   # default: runs/
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from data_parallel import wrap
from dp_by_hand import DataParallelByHand, intra_op_threads
from torch import nn

from dpt.device import synchronize
from dpt.dist import cpu_budget
from dpt.models import MODELS, build_model

HERE = Path(__file__).resolve().parent


def time_forward(model: nn.Module, x: torch.Tensor, device: torch.device | str,
                 warmup: int = 3, repeats: int = 10) -> float:
    """Median seconds of one ``model(x)`` under ``torch.no_grad()``.

    Runs ``warmup`` untimed calls first; each timed call is bracketed by ``synchronize(device)``
    (this module's name for ``dpt.device.synchronize``) so that queued work is finished before
    the clock is read.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    # BEGIN SOLUTION 02.9: time `repeats` forwards after `warmup` untimed ones, synchronizing around each; return the median
    times = []
    with torch.no_grad():
        for _ in range(warmup):
            model(x)
        for _ in range(repeats):
            synchronize(device)
            t0 = time.perf_counter()
            model(x)
            synchronize(device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
    # END SOLUTION


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_devices(n_devices: int | None = None) -> int:
    """N, the number of devices of the study: by default every GPU where there are at least
    two, else every core (at least 2). An N asked for must exist: on a machine with GPUs,
    one device per GPU at most (``nn.DataParallel`` refuses an id past the last GPU)."""
    gpus = gpu_count()
    if n_devices is None:
        return gpus if gpus >= 2 else max(2, cpu_budget())
    if n_devices < 1:
        raise ValueError(f"--devices must be at least 1, got {n_devices}")
    if gpus >= 2 and n_devices > gpus:
        raise ValueError(f"--devices {n_devices}: only {gpus} GPUs here (ids 0 to {gpus - 1}); "
                         f"ask for at most {gpus}")
    return n_devices


def sweep(batch_sizes: list[int], n_devices: int | None = None, model_name: str = "fashioncnn",
          warmup: int = 3, repeats: int = 10, threads_per_device: int | None = None,
          progress=None) -> dict:
    """Latency (median seconds) per batch size for 1 device and for N devices.

    ``n_devices=None`` picks N as ``dp_timing.py`` does without ``--devices``; an N this
    machine cannot give is refused (``ValueError``), by the same rule as ``--devices``.
    """
    n_devices = resolve_devices(n_devices)
    torch.manual_seed(0)
    model = build_model(model_name).eval()
    gpus = gpu_count()
    result = {"model": model_name, "n_devices": n_devices, "batch_sizes": batch_sizes,
              "warmup": warmup, "repeats": repeats, "lines": {}}
    if gpus >= 2 and n_devices >= 2:
        ids = list(range(n_devices))
        dp, root = wrap(model, ids)  # task 02.7: the model is now on root
        variants = {"1 GPU": model, f"DataParallel, {n_devices} GPUs": dp,
                    f"DP by hand, {n_devices} GPUs": DataParallelByHand(model, device_ids=ids)}
        result.update(kind="cuda", label=f"{n_devices} x {torch.cuda.get_device_name(0)}")
        threads = {name: torch.get_num_threads() for name in variants}
    else:
        root = torch.device("cpu")
        t = threads_per_device or max(1, cpu_budget() // n_devices)
        variants = {
            f"1 device ({t} thread{'s' * (t > 1)})": model,
            f"DP by hand, {n_devices} replicas x {t} thread{'s' * (t > 1)}":
                DataParallelByHand(model, n_replicas=n_devices, threads_per_replica=t),
            f"1 device, {n_devices * t} threads (intra-op)": model,
        }
        threads = dict(zip(variants, (t, None, n_devices * t)))
        unused = (", no GPU" if gpus == 0 else
                  f"; its {gpus} GPU(s) unused" if gpus < 2 else
                  f"; {gpus} GPUs, but --devices {n_devices}")
        result.update(kind="cpu", label=f"{cpu_budget()}-core CPU{unused}",
                      threads_per_device=t)
    result["lines"] = {name: [] for name in variants}
    for b in batch_sizes:
        x = torch.randn(b, 1, 28, 28, device=root)
        for name, m in variants.items():  # interleaved, so drift hits every line alike
            n = threads[name]
            if n is None:  # DataParallelByHand sets its own threads per replica
                secs = time_forward(m, x, root, warmup, repeats)
            else:
                with intra_op_threads(n):
                    secs = time_forward(m, x, root, warmup, repeats)
            result["lines"][name].append(secs)
            if progress:
                progress(f"batch {b:5d}  {name:40s} {1000 * secs:8.2f} ms")
    return result


def plot(result: dict, path: str | Path | None = None):
    """Latency against batch size, one line per variant (log-log); saved when ``path``."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    bs = result["batch_sizes"]
    for name, secs in result["lines"].items():
        axes[0].plot(bs, [1000 * s for s in secs], marker="o", label=name)
    first = next(iter(result["lines"].values()))
    for name, secs in list(result["lines"].items())[1:]:
        axes[1].plot(bs, [a / s for a, s in zip(first, secs)], marker="o", label=name)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].axhline(result["n_devices"], color="gray", ls="--", lw=0.8, label="ideal (N x)")
    axes[0].set(xscale="log", yscale="log", xlabel="batch size", ylabel="latency (ms, median)",
                title=f"{result['model']} inference: {result['label']}")
    axes[1].set(xscale="log", xlabel="batch size", ylabel="speedup over 1 device",
                title="speedup (>1 is faster)")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Lesson 02: inference latency, 1 vs N devices.")
    p.add_argument("--batch-sizes", default="1,4,16,64,256,1024")
    p.add_argument("--devices", type=int, default=None,
                   help="N (default: every GPU where there are two or more, else every core, "
                        "at least 2)")
    p.add_argument("--model", default="fashioncnn", choices=sorted(MODELS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads-per-device", type=int, default=None,
                   help="CPU only: intra-op threads per device (default cores // N)")
    p.add_argument("--out", default=str(HERE / "runs" / "dp_timing"),
                   help="writes OUT.json and OUT.png (default: the lesson's runs/, git-ignored)")
    return p


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sizes = parse_batch_sizes(args.batch_sizes)
        n = resolve_devices(args.devices)
        if args.repeats < 1 or args.warmup < 0:
            raise ValueError("--repeats must be >= 1 and --warmup >= 0")
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if gpu_count() < 2:
        print(f"{gpu_count()} GPU(s): timing DataParallelByHand on the CPU with {n} replicas "
              "(nn.DataParallel would just call the model here).")
    elif n >= 2:
        print(f"{gpu_count()} GPUs: timing one GPU, nn.DataParallel and DataParallelByHand "
              f"over GPUs 0 to {n - 1}.")
    result = sweep(sizes, n, args.model, args.warmup, args.repeats, args.threads_per_device,
                   progress=print)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
