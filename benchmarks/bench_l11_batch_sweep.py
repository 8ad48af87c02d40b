"""Lesson 11: steps and samples to a target accuracy against the global batch.

``solutions/11_time_to_accuracy/batch_sweep.py`` at full size: the MLP on Fashion-MNIST to
``--target`` test accuracy (the first 2,000 test images, evaluated every 512 training
samples), one process per run (lesson 11.2: one process on the global batch takes the same
steps as N ranks sharing it), 2 worker processes of one thread each:

- SGD (momentum 0.9, lr 0.02 at batch 64) at B = 64, 128, ..., 4096, with the linear rule
  and a 50-step warmup, and without scaling (``none``);
- at the large batches, B = 2048, 4096, 8192: LAMB (task 11.11, lr 0.005 at 64, the square
  root rule) beside SGD with the linear rule;

each for ``--seeds`` seeds (the initialisation and the data order), at most 10 epochs a run.
Per (optimizer, rule, B): the runs that reached the target, the steps and epochs to it
(geometric mean and 95% t-interval on the logs over those seeds); per (optimizer, rule): S_min and the critical batch
fitted by ``critical_batch`` (task 11.9).

    python benchmarks/bench_l11_batch_sweep.py               # about 5 min on 2 idle cores
    python benchmarks/bench_l11_batch_sweep.py --seeds 5

Writes benchmarks/runs/lessons/l11_batch_sweep.json and .png (git-ignored; the committed
results are in benchmarks/reference/lessons/).
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

SGD_BATCHES = [64, 128, 256, 512, 1024, 2048, 4096]
LARGE_BATCHES = [2048, 4096, 8192]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="lesson 11: steps and samples to a target "
                                             "accuracy against the global batch")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.84)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-lamb", action="store_true", help="SGD only (no LAMB at large B)")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.workers < 1 or not 0 < args.target < 1:
        ap.error("--seeds and --workers at least 1, --target between 0 and 1")
    bs = load("11_time_to_accuracy", "batch_sweep", "solutions")
    import torch

    sweep_args = bs.build_parser().parse_args(
        ["--seeds", str(args.seeds), "--target", str(args.target), "--workers",
         str(args.workers), "--batches", *map(str, SGD_BATCHES), "--rule", "linear", "none"])
    bs.check(sweep_args)
    jobs = bs.jobs_for(sweep_args)
    if not args.no_lamb:  # LAMB beside SGD + linear at the large batches
        jobs += bs.jobs_for(sweep_args, [b for b in LARGE_BATCHES if b not in SGD_BATCHES],
                            ["sgd"], ["linear"])
        jobs += bs.jobs_for(sweep_args, LARGE_BATCHES, ["lamb"])
        sweep_args.optimizer = ["sgd", "lamb"]
    t0, load_before = time.perf_counter(), os.getloadavg()
    result = bs.sweep(sweep_args, jobs)
    result["config"]["batches"] = sorted({r["batch"] for r in result["runs"]})
    result.update(torch=torch.__version__, threads_per_worker=1,
                  how="one process per run (lesson 11.2: the same steps as N ranks sharing "
                      "the global batch); seeds in a pool of worker processes, 1 thread each; "
                      "intervals: 95% t on the logs over the seeds that reached the target "
                      "(dpt.stats.positive_ci)",
                  load_average_before_after=[load_before, os.getloadavg()],
                  seconds=round(time.perf_counter() - t0, 1))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "l11_batch_sweep.json").write_text(json.dumps(result, indent=1))
    bs.plot(result, OUT / "l11_batch_sweep.png")
    print(bs.format_table(result["summary"]))
    print(f"load average (1, 5, 15 min) before {load_before}, after {os.getloadavg()}")
    print(f"wrote {OUT / 'l11_batch_sweep'}.json and .png ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
