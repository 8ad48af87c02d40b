"""Lesson 08: memory per rank and step throughput of DDP, the ZeRO-1 optimizer and FSDP2.

Each configuration (method x N ranks, N = 1 and 2) runs in fresh processes, 1 thread per
rank, gloo, Adam. The default model is a deep MLP of equal layers (784 -> 1024, then
``--layers`` 6 of 1024 -> 1024, then -> 10: about 7.1 M parameters, so the model state is
over 100 MB and stands out of the process's noise). Equal layers matter for the sharded
optimizer: it gives each rank whole parameters, so it can only balance a model made of many
parameters of similar size. ``--layers 0`` is the Lightning notebook's one-hidden-layer MLP (``--hidden
4096``: one 3.2 M weight holds almost everything, so one rank owns nearly all the optimizer
state; FSDP2, which shards every parameter, still halves it). Configurations alternate over
``--repeats`` rounds; medians are reported. Per rank it records:

- *model state*: bytes of parameters + gradients + Adam state this rank holds after a step
  (sum of numel x element_size, local shards only): what the accounting predicts;
- *peak RSS growth*: the process's peak resident memory (VmHWM, reset just before the model
  is built) minus its resident memory at that moment: model state plus activations,
  communication buffers (DDP's gradient buckets, FSDP's all-gather buffers) and allocator
  slack;
- steps per second over the timed steps.

The accounting's prediction for N = 1..8 is drawn as its own dashed line, marked predicted:
this machine has 2 cores, so N > 2 is not measured.

    python benchmarks/bench_l08_memory.py --repeats 2
    python benchmarks/bench_l08_memory.py --layers 0 --hidden 4096   # the Lightning notebook's MLP, made wide

Writes benchmarks/runs/lessons/l08_memory.json and .png (``l08_memory_wide.*`` with ``--layers 0``)
(git-ignored; the committed results are in benchmarks/reference/lessons/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from dpt.lessons import load

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "runs" / "lessons"  # git-ignored; committed: reference/lessons
METHODS = {"ddp": "zero0", "sharded_optimizer": "zero1", "fsdp2": "zero3"}
STAGE_OF = {"ddp": "ddp", "sharded_optimizer": "zero1", "fsdp2": "zero3"}


def _proc_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset VmHWM to VmRSS
        return True
    except OSError:
        return False


def memory_model(hidden: int, layers: int):
    """The Lightning notebook's MLP when ``layers`` is 0, else a deep MLP of ``layers`` equal hidden layers."""
    from torch import nn

    from dpt.models import MLP

    if layers == 0:
        return MLP(hidden_dim=hidden)
    body = [m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.ReLU())]
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, hidden), nn.ReLU(), *body,
                         nn.Linear(hidden, 10))


def model_label(hidden: int, layers: int) -> str:
    return (f"MLP(hidden={hidden})" if layers == 0
            else f"deep MLP (784->{hidden}, {layers} x {hidden}->{hidden}, ->10)")


def memory_worker(rank: int, world_size: int, method: str, hidden: int, batch: int,
                  steps: int, warmup: int, layers: int = 0) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    shard_model = load("08_sharding", "fsdp2_train", "solutions").shard_model
    measure_bytes = load("08_sharding", "zero_accounting", "solutions").measure_bytes
    ShardedOptimizer = load("08_sharding", "zero_optimizer", "solutions").ShardedOptimizer

    from dpt.models import count_parameters

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)
    rss0 = _proc_kib("VmRSS")
    reset = _reset_peak()
    torch.manual_seed(0)
    model = memory_model(hidden, layers)
    if method == "fsdp2":
        model = shard_model(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    else:
        model = DDP(model)
        opt = (torch.optim.Adam(model.parameters(), lr=1e-4) if method == "ddp"
               else ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-4))

    def step():
        opt.zero_grad(set_to_none=False)  # keep grads allocated: the steady state
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.distributed.barrier()
    elapsed = time.perf_counter() - t0
    state = measure_bytes(model, opt)
    return {"rank": rank, "steps_per_s": steps / elapsed, "state": state,
            "peak_rss_growth_mb": (_proc_kib("VmHWM") - rss0) / 1024 if reset else None,
            "num_params": count_parameters(model)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="lesson 08: memory and throughput per rank")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6,
                    help="equal hidden layers; 0 = the Lightning notebook's one-hidden-layer MLP")
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    zero_accounting = load("08_sharding", "zero_accounting", "solutions")
    STAGES, predict_bytes = zero_accounting.STAGES, zero_accounting.predict_bytes

    from benchmarks.bench_l08_memory import memory_worker as worker  # importable by the ranks
    from dpt.models import count_parameters
    from dpt.ranks import run_distributed

    if args.hidden < 1 or args.layers < 0 or args.repeats < 1 or args.steps < 1:
        ap.error("--hidden, --repeats and --steps must be at least 1, --layers at least 0")
    num_params = count_parameters(memory_model(args.hidden, args.layers))
    runs: dict[str, list] = {}
    for _ in range(args.repeats):
        for n in (1, 2):
            for method in METHODS:
                ranks = run_distributed(worker, world_size=n, backend="gloo", timeout=300,
                                        threads=1, echo=False,
                                        args=(method, args.hidden, args.batch, args.steps,
                                              args.warmup, args.layers))
                runs.setdefault(f"{method}@{n}", []).append(ranks)
                print(f"{method:>18} N={n}: {min(r['steps_per_s'] for r in ranks):.1f} steps/s, "
                      f"state {max(r['state']['total'] for r in ranks) / 2**20:.1f} MB/rank, "
                      f"peak RSS growth {max(r['peak_rss_growth_mb'] or 0 for r in ranks):.1f} "
                      "MB/rank", flush=True)
    measured = []
    for key, reps in runs.items():
        method, n = key.split("@")
        n = int(n)
        pred = predict_bytes(num_params, n, STAGE_OF[method])
        measured.append({
            "method": method, "world_size": n,
            # the slowest rank sets the pace; the fullest rank sets the memory
            "steps_per_s": statistics.median(min(r["steps_per_s"] for r in rs) for rs in reps),
            "state_mb": statistics.median(max(r["state"]["total"] for r in rs) for rs in reps)
            / 2**20,
            "state_by_kind_mb": {k: max(r["state"][k] for r in reps[-1]) / 2**20
                                 for k in ("params", "grads", "optimizer")},
            "peak_rss_growth_mb": statistics.median(
                max(r["peak_rss_growth_mb"] or 0 for r in rs) for rs in reps),
            "predicted_state_mb": pred["total"] / 2**20})
    predicted = [{"stage": s, "world_size": n, "mb": predict_bytes(num_params, n, s)["total"] / 2**20}
                 for s in STAGES for n in range(1, 9)]
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"model": model_label(args.hidden, args.layers), "num_params": num_params,
              "optimizer": "Adam fp32", "batch_per_rank": args.batch, "steps": args.steps,
              "repeats": args.repeats, "threads_per_rank": 1, "backend": "gloo (CPU)",
              "measured": measured, "predicted": predicted,
              "note": "predicted rows are the accounting (zero_accounting.predict_bytes), "
                      "not measurements; N > 2 was not run on this 2-core machine"}
    stem = "l08_memory" if args.layers else "l08_memory_wide"
    (OUT / f"{stem}.json").write_text(json.dumps(result, indent=2))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"ddp": "C0", "zero1": "C1", "zero2": "C2", "zero3": "C3"}
    for s in STAGES:
        pts = [p for p in predicted if p["stage"] == s]
        ax.plot([p["world_size"] for p in pts], [p["mb"] for p in pts], "--", color=colors[s],
                label=f"predicted: {s}")
    for method, stage in STAGE_OF.items():
        pts = [m for m in measured if m["method"] == method]
        ax.plot([m["world_size"] for m in pts], [m["state_mb"] for m in pts], "o",
                color=colors[stage], ms=9, label=f"measured state: {method}")
        ax.plot([m["world_size"] for m in pts], [m["peak_rss_growth_mb"] for m in pts], "x",
                color=colors[stage], ms=9, label=f"measured peak RSS growth: {method}")
    ax.set(xlabel="ranks N", ylabel="MB per rank", xticks=range(1, 9),
           title=f"memory per rank: {result['model']}\n{num_params / 1e6:.2f} M params, "
                 "Adam fp32; dashed = PREDICTED by the accounting,\nmarkers = measured (N = 1, 2)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    names = list(STAGE_OF)
    for i, n in enumerate((1, 2)):
        vals = [next(m["steps_per_s"] for m in measured if m["method"] == k
                     and m["world_size"] == n) for k in names]
        bx.bar([j + 0.38 * i for j in range(len(names))], vals, width=0.38, label=f"N = {n}")
    bx.set_xticks([j + 0.19 for j in range(len(names))], names)
    bx.set(ylabel="steps / s (per rank, slowest rank)", title="step throughput (measured)")
    bx.legend()
    fig.tight_layout()
    fig.savefig(OUT / f"{stem}.png", dpi=110)
    print(f"wrote {OUT / stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
