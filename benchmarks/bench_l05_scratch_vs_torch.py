"""Lesson 05: step throughput of the hand-written DDPs against torch DDP, in one run.

World size 2, gloo, one thread per rank, the course's ConvNet (without batch norm, so no
wrapper has buffers to keep in sync) on a synthetic batch of ``--batch`` images per rank:
a compute-bound configuration (about 26k parameters, 0.1 MB of gradients, against tens of
milliseconds of convolution). The variants are interleaved inside one process group, each
repeat in a rotated order; every block is ``--steps`` steps after a barrier, its time the
slowest rank's. Tensors and models live on ``dpt.dist.rank_device()``, and the clock is read
after synchronizing that device. Reported: median time per step, the same step under ``no_sync()`` (compute
only), their difference (communication and waiting), and throughput relative to torch DDP.
The plot is the lesson's ``scratch_demo.plot_step_split``: communication and waiting get a
panel of their own, since next to the compute they are a few percent.

    python benchmarks/bench_l05_scratch_vs_torch.py --repeats 7
    python benchmarks/bench_l05_scratch_vs_torch.py --plot-only   # redraw the committed result

Writes benchmarks/runs/lessons/l05_scratch_vs_torch.json and .png
(git-ignored; the committed results are in benchmarks/reference/lessons/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from dpt.lessons import load

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "runs" / "lessons"  # git-ignored; committed: reference/lessons
VARIANTS = ["torch", "naive", "overlap", "bucketed"]


def _wrap(name, module):
    from torch.nn.parallel import DistributedDataParallel

    if name == "torch":
        return DistributedDataParallel(module)  # the model has no buffers to broadcast
    if name == "naive":
        NaiveDDP = load("05_ddp_from_scratch", "naive_ddp", "solutions").NaiveDDP
        return NaiveDDP(module)
    if name == "overlap":
        OverlapDDP = load("05_ddp_from_scratch", "overlap_ddp", "solutions").OverlapDDP
        return OverlapDDP(module)
    BucketedDDP = load("05_ddp_from_scratch", "bucketed_ddp", "solutions").BucketedDDP
    return BucketedDDP(module, bucket_cap_mb=25.0)


def bench_rank(rank, world_size, batch, steps, repeats, warmup):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from benchmarks.registry import slowest_rank_seconds
    from dpt.dist import rank_device
    from dpt.models import ConvNet

    dev = rank_device()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 1, 28, 28, generator=g).to(dev)
    y = torch.randint(0, 10, (batch,), generator=g).to(dev)
    runs = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        model = _wrap(name, ConvNet(batch_norm=False).to(dev))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        finish = getattr(model, "finish_gradient_synchronization", lambda: None)

        def step(model=model, opt=opt, finish=finish):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            finish()
            opt.step()

        def compute(model=model, step=step):
            with model.no_sync():
                step()

        runs[name] = {"step": step, "compute": compute}

    def block(fn, n):
        return slowest_rank_seconds(fn, n, dev)

    for name in VARIANTS:  # warm-up, both kinds of step
        block(runs[name]["step"], warmup)
        block(runs[name]["compute"], warmup)
    times = {name: {"step": [], "compute": []} for name in VARIANTS}
    for r in range(repeats):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for name in order:
            for kind in ("step", "compute"):
                times[name][kind].append(block(runs[name][kind], steps))
    grad_bytes = sum(p.numel() * p.element_size() for p in ConvNet(batch_norm=False).parameters())
    return {"times": times, "threads": torch.get_num_threads(), "grad_bytes": grad_bytes,
            "backend": dist.get_backend()}


def summarize(raw: dict) -> dict:
    rows = {}
    for name, t in raw["times"].items():
        step, compute = statistics.median(t["step"]), statistics.median(t["compute"])
        rows[name] = {"step_s": step, "compute_s": compute, "comm_s": max(0.0, step - compute)}
    for row in rows.values():
        row["throughput_vs_torch"] = rows["torch"]["step_s"] / row["step_s"]
    # the ratio per repeat (adjacent blocks), whose median is less sensitive to drifting load
    for name in rows:
        ratios = [a / b for a, b in zip(raw["times"]["torch"]["step"], raw["times"][name]["step"])]
        rows[name]["paired_ratio_median"] = statistics.median(ratios)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128, help="images per rank")
    parser.add_argument("--steps", type=int, default=8, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw the .png from the .json of the last run")
    args = parser.parse_args(argv)
    if min(args.batch, args.steps, args.repeats) < 1 or args.warmup < 0:
        print("error: --batch, --steps and --repeats must be positive", file=sys.stderr)
        return 2
    if str(REPO) not in sys.path:  # run as a script: ranks import this file as benchmarks.*
        sys.path.insert(0, str(REPO))
    # the lesson's notebook draws it the same way
    plot_step_split = load("05_ddp_from_scratch", "scratch_demo", "solutions").plot_step_split

    if args.plot_only:
        saved = OUT / "l05_scratch_vs_torch.json"
        if not saved.is_file():
            print(f"error: no {saved} to redraw; run without --plot-only", file=sys.stderr)
            return 2
        plot_step_split(json.loads(saved.read_text()), OUT / "l05_scratch_vs_torch.png")
        print(f"wrote {OUT / 'l05_scratch_vs_torch.png'}")
        return 0
    import benchmarks.bench_l05_scratch_vs_torch as me  # ranks import it by name
    from dpt.ranks import run_distributed

    raw = run_distributed(me.bench_rank, world_size=2, threads=1, timeout=900, echo=False,
                          args=(args.batch, args.steps, args.repeats, args.warmup))[0]
    rows = summarize(raw)
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"config": vars(args) | {"world_size": 2, "threads_per_rank": raw["threads"],
                                      "model": "ConvNet(batch_norm=False)",
                                      "grad_bytes": raw["grad_bytes"],
                                      "backend": raw["backend"]},
              "summary": rows, "raw_seconds_per_step": raw["times"]}
    (OUT / "l05_scratch_vs_torch.json").write_text(json.dumps(result, indent=2))
    plot_step_split(result, OUT / "l05_scratch_vs_torch.png")
    print(f"{'variant':10s} {'step ms':>8s} {'compute':>8s} {'comm':>7s} {'vs torch':>9s} {'paired':>7s}")
    for name, r in rows.items():
        print(f"{name:10s} {r['step_s'] * 1e3:8.2f} {r['compute_s'] * 1e3:8.2f} "
              f"{r['comm_s'] * 1e3:7.2f} {r['throughput_vs_torch']:9.3f} {r['paired_ratio_median']:7.3f}")
    print(f"wrote {OUT / 'l05_scratch_vs_torch.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
