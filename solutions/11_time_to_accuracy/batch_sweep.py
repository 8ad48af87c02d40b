"""Lesson 11: steps and samples to a target accuracy as the global batch grows (given code).

Data parallelism at a fixed per-rank batch is a larger global batch: N ranks at b train on
B = N b. Lesson 11.2 shows that one process on the whole batch takes the same steps, so this
sweep trains one process per global batch B, no ranks: the MLP on Fashion-MNIST, SGD with
momentum 0.9, from ``--base-lr`` at ``--base-batch``, until the test accuracy (on the first
``--test-limit`` test images, every 512 training samples) reaches ``--target``, or
``--max-epochs`` pass. Each (rule, B) runs once per seed (the initialisation and the data
order), the seeds in a pool of ``--workers`` processes of one thread each. For each (rule, B)
it prints the steps and the samples to the target, geometric means with 95% t-intervals on
their logs over the seeds (``dpt.stats.positive_ci``: a count of steps is never below zero), and for each rule the critical batch that ``critical_batch`` (task
11.9) fits to the steps of the runs that reached the target.

What it shows (McCandlish et al. 2018): with the learning rate scaled (``--rule linear``, with
a warmup of ``--warmup`` steps) the steps fall almost as 1/B up to the critical batch, then
level off at S_min; without it (``none``) a larger batch saves fewer steps. Past some batch
the linearly scaled rate is too large for SGD and the target is missed; ``--optimizer lamb``
(LAMB, task 11.11, lr scaled by the square root rule) keeps going there.

    .venv/bin/python solutions/11_time_to_accuracy/batch_sweep.py --quick
    .venv/bin/python solutions/11_time_to_accuracy/batch_sweep.py --batches 64 256 1024 4096 \\
        --seeds 3 --rule linear none --target 0.84

``benchmarks/bench_l11_batch_sweep.py`` runs the full sweep (3 seeds, 64 to 8192, SGD and LAMB)
and draws it; the notebook shows its committed result.
"""

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import math
import multiprocessing as mp
import sys
import time

import torch
import torch.nn.functional as F
from lr_scaling import RULES, critical_batch, lr_schedule, scaled_lr, train_to_target

from dpt.stats import positive_ci

OPTIMIZERS = ("sgd", "lamb")
QUICK = dict(batches=[64, 256, 1024, 4096], seeds=1, test_limit=1_000, max_epochs=3.0)
EVAL_SAMPLES = 512  # training samples between two evaluations (every 8 steps at 64)

_DATA: dict = {}  # each worker's copy of the data (pool initializer)


def _load(dataset: str, train_limit: int | None, test_limit: int) -> None:
    from dpt.data import load_tensors

    torch.set_num_threads(1)
    _DATA["train"] = load_tensors(dataset, train=True, limit=train_limit)
    _DATA["test"] = load_tensors(dataset, train=False, limit=test_limit)


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "lamb":
        from large_batch import LAMB

        return LAMB(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def run_one(job: dict) -> dict:
    """One run to the target: ``job`` names the batch, seed, rule, optimizer and the rest."""
    from dpt.data import TensorLoader
    from dpt.models import MLP

    x, y = _DATA["train"]
    xt, yt = _DATA["test"]
    b = job["batch"]
    if b > len(x):
        raise ValueError(f"batch {b} is larger than the {len(x)} training samples")
    torch.manual_seed(job["seed"])
    model = MLP()
    loader = TensorLoader(x, y, batch_size=b, shuffle=True, drop_last=True,
                          generator=torch.Generator().manual_seed(job["seed"]))
    lr_at = lr_schedule(job["base_lr"], job["base_batch"], b, job["rule"], job["warmup"])
    opt = make_optimizer(job["optimizer"], model.parameters(), lr_at(0))

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            return (model(xt).argmax(1) == yt).float().mean().item()

    max_steps = max(1, int(job["max_epochs"] * len(loader)))
    out = train_to_target(model, opt, loader, lr_at, evaluate, job["target"],
                          max(1, EVAL_SAMPLES // b), max_steps, loss_fn=F.cross_entropy)
    return {"batch": b, "seed": job["seed"], "rule": job["rule"],
            "optimizer": job["optimizer"],
            "lr": scaled_lr(job["base_lr"], job["base_batch"], b, job["rule"]), "steps": out["steps"],
            "samples": out["samples"], "epochs": out["samples"] / len(x),
            "seconds": out["seconds"], "reached": out["reached"],
            "accuracy": out["accuracy"]}


def jobs_of(batches, seeds: int, rules, optimizers, **common) -> list[dict]:
    """Every (optimizer, rule, batch, seed), the largest batches first: the longest runs
    start first, so the pool's last minutes are not one worker on one long run."""
    return [dict(common, batch=b, seed=s, rule=r, optimizer=o)
            for b in sorted(batches, reverse=True) for o in optimizers for r in rules
            for s in range(seeds)]


def run_jobs(jobs: list[dict], workers: int, dataset: str, train_limit: int | None,
             test_limit: int, progress: bool = True) -> list[dict]:
    """The runs, ``workers`` processes of one thread each (1: in this process)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), unit="run", disable=not progress, dynamic_ncols=True)
    if workers <= 1:
        _load(dataset, train_limit, test_limit)
        out = []
        for job in jobs:
            out.append(run_one(job))
            bar.update()
        bar.close()
        return out
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    with ctx.Pool(workers, initializer=_load, initargs=(dataset, train_limit, test_limit)) as pool:
        out = []
        for row in pool.imap_unordered(run_one, jobs):
            out.append(row)
            bar.update()
    bar.close()
    key = {(j["optimizer"], j["rule"], j["batch"], j["seed"]): i for i, j in enumerate(jobs)}
    return sorted(out, key=lambda r: key[(r["optimizer"], r["rule"], r["batch"], r["seed"])])


def summarize(runs: list[dict]) -> dict:
    """Per (optimizer, rule, batch): runs that reached the target, steps and samples to it
    (geometric mean and 95% interval over those seeds, on the logs: never below zero); per
    (optimizer, rule): the critical batch."""
    rows, fits = [], []
    groups = sorted({(r["optimizer"], r["rule"]) for r in runs},
                    key=lambda g: (OPTIMIZERS.index(g[0]), RULES.index(g[1])))
    for opt, rule in groups:
        mine = [r for r in runs if (r["optimizer"], r["rule"]) == (opt, rule)]
        for b in sorted({r["batch"] for r in mine}):
            at = [r for r in mine if r["batch"] == b]
            ok = [r for r in at if r["reached"]]
            row = {"optimizer": opt, "rule": rule, "batch": b, "lr": at[0]["lr"],
                   "reached": len(ok), "seeds": len(at)}
            for key in ("steps", "samples", "epochs"):
                m, lo, hi = positive_ci([r[key] for r in ok]) if ok else (None, None, None)
                row.update({key: m, f"{key}_lo": lo, f"{key}_hi": hi})
            rows.append(row)
        ok = [r for r in mine if r["reached"]]
        fit = {"optimizer": opt, "rule": rule, "batches": sorted({r["batch"] for r in ok})}
        try:
            s_min, b_crit = critical_batch([r["batch"] for r in ok], [r["steps"] for r in ok])
            fit.update(s_min=s_min, b_crit=b_crit)
        except (ValueError, NotImplementedError) as exc:
            fit["error"] = str(exc).splitlines()[0]
        fits.append(fit)
    return {"rows": rows, "critical": fits}


def _ci(row: dict, key: str, fmt: str) -> str:
    if row[key] is None:
        return "-"
    if row[f"{key}_lo"] is None:
        return format(row[key], fmt)
    return f"{row[key]:{fmt}} [{row[f'{key}_lo']:{fmt}}, {row[f'{key}_hi']:{fmt}}]"


def format_table(summary: dict) -> str:
    lines = [f"{'optimizer':<9} {'rule':<7} {'batch':>6} {'lr':>7} {'reached':>7}  "
             f"{'steps to target':<22} {'epochs to target':<22}"]
    for r in summary["rows"]:
        lines.append(f"{r['optimizer']:<9} {r['rule']:<7} {r['batch']:>6} {r['lr']:>7.3g} "
                     f"{r['reached']:>3}/{r['seeds']:<3}  {_ci(r, 'steps', '.0f'):<22} "
                     f"{_ci(r, 'epochs', '.2f'):<22}")
    for f in summary["critical"]:
        head = f"critical batch, {f['optimizer']} {f['rule']}:"
        if "error" in f:
            lines.append(f"{head} not fitted ({f['error']})")
        else:
            lines.append(f"{head} S_min = {f['s_min']:.0f} steps, B_crit = {f['b_crit']:.0f} "
                         f"(fit over batches {', '.join(map(str, f['batches']))})")
    return "\n".join(lines)


def plot(result: dict, path=None, axes=None):
    """Steps and epochs to the target against the global batch, one line per (optimizer,
    rule), 95% intervals as error bars, "k/n" where only k of n seeds reached the target; the
    critical-batch fit of the linear rule dashed (the model assumes an lr suited to each B)."""
    import matplotlib.pyplot as plt

    summary = result["summary"]
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    else:
        fig = axes[0].figure
    for opt, rule in dict.fromkeys((r["optimizer"], r["rule"]) for r in summary["rows"]):
        rows = [r for r in summary["rows"] if (r["optimizer"], r["rule"]) == (opt, rule)
                and r["steps"] is not None]
        if not rows:
            continue
        label = f"{opt.upper()} {rule}"
        for ax, key in zip(axes, ("steps", "epochs")):
            ys = [r[key] for r in rows]
            err = [[y - (r[f"{key}_lo"] if r[f"{key}_lo"] is not None else y)
                    for y, r in zip(ys, rows)],
                   [(r[f"{key}_hi"] if r[f"{key}_hi"] is not None else y) - y
                    for y, r in zip(ys, rows)]]
            line = ax.errorbar([r["batch"] for r in rows], ys, yerr=err, marker="o", capsize=3,
                               label=label)
            for r, y in zip(rows, ys):  # how many seeds reached it, where not all did
                if r["reached"] < r["seeds"]:
                    ax.annotate(f"{r['reached']}/{r['seeds']}", (r["batch"], y), fontsize=7,
                                xytext=(4, 4), textcoords="offset points",
                                color=line[0].get_color())
            if key == "steps" and rule == "linear":  # McCandlish et al.: lr tuned to B
                fit = next((f for f in summary["critical"]
                            if (f["optimizer"], f["rule"]) == (opt, rule) and "b_crit" in f), None)
                if fit and fit["b_crit"] > 0:
                    lo, hi = min(fit["batches"]), max(fit["batches"])
                    bs = [lo * (hi / lo) ** (k / 40) for k in range(41)]
                    ax.plot(bs, [fit["s_min"] * (1 + fit["b_crit"] / b) for b in bs], "--",
                            color=line[0].get_color(), lw=1,
                            label=f"fit S_min (1 + B_crit / B): B_crit = {fit['b_crit']:.0f}")
                    ax.axvline(fit["b_crit"], color=line[0].get_color(), ls=":", lw=1)
    c = result["config"]
    missed = [f"{r['optimizer'].upper()} {r['rule']} {r['batch']}" for r in summary["rows"]
              if r["reached"] == 0]
    for ax, what in zip(axes, ("steps", "epochs")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        values = [r[what] for r in summary["rows"] if r[what] is not None]
        if values:  # the points, not a wide interval of two seeds, set the scale
            ax.set_ylim(min(values) / 2, max(values) * 2)
        if missed:
            ax.text(0.01, 0.01, "no seed reached it: " + ", ".join(missed), fontsize=7,
                    transform=ax.transAxes, va="bottom")
        ax.set_xlabel("global batch B")
        ax.set_ylabel(f"{what} to {100 * c['target']:g}% test accuracy (95% CI)")
        ax.legend(fontsize=7)
    fig.suptitle(f"MLP on {c['dataset']}: to {100 * c['target']:g}% test accuracy, at most "
                 f"{c['max_epochs']:g} epochs ({c['seeds']} seed(s); SGD momentum 0.9, lr "
                 f"{c['base_lr']:g} at batch {c['base_batch']}, {c['warmup']} warmup steps)",
                 fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024, 4096],
                    metavar="B", help="global batches")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rule", nargs="+", default=["linear", "none"], choices=RULES,
                    help="learning-rate scaling rules to compare (SGD)")
    ap.add_argument("--optimizer", nargs="+", default=["sgd"], choices=OPTIMIZERS,
                    help="lamb: LAMB with the sqrt rule from --lamb-lr")
    ap.add_argument("--target", type=float, default=0.84, help="test accuracy to reach")
    ap.add_argument("--base-lr", type=float, default=0.02, help="SGD's lr at --base-batch")
    ap.add_argument("--lamb-lr", type=float, default=0.005, help="LAMB's lr at --base-batch")
    ap.add_argument("--base-batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=50, help="warmup steps (Goyal et al.)")
    ap.add_argument("--max-epochs", type=float, default=10.0)
    ap.add_argument("--train-limit", type=int, default=None, help="the first N train samples")
    ap.add_argument("--test-limit", type=int, default=2000, help="the first N test samples")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--workers", type=int, default=2, help="processes, one thread each")
    ap.add_argument("--quick", action="store_true",
                    help="one seed, batches 64 256 1024 4096, 1,000 test images, at most 3 "
                         "epochs (about 15 s on 2 cores)")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    return ap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; ``--quick`` changes the defaults (QUICK) of the flags not given."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)
    return args


def check(args: argparse.Namespace) -> None:
    """Bad input as one ValueError, before any work starts."""
    if args.seeds < 1 or args.workers < 1:
        raise ValueError(f"--seeds and --workers must be at least 1, got {args.seeds} and "
                         f"{args.workers}")
    if min(args.batches) < 1 or args.base_batch < 1:
        raise ValueError("batches must be at least 1")
    if not 0 < args.target < 1:
        raise ValueError(f"--target is a test accuracy between 0 and 1, got {args.target}")
    if not (args.max_epochs > 0 and math.isfinite(args.max_epochs)):
        raise ValueError(f"--max-epochs must be positive, got {args.max_epochs}")
    if not (args.base_lr > 0 and args.lamb_lr > 0) or args.warmup < 0:
        raise ValueError("learning rates must be positive and --warmup at least 0")
    for key in ("train_limit", "test_limit"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1")
    limit = args.train_limit or 60_000
    if max(args.batches) > limit:
        raise ValueError(f"batch {max(args.batches)} is larger than the {limit} training "
                         "samples")


def jobs_for(args: argparse.Namespace, batches=None, optimizers=None, rules=None
             ) -> list[dict]:
    """The runs ``args`` ask for (``batches``, ``optimizers``, ``rules``: others instead)."""
    common = dict(target=args.target, base_batch=args.base_batch, warmup=args.warmup,
                  max_epochs=args.max_epochs)
    batches = args.batches if batches is None else batches
    jobs = []
    for opt in args.optimizer if optimizers is None else optimizers:
        if opt == "sgd":
            jobs += jobs_of(batches, args.seeds, args.rule if rules is None else rules, ["sgd"],
                            base_lr=args.base_lr, **common)
        else:  # LAMB: the square root rule, as You et al.
            jobs += jobs_of(batches, args.seeds, ["sqrt"], ["lamb"], base_lr=args.lamb_lr,
                            **common)
    return jobs


def sweep(args: argparse.Namespace, jobs: list[dict] | None = None) -> dict:
    """The runs (``jobs``, default: those ``args`` ask for) and their summary: what
    bench_l11_batch_sweep.py saves."""
    jobs = jobs_for(args) if jobs is None else jobs
    jobs = sorted(jobs, key=lambda j: -j["batch"])  # the longest runs first
    t0 = time.perf_counter()
    runs = run_jobs(jobs, min(args.workers, len(jobs)), args.dataset, args.train_limit,
                    args.test_limit, args.progress)
    config = {k: v for k, v in vars(args).items() if k not in ("progress", "quick")}
    return {"config": {**config, "eval_samples": EVAL_SAMPLES, "model": "dpt.models.MLP",
                       "momentum": 0.9},
            "runs": runs, "summary": summarize(runs),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    from dpt.errors import report_error

    args = parse(argv)
    try:
        check(args)
        what = [f"SGD ({' and '.join(args.rule)})" if o == "sgd" else "LAMB (sqrt)"
                for o in args.optimizer]
        print(f"to {args.target:g} test accuracy ({args.test_limit} test images): batches "
              f"{' '.join(map(str, args.batches))}, {args.seeds} seed(s), "
              f"{' + '.join(what)}; {args.workers} worker(s)", flush=True)
        result = sweep(args)
    except (ValueError, NotImplementedError) as exc:
        return report_error(exc)
    print(format_table(result["summary"]))
    print(f"({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
