"""Lesson 10: what a DDP communication hook saves and what it costs.

The PyTorch MNIST-example MLP (101,770 parameters, one DDP bucket) trained on Fashion-MNIST
for ``--epochs`` with SGD (momentum 0.9, lr 0.05, 64 images per rank per step) on ``--nproc``
gloo ranks (1 thread each), under each hook of ``comm_hooks.py``: none (DDP's fp32
all-reduce), torch's fp16 and bf16 compression, the hand-written bf16 hook (task 10.8), and
PowerSGD at ranks 1 and 4 (error feedback on; plain all-reduce for the first 10 steps). Per
configuration and seed, fresh processes (``comm_hooks.train_worker``):

- **bytes all-reduced per step** by one rank, counted by ``comm_hooks.AllReduceCounter``
  (payload; a ring all-reduce puts ``2 (N - 1) / N`` times that on each link), beside
  ``comm_hooks.predicted_bytes``; the same for every seed;
- **step time**: each rank's median step (forward, backward with the hook, optimizer step),
  the slower rank per seed, then the geometric mean and a 95% t-interval on the log times
  over seeds (never below zero);
- **test accuracy** after the epochs, mean and 95% t-interval over seeds (seed: the model's
  initialisation and the data order).

    python benchmarks/bench_l10_comm_hooks.py                     # about 2 min on 2 cores
    python benchmarks/bench_l10_comm_hooks.py --seeds 5 --epochs 2

Writes benchmarks/runs/lessons/l10_comm_hooks.json and .png (git-ignored; the committed
results are in benchmarks/reference/lessons/). On a CPU with gloo and 2 ranks on one machine
the all-reduce is a memory copy, so compression saves bytes but rarely time: the time column
says what the compression costs; the saving shows where the network is the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from dpt.lessons import load

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "runs" / "lessons"  # git-ignored; committed: reference/lessons

CONFIGS = [("none", "none", None), ("fp16", "fp16", None), ("bf16", "bf16", None),
           ("bf16_by_hand", "bf16_by_hand", None),
           ("powersgd r=1", "powersgd", {"rank": 1}), ("powersgd r=4", "powersgd", {"rank": 4})]


def run(configs, seeds: int, epochs: float, nproc: int, timeout: float) -> dict:
    """Each configuration for each seed on gloo ranks (the reference is a CPU's), the order
    rotated each seed: a drift of the machine's speed spreads over every one alike."""
    ch = load("10_inside_a_step", "comm_hooks", "solutions")

    return ch.run_hooks(configs, seeds, epochs, nproc, timeout, backend="gloo", rotate=True)


def ranks_label(nproc: int) -> str:
    """Where :func:`run`'s gloo ranks compute, in the words of the record and the figure: the
    CPU, or the GPUs they share under ``DPT_SHARE_GPU=1`` (``dpt.ranks.placement``)."""
    from dpt.ranks import placement

    return placement(nproc, "gloo").label


def compact(raw: dict) -> dict:
    """Per configuration and seed: what the table is made of, each rank's step time."""
    return {label: [{"seed": ranks[0]["seed"], "steps": ranks[0]["steps"],
                     "accuracy": ranks[0]["accuracy"], "test_loss": ranks[0]["test_loss"],
                     "final_train_loss": ranks[0]["losses"][-1],
                     "bytes_per_step": ranks[0]["bytes_per_step"],
                     "bytes_first_step": ranks[0]["bytes_first_step"],
                     "step_s_per_rank": [r["step_s"] for r in ranks]} for ranks in runs]
            for label, runs in raw.items()}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["hook"] for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    kib = [r["bytes_per_step"]["mean"] / 1024 for r in rows]
    axes[0].bar(x, kib, color="tab:blue", label="measured")
    axes[0].scatter(x, [r["predicted_bytes"] / 1024 for r in rows], color="black", marker="_",
                    s=400, zorder=3, label="predicted")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("KiB all-reduced per step, one rank (log)")
    axes[0].legend()
    for ax, key, unit in ((axes[1], "step_ms", "step time, ms"),
                          (axes[2], "accuracy", "test accuracy, %")):
        means = [r[key]["mean"] for r in rows]
        err = [[m - (r[key]["lo"] if r[key]["lo"] is not None else m) for m, r in
                zip(means, rows)],
               [(r[key]["hi"] if r[key]["hi"] is not None else m) - m for m, r in
                zip(means, rows)]]
        ax.bar(x, means, yerr=err, capsize=4, color="tab:orange" if key == "step_ms"
               else "tab:green")
        center = "geometric mean" if key == "step_ms" else "mean"
        ax.set_ylabel(f"{unit} ({center}, 95% CI over seeds)")
        if key == "accuracy":
            lo = min(r[key]["lo"] if r[key]["lo"] is not None else r[key]["mean"] for r in rows)
            ax.set_ylim(max(0.0, lo - 3), 100)
        else:
            ax.set_ylim(bottom=0)
    for ax in axes:
        ax.set_xticks(list(x), labels, rotation=30, ha="right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="lesson 10: bytes, step time and accuracy of "
                                             "DDP communication hooks")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--only", nargs="+", default=None, metavar="LABEL",
                    help=f"configurations: {', '.join(c[0] for c in CONFIGS)}")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    ch = load("10_inside_a_step", "comm_hooks", "solutions")
    import torch

    configs = [c for c in CONFIGS if args.only is None or c[0] in args.only]
    if args.seeds < 1 or args.nproc < 1 or not 0 < args.epochs <= 100 or not configs:
        ap.error("--seeds and --nproc at least 1, --epochs in (0, 100], --only among "
                 f"{', '.join(c[0] for c in CONFIGS)}")
    if not ch.torch_bf16_registers():
        print("note: DDP refuses torch's bf16 hook on this torch (no CUDA/NCCL 2.10+): "
              "skipping bf16; bf16_by_hand runs", file=sys.stderr)
        configs = [c for c in configs if c[1] != "bf16"]
    t0, load_before = time.perf_counter(), os.getloadavg()
    raw = run(configs, args.seeds, args.epochs, args.nproc, args.timeout)
    rows = ch.summarize(raw)
    for row, (_, hook, opts) in zip(rows, configs):
        row["name"], row["options"] = hook, opts
    result = {
        "model": "dpt.models.MLP (101,770 parameters)", "dataset": "fashion-mnist",
        "optimizer": "SGD lr 0.05 momentum 0.9", "batch_per_rank": 64, "epochs": args.epochs,
        "nproc": args.nproc, "backend": ranks_label(args.nproc), "threads_per_rank": 1,
        "torch": torch.__version__, "seeds": args.seeds,
        "how": "bytes: comm_hooks.AllReduceCounter around each step (payload of every "
               "dist.all_reduce one rank makes; 'none' counted through torch's allreduce_hook, "
               "the same buckets); step time: median step per rank, slower rank per seed; "
               "accuracy: the full test split; intervals: 95% t over seeds (step time: "
               "geometric mean, the interval on log times)",
        "load_average_before_after": [load_before, os.getloadavg()],
        "rows": rows, "runs": compact(raw), "seconds": time.perf_counter() - t0}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "l10_comm_hooks.json").write_text(json.dumps(result, indent=2))
    plot(rows, OUT / "l10_comm_hooks.png",
         f"DDP communication hooks: MLP on Fashion-MNIST, {args.nproc} ranks "
         f"({ranks_label(args.nproc)}), "
         f"{args.epochs:g} epoch(s), {args.seeds} seeds (torch {torch.__version__})")
    print()
    print(ch.format_rows(rows))
    print(f"load average (1, 5, 15 min) before {load_before}, after {os.getloadavg()}: step "
          "times are only as good as the machine was idle")
    print(f"wrote {OUT / 'l10_comm_hooks'}.json and .png ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
