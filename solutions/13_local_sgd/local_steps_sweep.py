"""Lesson 13: how many local steps H? Eval loss against H, and wall time through the cost model.

LocalSGD and DiLoCo cut the bytes per step by H exactly (``local_sgd.py``): one all-reduce of
the P parameters (or pseudo-gradients) every H steps instead of one of the gradients every
step. What they cost is optimisation: between syncs the ranks' weights drift apart, and the
average of H local steps is not H steps of DDP. This script measures that cost and projects
what the saving is worth on a real network.

**The measurement.** ``dpt.models.MLP`` (101,770 parameters, 407,080 bytes in fp32) on
Fashion-MNIST, ``--nproc`` ranks (gloo on the CPU), ``--per-rank`` samples per rank per step,
the same ``--steps`` for every configuration, so every run sees the *same samples in the same
order* (768 steps x 3 ranks x 64 = 147,456 samples, about 2.5 epochs):

- DDP: torch's ``DistributedDataParallel``, AdamW (lr 1e-3): an all-reduce every step;
- LocalSGD at each H (``--hs``): the same AdamW on each rank, parameters averaged every H
  steps (tasks 13.1-13.2);
- DiLoCo at each H: the same AdamW as the inner optimizer, and an outer SGD with Nesterov
  momentum (lr 0.7, momentum 0.9, the DiLoCo paper's and torchft's defaults) stepped on the
  averaged pseudo-gradient every H steps (tasks 13.3-13.4).

``--steps`` must be a multiple of every H, so that every run ends on a sync and all ranks hold
the same weights; the largest H the default run allows is 128 (6 rounds). The eval loss is
the cross-entropy of the final weights on the first ``--eval`` test images. One launch per
seed (the initial weights and the data order) runs every configuration; the table gives the
mean and 95% t-interval over the seeds (``dpt.stats.mean_ci``).

**The projection.** This machine's ranks share a memory bus, so their all-reduce costs
microseconds; a real cluster across sites has a network. With the ring model of lesson 12
(``benchmarks.costmodel.RingModel``'s formula, links from ``dpt.interconnects``)::

    seconds(steps, H) = steps * compute_s + ceil(steps / H) * (alpha + 2 (N-1)/N * bytes / bw)

``compute_s`` is the measured seconds per step of the run that synchronises least (the
largest H), ``bytes`` the fp32 model. At 1 Gb/s (0.125 GB/s, ``ethernet-1g``) one all-reduce
of the MLP at N = 3 takes about 4.4 ms, about as long as a step computes here: DDP spends half
its time waiting, and H = 8 wins it back. At 100 Gb/s it takes 0.1 ms: nothing to gain. For a
1-billion-parameter model (4 GB) the same all-reduce takes 43 s at 1 Gb/s, so DDP is hopeless
and even H = 128 leaves a third of a second per step: a projection, drawn beside the
measurement, not measured. DiLoCo's paper (Douillard et al., arXiv 2311.08105) trains with
H = 500 on 8 workers, "communicating 500 times less"; OpenDiLoCo (arXiv 2407.07852) did it
across two continents.

    .venv/bin/python solutions/13_local_sgd/local_steps_sweep.py --quick   # ~15 s
    .venv/bin/python solutions/13_local_sgd/local_steps_sweep.py \\
        --out /tmp/l13_local_steps.json --plot /tmp/l13_local_steps.png   # ~2.5 min
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from diloco import DiLoCo
from local_sgd import CommCounter, LocalSGD

from dpt.cli import check_averaging_ranks, positive_ints

DATASET = "fashion-mnist"
LR = 1e-3  # AdamW, every configuration's (inner) optimizer
DEFAULT = {"hs": [1, 8, 32, 128], "seeds": 3, "steps": 768}
QUICK = {"hs": [1, 32], "seeds": 1, "steps": 192}
LINKS = ("ethernet-1g", "ethernet-100g")  # the slow network and a fast one
BIG_PARAMS = 1_000_000_000  # the projection's large model: 1B parameters, 4 GB in fp32


def configs(hs: Sequence[int]) -> list[tuple[str, int]]:
    """(method, H) of every run of a seed: DDP (an all-reduce every step), then LocalSGD and
    DiLoCo at each H."""
    return [("ddp", 1)] + [(m, h) for h in hs for m in ("local_sgd", "diloco")]


def global_order(seed: int, n_train: int, steps: int, global_batch: int) -> torch.Tensor:
    """The sample indices of every step, ``(steps, global_batch)``: the same for every
    configuration of a seed (a new permutation each epoch), so runs differ only in how they
    train, not in what they see."""
    per_epoch = n_train // global_batch
    if per_epoch < 1:
        raise ValueError(f"a global batch of {global_batch} is more than the {n_train} "
                         "training samples")
    rows, epoch = [], 0
    while len(rows) < steps:
        g = torch.Generator().manual_seed(seed * 10_007 + epoch)
        perm = torch.randperm(n_train, generator=g)[:per_epoch * global_batch]
        rows.extend(perm.view(per_epoch, global_batch))
        epoch += 1
    return torch.stack(rows[:steps])


def train_one(method: str, h: int, rank: int, world_size: int, seed: int, data, order,
              per_rank: int) -> dict:
    """One run on this rank: the model trained ``len(order)`` steps by ``method`` at ``h``.
    Returns its seconds, the bytes this rank put into its collectives, and the final model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpt.models import MLP

    x_train, y_train = data
    torch.manual_seed(seed)
    model = MLP()
    net = DDP(model) if method == "ddp" else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if method == "ddp":
        sync = None
    elif method == "local_sgd":
        sync = LocalSGD(model, opt, sync_every=h)
    else:
        sync = DiLoCo(model, opt, sync_every=h)
    counter = CommCounter()
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    t0 = time.perf_counter()
    with counter:
        if sync is not None:
            sync.__enter__()
        try:
            for idx in order:
                i = idx[mine]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(net(x_train[i]), y_train[i]).backward()
                opt.step()
        finally:
            if sync is not None:
                sync.__exit__(None, None, None)
    seconds = time.perf_counter() - t0
    nbytes = counter.bytes
    if method == "ddp":  # torch's reducer is not seen by CommCounter: the gradients, every step
        nbytes = len(order) * sum(p.numel() * p.element_size() for p in model.parameters())
    return {"seconds": seconds, "bytes": nbytes, "model": model,
            "syncs": len(order) if method == "ddp" else counter.calls}


def sweep_worker(rank: int, world_size: int, seed: int, hs: Sequence[int], steps: int,
                 per_rank: int, n_eval: int) -> list[dict]:
    """Every configuration of one seed on this rank; rank 0 also evaluates each final model
    (every rank holds the same weights after the last sync)."""
    import torch.distributed as dist

    from dpt.data import load_tensors

    x_train, y_train = load_tensors(DATASET, train=True)
    x_test, y_test = load_tensors(DATASET, train=False, limit=n_eval)
    order = global_order(seed, len(x_train), steps, per_rank * world_size)
    rows = []
    for method, h in configs(hs):
        run = train_one(method, h, rank, world_size, seed, (x_train, y_train), order,
                        per_rank)
        loss = acc = None
        if rank == 0:  # the weights are the same on every rank after the last sync
            with torch.no_grad():
                out = run["model"](x_test)
            loss = F.cross_entropy(out, y_test).item()
            acc = (out.argmax(1) == y_test).float().mean().item()
        w = torch.cat([p.detach().reshape(-1) for p in run["model"].parameters()])
        lo, hi = w.clone(), w.clone()  # the ranks' weights differ by hi - lo: 0 after a sync
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        t = torch.tensor([run["seconds"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        rows.append({"seed": seed, "method": method, "H": h, "eval_loss": loss,
                     "eval_acc": acc, "seconds": t.item(), "s_per_step": t.item() / steps,
                     "bytes_per_rank": run["bytes"], "syncs": run["syncs"],
                     "rank_spread": (hi - lo).max().item()})
    return rows


# --- the projection -----------------------------------------------------------------------------------

def project_seconds(steps: int, h: int, compute_s: float, nbytes: float, n: int,
                    link: str) -> float:
    """Seconds for ``steps`` steps of ``compute_s`` each with a ring all-reduce of ``nbytes``
    over ``n`` ranks every ``h`` steps, on the link ``link`` (a ``dpt.interconnects``
    preset): lesson 12's alpha-beta model, no overlap."""
    from dpt.interconnects import preset

    spec = preset(link)  # an unknown name: one line naming the choices
    if h < 1 or steps < 0 or n < 1:
        raise ValueError(f"need H >= 1, steps >= 0 and n >= 1, got {h}, {steps}, {n}")
    # benchmarks.costmodel.RingModel.allreduce_s, from the same presets
    allreduce_s = 0.0 if n == 1 else (spec.latency_us * 1e-6
                                      + 2 * (n - 1) / n * nbytes / (spec.bandwidth_GBps * 1e9))
    return steps * compute_s + math.ceil(steps / h) * allreduce_s


def projection(compute_s: float, model_bytes: int, n: int, hs: Sequence[int],
               links: Sequence[str] = LINKS) -> list[dict]:
    """Projected seconds per step at each H and link: the measured MLP (its compute, its
    bytes), and a 1B-parameter model's communication alone (no compute: not measured)."""
    rows = []
    for link in links:
        for h in sorted(set(hs) | {1}):
            rows.append({"model": "MLP", "link": link, "H": h,
                         "s_per_step": project_seconds(h, h, compute_s, model_bytes, n, link) / h})
            rows.append({"model": "1B params (comm only)", "link": link, "H": h,
                         "s_per_step": project_seconds(h, h, 0.0, 4 * BIG_PARAMS, n, link) / h})
    return rows


# --- the whole sweep ----------------------------------------------------------------------------------

def summarize(runs: list[dict]) -> list[dict]:
    """Per (method, H): mean and 95% interval of the eval loss over the seeds, and the
    bytes per rank and syncs of a run (the same for every seed)."""
    from dpt.stats import mean_ci

    out = []
    for method, h in dict.fromkeys((r["method"], r["H"]) for r in runs):
        mine = [r for r in runs if r["method"] == method and r["H"] == h]
        loss, lo, hi = mean_ci([r["eval_loss"] for r in mine])
        out.append({"method": method, "H": h, "eval_loss": loss, "lo": lo, "hi": hi,
                    "eval_acc": sum(r["eval_acc"] for r in mine) / len(mine),
                    "seeds": len(mine), "bytes_per_rank": mine[0]["bytes_per_rank"],
                    "syncs": mine[0]["syncs"],
                    "s_per_step": sum(r["s_per_step"] for r in mine) / len(mine)})
    return out


def sweep(nproc: int, hs: Sequence[int], seeds: int, steps: int, per_rank: int,
          n_eval: int, timeout: float = 300.0) -> dict:
    from dpt.data import prepare
    from dpt.models import MLP, count_parameters
    from dpt.ranks import run_distributed

    prepare(DATASET)  # here, once: a missing dataset is one line before any rank starts
    t0 = time.perf_counter()
    runs = []
    for seed in range(seeds):
        runs += run_distributed(sweep_worker, world_size=nproc, timeout=timeout,
                                backend="gloo", echo=False,
                                kwargs={"seed": seed, "hs": list(hs), "steps": steps,
                                        "per_rank": per_rank, "n_eval": n_eval})[0]
    params = count_parameters(MLP())
    summary = summarize(runs)
    # compute per step: the run that synchronises least (largest H, LocalSGD)
    quiet = [r for r in summary if r["method"] == "local_sgd" and r["H"] == max(hs)]
    compute_s = quiet[0]["s_per_step"]
    return {"config": {"nproc": nproc, "hs": list(hs), "seeds": seeds, "steps": steps,
                       "per_rank": per_rank, "samples": steps * nproc * per_rank,
                       "eval_images": n_eval, "dataset": DATASET, "model": "MLP",
                       "params": params, "lr": LR, "outer": "SGD lr 0.7, Nesterov 0.9"},
            "runs": runs, "summary": summary, "compute_s_per_step": compute_s,
            "compute_from": f"local_sgd H={max(hs)} (the fewest syncs), measured here",
            "projection": projection(compute_s, params * 4, nproc, hs),
            "seconds": round(time.perf_counter() - t0, 1)}


def format_table(result: dict) -> str:
    cfg = result["config"]
    lines = [f"eval loss on {cfg['eval_images']} test images after {cfg['steps']} steps "
             f"({cfg['samples']:,} samples), {cfg['nproc']} ranks, {cfg['seeds']} seed(s):",
             f"  {'method':<10} {'H':>4} {'eval loss':>20} {'acc':>6} {'syncs':>6} "
             f"{'bytes per rank':>15} {'ms/step':>8}"]
    for r in result["summary"]:
        ci = f" [{r['lo']:.3f}, {r['hi']:.3f}]" if r["lo"] is not None else ""
        lines.append(f"  {r['method']:<10} {r['H']:>4} {r['eval_loss']:>7.4f}{ci:>13} "
                     f"{r['eval_acc']:>6.3f} {r['syncs']:>6} {r['bytes_per_rank']:>15,} "
                     f"{1000 * r['s_per_step']:>8.1f}")
    lines.append(f"projected ms per step (compute {1000 * result['compute_s_per_step']:.1f} ms "
                 f"from {result['compute_from']}; ring all-reduce of the fp32 model):")
    proj = result["projection"]
    hs = sorted({r["H"] for r in proj})
    lines.append(f"  {'model':<22} {'link':<14}" + "".join(f"{'H=' + str(h):>11}" for h in hs))
    for model in dict.fromkeys(r["model"] for r in proj):
        for link in dict.fromkeys(r["link"] for r in proj):
            cells = {r["H"]: r["s_per_step"] for r in proj
                     if r["model"] == model and r["link"] == link}
            lines.append(f"  {model:<22} {link:<14}"
                         + "".join(f"{1000 * cells[h]:>11.2f}" for h in hs))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    summary = result["summary"]
    ddp = next(r for r in summary if r["method"] == "ddp")
    lo, hi = ddp["lo"] or ddp["eval_loss"], ddp["hi"] or ddp["eval_loss"]
    left.axhspan(lo, hi, color="grey", alpha=0.3, label="DDP (every step)")
    left.axhline(ddp["eval_loss"], color="grey")
    for method, marker in (("local_sgd", "o"), ("diloco", "s")):
        rows = sorted((r for r in summary if r["method"] == method), key=lambda r: r["H"])
        ys = [r["eval_loss"] for r in rows]
        err = [[y - (r["lo"] if r["lo"] is not None else y) for y, r in zip(ys, rows)],
               [(r["hi"] if r["hi"] is not None else y) - y for y, r in zip(ys, rows)]]
        left.errorbar([r["H"] for r in rows], ys, yerr=err, marker=marker, capsize=3,
                      label="LocalSGD" if method == "local_sgd" else "DiLoCo")
    left.set_xscale("log", base=2)
    left.set_xlabel("H, inner steps per sync")
    left.set_ylabel("eval loss (lower is better)")
    cfg = result["config"]
    left.set_title(f"measured: MLP, {cfg['nproc']} ranks, {cfg['samples']:,} samples, "
                   f"{cfg['seeds']} seed(s)", fontsize=9)
    left.legend(fontsize=8)
    for model, style in (("MLP", "-"), ("1B params (comm only)", "--")):
        for link in dict.fromkeys(r["link"] for r in result["projection"]):
            rows = [r for r in result["projection"] if r["model"] == model and r["link"] == link]
            right.plot([r["H"] for r in rows], [r["s_per_step"] for r in rows], style,
                       marker=".", label=f"{model}, {link}")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("H, inner steps per sync")
    right.set_ylabel("seconds per step (projected)")
    right.set_title("projection: ring all-reduce every H steps (lesson 12's model)",
                    fontsize=9)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    return sorted(set(positive_ints(text)))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=3, help="ranks (gloo on the CPU)")
    ap.add_argument("--hs", type=_ints, default=None,
                    help=f"inner steps per sync, comma-separated (default "
                         f"{','.join(map(str, DEFAULT['hs']))})")
    ap.add_argument("--seeds", type=int, default=None, help=f"default {DEFAULT['seeds']}")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"optimizer steps of every run (default {DEFAULT['steps']})")
    ap.add_argument("--per-rank", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--eval", type=int, default=2000, help="test images for the eval loss")
    ap.add_argument("--quick", action="store_true",
                    help=f"1 seed, H in {QUICK['hs']}, {QUICK['steps']} steps (about 15 s)")
    ap.add_argument("--out", type=Path, default=None, help="write the results (JSON) here")
    ap.add_argument("--plot", type=Path, default=None, help="draw the figure (PNG) here")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    return ap


def check(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults (``--quick``'s or the full run's) and check the flags: ValueError,
    in one line, on bad input."""
    base = QUICK if args.quick else DEFAULT
    for key in ("hs", "seeds", "steps"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    check_averaging_ranks(args.nproc)
    for flag in ("seeds", "steps", "per_rank", "eval"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, "
                             f"got {getattr(args, flag)}")
    bad = [h for h in args.hs if args.steps % h]
    if bad:
        raise ValueError(f"--steps {args.steps} is not a multiple of H = "
                         f"{', '.join(map(str, bad))}: every run must end on a sync")
    return args


def main(argv=None) -> int:
    from dpt.errors import report_error

    args = build_parser().parse_args(argv)
    try:
        check(args)
        result = sweep(args.nproc, args.hs, args.seeds, args.steps, args.per_rank, args.eval,
                       args.timeout)
    except (ValueError, RuntimeError, OSError) as exc:  # RuntimeError: a rank failed
        return report_error(exc)
    print(format_table(result))
    print(f"({result['seconds']:.1f} s)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
