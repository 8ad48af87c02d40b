"""Lesson 07: Lightning ``ddp`` against the raw DDP loop, same model, data, batch, world size.

Both run one full epoch (Adam) over the 55 000-sample training split of Fashion-MNIST,
2 CPU processes with 1 thread each, gloo. The timed span is the epoch only (first batch to
last step, after a barrier), not process start-up. The two variants alternate, ``--repeats``
times; medians are compared.

    python benchmarks/bench_l07_lightning_vs_raw.py --repeats 3      # seed 000's MLP, batch 64
    python benchmarks/bench_l07_lightning_vs_raw.py --model convnet --batch 128   # compute-bound

The Trainer adds a roughly fixed Python cost per step (hooks, the optimizer closure, logging).
Seed 000's MLP takes a few milliseconds per step, so there that cost is a large share; the
ConvNet's step is two orders of magnitude longer, which is the compute-bound case. Writes
benchmarks/results/l07_lightning_vs_raw.{json,png} (``_convnet`` added for the ConvNet).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LESSON = REPO / "solutions" / "07_lightning"
OUT = REPO / "benchmarks" / "results"


def _datamodule(batch):
    sys.path.insert(0, str(LESSON))
    from lit_fashion import FashionDataModule

    dm = FashionDataModule(batch_size=batch, seed=1, verbose=False)
    dm.setup("fit")
    return dm


def worker_lightning(batch: int, model_name: str) -> None:
    import pytorch_lightning as pl
    import torch

    torch.set_num_threads(1)
    dm = _datamodule(batch)  # also puts the lesson folder on sys.path
    from lit_fashion import LitClassifier as Lit

    from dpt.models import build_model

    class Clock(pl.Callback):
        def on_train_epoch_start(self, trainer, module):
            trainer.strategy.barrier()
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            trainer.strategy.barrier()
            self.seconds = time.perf_counter() - self.start

    pl.seed_everything(1, verbose=False)
    clock = Clock()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1,
                         limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[clock])
    module = Lit()
    if model_name != "mlp":  # the same LightningModule around another network
        torch.manual_seed(1)
        module.net = build_model(model_name)
    trainer.fit(module, datamodule=dm)
    if trainer.is_global_zero:
        print("SECONDS", clock.seconds, trainer.num_training_batches, flush=True)


def worker_raw(batch: int, model_name: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dm = _datamodule(batch)
    from fabric_ddp import raw_ddp_epoch

    from dpt.models import MLP, build_model

    dist.init_process_group("gloo")
    torch.manual_seed(1)
    model = DDP(MLP(128) if model_name == "mlp" else build_model(model_name))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    dist.barrier()
    start = time.perf_counter()
    losses = raw_ddp_epoch(model, opt, dm.train_set, batch, torch.device("cpu"))
    dist.barrier()
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        print("SECONDS", seconds, len(losses), flush=True)
    dist.destroy_process_group()


def _run(variant: str, batch: int, model_name: str) -> tuple[float, int]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    me = str(Path(__file__).resolve())
    if variant == "lightning":
        cmd = [sys.executable, me, "--worker", "lightning", "--batch", str(batch),
               "--model", model_name]
    else:
        from dpt.dist import find_free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               f"--rdzv-endpoint=127.0.0.1:{find_free_port()}", "--rdzv-backend=c10d",
               me, "--worker", "raw", "--batch", str(batch), "--model", model_name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SECONDS")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
    _, seconds, steps = lines[0].split()
    return float(seconds), int(steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="per rank")
    ap.add_argument("--model", choices=["mlp", "convnet"], default="mlp",
                    help="mlp: seed 000's MLP(128), the lesson's model; convnet: compute-bound")
    ap.add_argument("--worker", choices=["lightning", "raw"], default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.batch < 1:
        ap.error("--repeats and --batch must be at least 1")
    if args.worker == "lightning":
        worker_lightning(args.batch, args.model)
        return 0
    if args.worker == "raw":
        worker_raw(args.batch, args.model)
        return 0
    times = {"raw": [], "lightning": []}
    steps = {}
    for r in range(args.repeats):
        for variant in (("raw", "lightning") if r % 2 == 0 else ("lightning", "raw")):
            seconds, steps[variant] = _run(variant, args.batch, args.model)
            times[variant].append(seconds)
            print(f"repeat {r}: {variant:9s} {seconds:6.2f}s for {steps[variant]} steps",
                  flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["raw"] / med["lightning"]  # throughput of Lightning relative to raw
    overhead = med["lightning"] - med["raw"]
    result = {"world_size": 2, "batch_per_rank": args.batch, "threads_per_rank": 1,
              "model": "MLP(128)" if args.model == "mlp" else args.model, "optimizer": "Adam",
              "data": "fashion-mnist 55000 train", "steps_per_rank": steps,
              "epoch_seconds": times, "median_seconds": med,
              "lightning_throughput_ratio": ratio, "overhead_seconds_per_epoch": overhead,
              "raw_ms_per_step": med["raw"] / steps["raw"] * 1e3,
              "overhead_ms_per_step": overhead / steps["lightning"] * 1e3}
    OUT.mkdir(parents=True, exist_ok=True)
    stem = "l07_lightning_vs_raw" + ("" if args.model == "mlp" else f"_{args.model}")
    (OUT / f"{stem}.json").write_text(json.dumps(result, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(["raw DDP loop", "Lightning ddp"], [med["raw"], med["lightning"]])
    ax.set_ylabel("seconds per epoch (median)")
    ax.set_title(f"{result['model']}, batch {args.batch}/rank, 2 CPU ranks:\n"
                 f"Lightning throughput = {ratio:.2f} x raw "
                 f"({result['overhead_ms_per_step']:.1f} ms/step more)", fontsize=9)
    fig.tight_layout()
    fig.savefig(OUT / f"{stem}.png", dpi=100)
    print(json.dumps({"median_seconds": med, "lightning_throughput_ratio": round(ratio, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
