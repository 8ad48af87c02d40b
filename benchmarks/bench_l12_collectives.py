"""Lesson 12: the bus bandwidth of every collective, at every N this machine allows.

``solutions/12_step_cost/bandwidth.py`` at full size: all-reduce, all-gather, reduce-scatter
and broadcast of float32 arrays from 1 KB to ``--max-mb`` (x4 a step), at every N from 2 to
``--max-nproc`` (default: every GPU under NCCL, one GPU per rank; without 2 GPUs, gloo on the
CPU, a rank per core), each size ``--warmup`` untimed calls then the median of ``--repeats``,
the slowest rank's. Per row: time, algbw and busbw with nccl-tests' factors (task 12.5); gloo's
reduce-scatter is marked emulated (an all-reduce inside torch's gloo backend). Per N: the
alpha-beta fit of the all-reduce rows, the link model ``crossover.py`` can start from.

    python benchmarks/bench_l12_collectives.py                 # 1 KB-64 MB, every N
    python benchmarks/bench_l12_collectives.py --quick         # 1 KB-256 KB, N=2, 2 repeats
    python benchmarks/bench_l12_collectives.py --plot-only     # redraw the last run

Writes benchmarks/runs/lessons/l12_collectives.json and .png (git-ignored; the committed
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
NAME = "l12_collectives"
QUICK = dict(max_mb=0.25, max_nproc=2, repeats=2, warmup=1)


def machine() -> dict:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"torch": torch.__version__, "cores": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mb", type=float, default=64, help="largest size S, in MB")
    ap.add_argument("--max-nproc", type=int, default=None,
                    help="largest N (default: every GPU under NCCL, else the cores)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="the suite's small form: 1 KB to 256 KB, N=2, 2 repeats, 1 warm-up")
    ap.add_argument("--out", type=Path, default=OUT, help="folder for the .json and .png")
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw the .png from the .json of the last run")
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)
    bw = load("12_step_cost", "bandwidth", "solutions")
    json_path, png_path = args.out / f"{NAME}.json", args.out / f"{NAME}.png"
    if args.plot_only:
        if not json_path.is_file():
            print(f"error: no {json_path} to redraw; run without --plot-only", file=sys.stderr)
            return 2
        bw.plot(json.loads(json_path.read_text()), png_path)
        print(f"wrote {png_path}")
        return 0
    lesson_args = bw.build_parser().parse_args(
        ["--max-mb", str(args.max_mb), "--repeats", str(args.repeats), "--warmup",
         str(args.warmup), *(["--max-nproc", str(args.max_nproc)] if args.max_nproc else [])])
    try:
        nprocs = bw.check(lesson_args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sizes = bw.sizes_between(1024, int(args.max_mb * 2**20))
    t0, load_before = time.perf_counter(), os.getloadavg()
    try:
        result = bw.measure(list(bw.OPS), sizes, nprocs, args.repeats, args.warmup)
    except RuntimeError as exc:  # a rank failed (dpt.ranks.RankFailure)
        from dpt.errors import report_error

        return report_error(exc)
    result.update(machine=machine(), quick=args.quick,
                  load_average_before_after=[load_before, os.getloadavg()],
                  seconds=round(time.perf_counter() - t0, 1))
    args.out.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    bw.plot(result, png_path)
    print(bw.format_table(result))
    print(f"load average (1, 5, 15 min) before {load_before}, after {os.getloadavg()}")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
