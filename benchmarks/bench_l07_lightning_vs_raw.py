"""Lesson 07: Lightning ``ddp`` against the raw DDP loop, same model, data, batch, world size.

Both run one full epoch (Adam) over the 55 000-sample training split of Fashion-MNIST,
2 CPU processes with 1 thread each, gloo. The timed span is the epoch only (first batch to
last step, after a barrier), not process start-up. The variants alternate, ``--repeats``
times. Two figures: the median epoch, and the median step (an optimizer post-step hook,
identical in both loops, stamps every step; bursts of load from other tenants inflate some
steps and not others, so the median step is the steadier figure on a shared machine).

    python benchmarks/bench_l07_lightning_vs_raw.py --repeats 5      # the Lightning notebook's MLP, batch 64
    python benchmarks/bench_l07_lightning_vs_raw.py --model convnet --batch 128 --repeats 10
    python benchmarks/bench_l07_lightning_vs_raw.py --repeats 5 --sigterm-diagnostic

The Trainer adds a roughly fixed cost per step. The Lightning notebook's MLP takes a few milliseconds per
step, so there that cost is a large share; the ConvNet's step is more than ten times longer,
the compute-bound case. ``--sigterm-diagnostic`` adds a third variant, Lightning without its
per-step SIGTERM broadcast, to measure that one collective. Writes
benchmarks/runs/lessons/l07_lightning_vs_raw[_convnet][_sigterm].{json,png} (or under ``--out``;
the committed results are in benchmarks/reference/lessons/).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dpt.lessons import load

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "runs" / "lessons"  # git-ignored; committed: reference/lessons
TIMEOUT_S = 1800  # one variant's whole run; a full ConvNet epoch takes under a minute


def _datamodule(batch):
    FashionDataModule = load("07_lightning", "lit_fashion", "solutions").FashionDataModule

    dm = FashionDataModule(batch_size=batch, seed=1, verbose=False)
    dm.setup("fit")
    return dm


def _stamp(stamps: list[float]):
    """An optimizer post-step hook that records when each step ended (both variants use it)."""
    def hook(optimizer, args, kwargs):
        stamps.append(time.perf_counter())
    return hook


def _cycles_ms(stamps: list[float]) -> list[float]:
    """Step-end to step-end times: everything one iteration costs, data and hooks included."""
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]


def worker_lightning(batch: int, model_name: str, sigterm_broadcast: bool = True,
                     steps: int | None = None) -> None:
    import pytorch_lightning as pl
    import torch

    torch.set_num_threads(1)
    dm = _datamodule(batch)
    Lit = load("07_lightning", "lit_fashion", "solutions").LitClassifier

    from dpt.models import build_model

    class Clock(pl.Callback):
        def on_train_start(self, trainer, module):
            self.stamps = []
            trainer.optimizers[0].register_step_post_hook(_stamp(self.stamps))

        def on_train_epoch_start(self, trainer, module):
            trainer.strategy.barrier()
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            trainer.strategy.barrier()
            self.seconds = time.perf_counter() - self.start

    broadcasts = []  # Lightning (PR #20825, 2025) broadcasts a SIGTERM flag every step
    if _has_sigterm_broadcast():
        from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

        original = _TrainingEpochLoop._broadcast_sigterm_tensor

        def counted(loop):
            broadcasts.append(1)
            original(loop)

        # the diagnostic variant skips that collective (safe here: nobody sends SIGTERM)
        _TrainingEpochLoop._broadcast_sigterm_tensor = (counted if sigterm_broadcast
                                                        else lambda loop: None)
    pl.seed_everything(1, verbose=False)
    clock = Clock()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1,
                         limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         limit_train_batches=steps, callbacks=[clock])
    module = Lit()
    if model_name != "mlp":  # the same LightningModule around another network
        torch.manual_seed(1)
        module.net = build_model(model_name)
    trainer.fit(module, datamodule=dm)
    if trainer.is_global_zero:
        print("SECONDS", clock.seconds, trainer.num_training_batches, flush=True)
        print("CYCLES", json.dumps(_cycles_ms(clock.stamps)), flush=True)
        print("BROADCASTS", len(broadcasts), flush=True)


def _has_sigterm_broadcast() -> bool:
    from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

    return hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")


def worker_raw(batch: int, model_name: str, steps: int | None = None) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dm = _datamodule(batch)
    raw_ddp_epoch = load("07_lightning", "fabric_ddp", "solutions").raw_ddp_epoch

    from dpt.models import MLP, build_model

    dist.init_process_group("gloo")
    torch.manual_seed(1)
    model = DDP(MLP(128) if model_name == "mlp" else build_model(model_name))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    stamps: list[float] = []
    opt.register_step_post_hook(_stamp(stamps))
    dist.barrier()
    start = time.perf_counter()
    losses = raw_ddp_epoch(model, opt, dm.train_set, batch, torch.device("cpu"),
                           max_batches=steps)
    dist.barrier()
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        print("SECONDS", seconds, len(losses), flush=True)
        print("CYCLES", json.dumps(_cycles_ms(stamps)), flush=True)
    dist.destroy_process_group()


def _run(variant: str, batch: int, model_name: str,
         steps: int | None = None) -> tuple[float, int, list[float], int]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    me = str(Path(__file__).resolve())
    if variant.startswith("lightning"):  # Lightning starts rank 1 itself, re-running this argv
        cmd = [sys.executable, me, "--worker", variant, "--batch", str(batch),
               "--model", model_name]
    else:
        from dpt.dist import find_free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               f"--rdzv-endpoint=127.0.0.1:{find_free_port()}", "--rdzv-backend=c10d",
               me, "--worker", "raw", "--batch", str(batch), "--model", model_name]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    # Its own session, so a timeout kills every rank (Lightning's rank 1 and torchrun's workers
    # are grandchildren), not just the process we started.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise RuntimeError(f"{variant} did not finish in {TIMEOUT_S} s; killed:\n"
                           f"{stderr[-3000:]}") from None
    lines = [ln for ln in stdout.splitlines() if ln.startswith("SECONDS")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} failed:\n{stderr[-3000:]}")
    _, seconds, steps = lines[0].split()
    cycles = [json.loads(ln.split(" ", 1)[1]) for ln in stdout.splitlines()
              if ln.startswith("CYCLES")]
    counts = [int(ln.split()[1]) for ln in stdout.splitlines() if ln.startswith("BROADCASTS")]
    return float(seconds), int(steps), cycles[0] if cycles else [], counts[0] if counts else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="per rank")
    ap.add_argument("--model", choices=["mlp", "convnet"], default="mlp",
                    help="mlp: the Lightning notebook's MLP(128), the lesson's model; convnet: compute-bound")
    ap.add_argument("--sigterm-diagnostic", action="store_true",
                    help="add a third variant: Lightning with its per-step SIGTERM broadcast "
                         "patched out, to measure what that one collective costs")
    ap.add_argument("--steps", type=int, default=None,
                    help="stop each epoch after this many steps (default: the full epoch; "
                         "a small number is a smoke test, not a measurement)")
    ap.add_argument("--out", default=str(OUT), help="folder for the JSON and the plot")
    ap.add_argument("--worker", choices=["lightning", "lightning_nobcast", "raw"], default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.batch < 1 or (args.steps is not None and args.steps < 2):
        ap.error("--repeats and --batch must be at least 1, --steps at least 2")
    if args.worker in ("lightning", "lightning_nobcast"):
        worker_lightning(args.batch, args.model, sigterm_broadcast=args.worker == "lightning",
                         steps=args.steps)
        return 0
    if args.worker == "raw":
        worker_raw(args.batch, args.model, steps=args.steps)
        return 0
    variants = ["raw", "lightning"] + (["lightning_nobcast"] if args.sigterm_diagnostic else [])
    if args.sigterm_diagnostic and not _has_sigterm_broadcast():
        ap.error("this Lightning has no per-step SIGTERM broadcast to patch out")
    times = {v: [] for v in variants}
    cycles = {v: [] for v in variants}
    steps, bcasts = {}, {}
    for r in range(args.repeats):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            seconds, steps[variant], step_ms, bcasts[variant] = _run(variant, args.batch,
                                                                     args.model, args.steps)
            times[variant].append(seconds)
            cycles[variant].extend(step_ms)
            print(f"repeat {r}: {variant:17s} {seconds:6.2f}s for {steps[variant]} steps",
                  flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["raw"] / med["lightning"]  # throughput of Lightning relative to raw
    overhead = med["lightning"] - med["raw"]
    # Each repeat runs both variants back to back, so a pair shares the machine's state then.
    paired = [r / lt for r, lt in zip(times["raw"], times["lightning"])]
    # A shared machine's interference arrives in bursts that inflate some steps and not
    # others; the median step (end of one optimizer step to the end of the next, so data
    # loading and every Trainer hook are inside it) is far steadier than an epoch's total.
    step_med = {k: statistics.median(v) for k, v in cycles.items()}
    result = {"world_size": 2, "batch_per_rank": args.batch, "threads_per_rank": 1,
              "model": "MLP(128)" if args.model == "mlp" else args.model, "optimizer": "Adam",
              "data": "fashion-mnist 55000 train", "steps_per_rank": steps,
              "epoch_seconds": times, "median_seconds": med,
              "sigterm_broadcasts_per_epoch": {v: bcasts[v] for v in variants if v != "raw"},
              "lightning_throughput_ratio": ratio, "overhead_seconds_per_epoch": overhead,
              "paired_ratios": paired, "paired_ratio_median": statistics.median(paired),
              "median_step_ms": step_med,
              "median_step_ratio": step_med["raw"] / step_med["lightning"],
              "step_ms_quartiles": {k: statistics.quantiles(v, n=4) for k, v in cycles.items()},
              "raw_ms_per_step": med["raw"] / steps["raw"] * 1e3,
              "overhead_ms_per_step": overhead / steps["lightning"] * 1e3}
    if args.sigterm_diagnostic:
        # What Lightning's one extra collective per step (PR #20825, issue #21487) costs here.
        result["sigterm_broadcast_ms_per_step"] = (step_med["lightning"]
                                                   - step_med["lightning_nobcast"])
        result["median_step_ratio_without_broadcast"] = (step_med["raw"]
                                                         / step_med["lightning_nobcast"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = ("l07_lightning_vs_raw" + ("" if args.model == "mlp" else f"_{args.model}")
            + ("_sigterm" if args.sigterm_diagnostic else ""))
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"raw": "raw DDP loop", "lightning": "Lightning ddp",
             "lightning_nobcast": "Lightning ddp,\nno SIGTERM bcast"}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9 + 2 * args.sigterm_diagnostic, 3.6))
    ax.bar([names[v] for v in variants], [med[v] for v in variants])
    ax.set_ylabel("seconds per epoch (median)")
    ax.set_title(f"epoch: Lightning = {ratio:.2f} x raw throughput\n"
                 f"(paired repeats: median {result['paired_ratio_median']:.2f})", fontsize=9)
    bx.boxplot([cycles[v] for v in variants], showfliers=False)
    bx.set_xticks(range(1, len(variants) + 1), [names[v] for v in variants])
    bx.set_ylabel("ms per step (end of step to end of next)")
    bx.set_title(f"steps: median {step_med['raw']:.1f} vs {step_med['lightning']:.1f} ms "
                 f"= {result['median_step_ratio']:.2f} x", fontsize=9)
    fig.suptitle(f"{result['model']}, batch {args.batch}/rank, 2 CPU ranks, "
                 f"interleaved repeats: {args.repeats}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=100)
    print(json.dumps({"median_seconds": med, "lightning_throughput_ratio": round(ratio, 3),
                      **({"sigterm_broadcast_ms_per_step":
                          round(result["sigterm_broadcast_ms_per_step"], 2)}
                         if args.sigterm_diagnostic else {}),
                      "paired_ratio_median": round(statistics.median(paired), 3),
                      "median_step_ms": step_med,
                      "median_step_ratio": round(step_med["raw"] / step_med["lightning"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
