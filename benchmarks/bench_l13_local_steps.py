"""Lesson 13: eval loss against H, the local steps between syncs, and the wall time it buys.

``solutions/13_local_sgd/local_steps_sweep.py`` at full size: ``dpt.models.MLP`` on
Fashion-MNIST, 3 ranks (gloo on the CPU) of 64 samples a step, 768 steps (147,456 samples,
about 2.5 epochs) for every configuration, so all see the same samples in the same order:
torch's DDP (AdamW, lr 1e-3), LocalSGD (tasks 13.1-13.2) and DiLoCo (13.3-13.4: AdamW inside,
SGD with Nesterov momentum 0.9 and lr 0.7 outside) at H = 1, 8, 32, 128; ``--seeds`` launches
(the initial weights and the data order), 95% t-intervals over them (``dpt.stats.mean_ci``).
Beside the measurement, the projection through the ring model (lesson 12) at 1 and 100 Gb/s
for the MLP and, communication only, a 1B-parameter model.

    python benchmarks/bench_l13_local_steps.py               # about 2.5 min on 2 idle cores
    python benchmarks/bench_l13_local_steps.py --seeds 5

Writes benchmarks/runs/lessons/l13_local_steps.json and .png (git-ignored; the committed
results are in benchmarks/reference/lessons/).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dpt.lessons import load

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "runs" / "lessons"  # git-ignored; committed: reference/lessons


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="lesson 13: eval loss against the local steps H, "
                                             "and the projected wall time")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    sweep = load("13_local_sgd", "local_steps_sweep", "solutions")
    import torch

    load_before = os.getloadavg()
    OUT.mkdir(parents=True, exist_ok=True)
    code = sweep.main(["--seeds", str(args.seeds), "--out", str(OUT / "l13_local_steps.json"),
                       "--plot", str(OUT / "l13_local_steps.png")])
    if code == 0:
        import json

        path = OUT / "l13_local_steps.json"
        result = json.loads(path.read_text())
        result.update(torch=torch.__version__, threads_per_rank=1,
                      how="one launch of 3 gloo ranks per seed runs every configuration; "
                          "intervals: 95% t over the seeds (dpt.stats.mean_ci); the projection "
                          "is lesson 12's ring model, not a measurement",
                      load_average_before_after=[load_before, os.getloadavg()])
        path.write_text(json.dumps(result, indent=1))
        print(f"load average (1, 5, 15 min) before {load_before}, after {os.getloadavg()}")
    return code


if __name__ == "__main__":
    sys.exit(main())
