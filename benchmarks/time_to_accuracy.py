"""Time to accuracy: how much sooner N ranks reach a target test accuracy than one.

Throughput (``benchmarks/run.py``'s speedup) says how many more samples a second N ranks
process; it says nothing of how many samples the model then needs. Each rank keeps its batch
(64), so the global batch is 64 N and an epoch has N times fewer steps; the learning rate
follows lesson 11's linear rule with a warmup (``scaled_lr`` and ``warmup_lr`` of
``solutions/11_time_to_accuracy/lr_scaling.py``). Each launch trains the MLP on Fashion-MNIST
from the same initialisation until a fixed subset of the test split reaches ``target``
(``train_to_target``, task 11.8), timed inside the ranks from the first step to the
evaluation that reached it (evaluations included, as in MLPerf; the launch is not).

A round launches N = 1 and N = max back to back, the order flipped every other round, seed =
round (the model's initialisation and the data order). Per N: seconds and epochs to target,
with 95% intervals over the rounds; the time-to-target speedup is ``seconds(N=1) /
seconds(N)`` paired by round (``analysis.ratio_ci``), beside the same runs' throughput speedup
(samples a second): the first is the second divided by the epochs ratio (epochs at N over
epochs at N = 1), so the table parts what N ranks buy from what their larger batch costs. A run
that misses the target within ``max_epochs`` is censored: left out of the intervals, with a
note.

The **epochs check** follows MLPerf's reference convergence points (training_rules.adoc): a
larger global batch may need more epochs, and a result counts only while it needs no more
than ``1 + margin`` times the epochs of N = 1. The verdict is ``ok`` (the ratio's estimate is
within the margin), ``worse`` (its whole interval is beyond it) or ``unclear``.

:func:`tta_rank` runs in the ranks; :func:`run_rounds` launches them; everything else is pure
computation on the runs (``tta_summary``, ``epochs_verdict``, ``tta_markdown``), tested with
made-up rows.
"""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass

from benchmarks.analysis import BUSY, busy_threshold, fmt_ci, positive_ci, ratio_ci
from dpt.stats import mean_ci

VERDICTS = ("ok", "worse", "unclear")


@dataclass
class TTAConfig:
    target: float = 0.86  # accuracy on the test subset: under an epoch at N = 1
    dataset: str = "fashion-mnist"  # always fetched by `make data-for-tests`
    model: str = "mlp"
    per_rank_batch: int = 64
    base_lr: float = 0.02  # SGD, momentum 0.9, at base_batch
    base_batch: int = 64
    momentum: float = 0.9
    rule: str = "linear"
    warmup_steps: int = 50
    # steps at N = 1; N ranks evaluate every eval_every / N steps: every 1,536 samples at
    # every N, so that the epochs to target compare at the same resolution
    eval_every: int = 24
    test_subset: int = 2000  # the first images of the test split, shared out among the ranks
    max_epochs: float = 3.0
    margin: float = 0.25  # the epochs check: N may need up to (1 + margin) x the epochs of N = 1
    rounds: int = 5
    timeout: float = 300.0


# ------------------------------------------------------------------------ rank side


def _epochs(loader):
    """``loader`` as an iterable that starts a new shuffle (``set_epoch``) each time it is
    iterated: ``train_to_target`` iterates its batches once per epoch."""

    class Epochs:
        def __init__(self):
            self.epoch = 0

        def __iter__(self):
            loader.set_epoch(self.epoch)
            self.epoch += 1
            return iter(loader)

        def __len__(self):
            return len(loader)

    return Epochs()


def tta_rank(rank: int, world_size: int, cfg: dict, seed: int) -> dict:
    """One rank of a launch: train with DDP until the target; what it took."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler

    from dpt.data import TensorLoader, load_tensors
    from dpt.dist import rank_device
    from dpt.lessons import load
    from dpt.models import build_model

    lr_scaling = load("11_time_to_accuracy", "lr_scaling", "solutions")
    c = TTAConfig(**cfg)
    device = rank_device()
    x, y = load_tensors(c.dataset, train=True)
    xt, yt = load_tensors(c.dataset, train=False, limit=c.test_subset)
    mine = slice(rank, None, world_size)  # this rank's share of the test subset
    xt, yt = xt[mine].to(device), yt[mine].to(device)
    x, y = x.to(device), y.to(device)
    sampler = DistributedSampler(range(len(x)), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed, drop_last=True)
    loader = TensorLoader(x, y, batch_size=c.per_rank_batch, sampler=sampler, drop_last=True)
    torch.manual_seed(seed)  # the same initialisation at every N (DDP broadcasts rank 0's)
    net = build_model(c.model).to(device)
    model = DDP(net) if world_size > 1 else net
    global_batch = c.per_rank_batch * world_size
    lr = lr_scaling.scaled_lr(c.base_lr, c.base_batch, global_batch, c.rule)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=c.momentum)
    lr_at = lr_scaling.lr_schedule(c.base_lr, c.base_batch, global_batch, c.rule,
                                   c.warmup_steps)

    def evaluate() -> float:
        """Accuracy on the whole test subset: each rank counts its share, then one sum."""
        model.eval()
        with torch.no_grad():
            counts = torch.tensor([(net(xt).argmax(1) == yt).sum().item(), len(yt)],
                                  dtype=torch.float64, device=device)
        if world_size > 1:
            dist.all_reduce(counts)
        return (counts[0] / counts[1]).item()

    max_steps = max(1, int(c.max_epochs * len(loader)))
    if world_size > 1:
        dist.barrier()  # every rank starts the clock together
    out = lr_scaling.train_to_target(model, opt, _epochs(loader), lr_at, evaluate, c.target,
                                     max(1, c.eval_every // world_size), max_steps)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"rank": rank, "steps": out["steps"], "samples": out["samples"] * world_size,
            "seconds": out["seconds"], "reached": bool(out["reached"]),
            "accuracy": out["accuracy"], "lr": lr, "global_batch": global_batch,
            "epochs": out["samples"] * world_size / len(x),
            "cpu_s": usage.ru_utime + usage.ru_stime}


# ------------------------------------------------------------------------ parent side


def launch(n: int, cfg: TTAConfig, round_no: int, threads: int = 1, snapshot=None,
           hz: int = 100) -> dict:
    """One launch of N fresh ranks, seed = round; a failure is recorded, not raised.
    ``snapshot``: ``run.snapshot``, to record the machine's load around the launch."""
    from benchmarks.analysis import machine_load
    from dpt.errors import one_line
    from dpt.ranks import run_distributed

    row = {"round": round_no, "seed": round_no, "nprocs": n, "status": "ok"}
    before = snapshot() if snapshot else None
    try:
        ranks = run_distributed(tta_rank, world_size=n, args=(asdict(cfg), round_no),
                                timeout=cfg.timeout, threads=threads, echo=False)
    except Exception as exc:  # noqa: BLE001 - a failed or hung launch ends this row only
        return {**row, "status": "failed", "error": one_line(exc)[:300]}
    r0 = ranks[0]
    row.update(global_batch=r0["global_batch"], lr=r0["lr"], reached=r0["reached"],
               steps=r0["steps"], samples=r0["samples"], epochs=r0["epochs"],
               seconds=max(r["seconds"] for r in ranks),  # the slowest rank sets the pace
               final_accuracy=r0["accuracy"])
    if snapshot:
        after = snapshot()
        ours = sum(r["cpu_s"] for r in ranks) + after["self_cpu"] - before["self_cpu"]
        row["load"] = machine_load(before, after, ours, hz=hz)
    return row


def run_rounds(ns: list[int], cfg: TTAConfig, threads: int = 1, budget=None, bar=None,
               say=print, overhead_s: float = 6.0, snapshot=None, hz: int = 100
               ) -> list[dict]:
    """``cfg.rounds`` rounds of launches at each N of ``ns`` (N = 1 and the largest), the
    order flipped every other round. ``budget``: run.TimeBudget (a launch it refuses is not
    run). ``bar``: a tqdm bar, one tick per launch. ``snapshot``, ``hz``: see :func:`launch`."""
    runs = []
    for rnd in range(cfg.rounds):
        for n in (ns[::-1] if rnd % 2 else ns):
            kind, estimate = ("tta", n), estimate_s(cfg, overhead_s)
            if budget is not None and not budget.allows(kind, estimate):
                runs.append({"round": rnd, "seed": rnd, "nprocs": n, "status": "skipped",
                             "error": "the time budget was spent"})
                if bar is not None:
                    bar.update()
                continue
            if bar is not None:
                bar.set_description(f"time to accuracy round {rnd + 1}/{cfg.rounds} N={n}")
            t0 = time.monotonic()
            row = launch(n, cfg, rnd, threads, snapshot, hz)
            if budget is not None:
                budget.spent(kind, estimate, time.monotonic() - t0)
            runs.append(row)
            if row["status"] != "ok":
                say(f"time to accuracy N={n} round {rnd + 1}: {row['status']}: {row['error']}")
            else:
                say(f"time to accuracy N={n} round {rnd + 1}: "
                    f"{'reached' if row['reached'] else 'MISSED'} {row['final_accuracy']:.3f} "
                    f"in {row['steps']} steps, {row['epochs']:.2f} epochs, "
                    f"{row['seconds']:.1f} s")
            if bar is not None:
                bar.update()
    return runs


def estimate_s(cfg: TTAConfig, overhead_s: float = 6.0) -> float:
    """A launch's planned length: its start (data loading included) and about 8 s of
    training on a 2-core CPU (N = 1 reaches the default target in 2-4 s)."""
    return overhead_s + 2.0 + 8.0 * min(1.0, cfg.max_epochs / 3.0)


# ------------------------------------------------------------------------------ analysis


def epochs_verdict(value: float, lo: float | None, hi: float | None, margin: float) -> str:
    """MLPerf-style: ``ok`` when the epochs ratio (N over N = 1) is within 1 + margin,
    ``worse`` when even its interval's low end is beyond it, ``unclear`` otherwise."""
    if not margin >= 0:
        raise ValueError(f"the margin is a fraction, 0 or more; got {margin}")
    bound = 1 + margin
    if value <= bound:
        return "ok"
    if lo is not None and lo > bound:
        return "worse"
    return "unclear"


def tta_summary(runs: list[dict], margin: float, reference: dict | None = None) -> dict:
    """``by_n``, ``speedup``, ``epochs_check`` and ``notes`` from the launches' rows.

    Rows without ``status`` "ok" are failures; ok rows that did not reach the target are
    censored (no time to count): both are left out, each with a note. ``speedup`` and the
    epochs ratio pair N with N = 1 by round, over the rounds where both reached the target.
    Beside the time-to-target speedup, the same runs' **throughput** speedup (samples a
    second, evaluations included, paired by round): time-to-target speedup = throughput
    speedup / epochs ratio, so the two part what N ranks buy from what the larger batch costs.
    ``reference``: {N: {"value", "lo", "hi"}}, ddp_spawn's speedup in the throughput rounds
    (another model and batch), kept beside them as ``ddp_spawn``.
    """
    notes = []
    for r in runs:
        if r.get("status", "ok") != "ok":
            notes.append(f"N={r['nprocs']} round {r['round'] + 1}: {r['status']}: "
                         f"{r.get('error', '')}")
        elif not r["reached"]:
            notes.append(f"N={r['nprocs']} round {r['round'] + 1} missed the target (best "
                         f"{r['final_accuracy']:.3f} after {r['epochs']:.2f} epochs): censored, "
                         "left out")
    for r in runs:
        load = r.get("load") or {}
        fc = load.get("foreign_cores")
        if fc is not None and fc > busy_threshold(load.get("cpus")):
            notes.append(f"N={r['nprocs']} round {r['round'] + 1}: other processes used "
                         f"{fc:.2f} cores during the run ({BUSY})")
    good = [r for r in runs if r.get("status", "ok") == "ok" and r["reached"]]
    by_n = []
    for n in sorted({r["nprocs"] for r in runs}):
        mine = [r for r in good if r["nprocs"] == n]
        tried = [r for r in runs if r["nprocs"] == n and r.get("status", "ok") == "ok"]
        row = {"nprocs": n, "reached": len(mine), "rounds": len(tried)}
        if tried:
            row.update(global_batch=tried[0]["global_batch"], lr=tried[0]["lr"])
        if mine:
            s, s_lo, s_hi = positive_ci([r["seconds"] for r in mine])
            e, e_lo, e_hi = mean_ci([r["epochs"] for r in mine])
            row.update(seconds=s, seconds_lo=s_lo, seconds_hi=s_hi, epochs=e, epochs_lo=e_lo,
                       epochs_hi=e_hi)
        by_n.append(row)
    one = {r["round"]: r for r in good if r["nprocs"] == 1}
    speedup, check = [], None
    for n in sorted({r["nprocs"] for r in good if r["nprocs"] > 1}):
        pairs = [(one[r["round"]], r) for r in good if r["nprocs"] == n and r["round"] in one]
        if not pairs:
            notes.append(f"N={n}: no round where N=1 and N={n} both reached the target: "
                         "no speedup")
            continue
        t = ratio_ci([a["seconds"] for a, _ in pairs], [b["seconds"] for _, b in pairs])
        thr = ratio_ci([b["samples"] / b["seconds"] for _, b in pairs],
                       [a["samples"] / a["seconds"] for a, _ in pairs])
        row = {"nprocs": n, "value": t["value"], "lo": t["lo"], "hi": t["hi"],
               "rounds": t["n"],
               "throughput": {"value": thr["value"], "lo": thr["lo"], "hi": thr["hi"]}}
        if reference and reference.get(n):
            row["ddp_spawn"] = dict(reference[n])
        speedup.append(row)
        e = ratio_ci([b["epochs"] for _, b in pairs], [a["epochs"] for a, _ in pairs])
        check = {"nprocs": n, "ratio": e["value"], "lo": e["lo"], "hi": e["hi"],
                 "margin": margin, "rounds": e["n"],
                 "verdict": epochs_verdict(e["value"], e["lo"], e["hi"], margin)}
    return {"by_n": by_n, "speedup": speedup, "epochs_check": check, "notes": notes}


def epochs_check_line(check: dict | None) -> str:
    """The epochs check in a sentence, for "Can these numbers be trusted?"."""
    if not check:
        return ("Time to accuracy: no epochs check (no round where N = 1 and N > 1 both "
                "reached the target).")
    bound = 1 + check["margin"]
    ratio = fmt_ci(check["ratio"], check["lo"], check["hi"])
    what = {"ok": f"within the {bound:.2f}x allowed: the larger batch costs no more than the "
                  "margin in samples, so its time-to-target speedup stands",
            "worse": f"beyond the {bound:.2f}x allowed, interval included: the larger batch "
                     "needs more samples, so its throughput speedup overstates the gain",
            "unclear": f"above the {bound:.2f}x allowed, but its interval reaches below: "
                       "more rounds would tell"}[check["verdict"]]
    return (f"Time to accuracy, MLPerf-style epochs check: N={check['nprocs']} needed "
            f"{ratio}x the epochs of N=1 ({check['rounds']} round(s)): "
            f"**{check['verdict']}**, {what}.")


def tta_markdown(block: dict) -> list[str]:
    """summary.md's time-to-accuracy table (lines), from results.json's block."""
    c = block["config"]
    lines = ["", f"Time to accuracy ({c['dataset']}, {c['model'].upper()}, "
                 f"{100 * c['target']:g}% accuracy on {c['test_subset']:,} test images; "
                 f"{c['per_rank_batch']} per rank, lr x N ({c['rule']} rule from "
                 f"{c['base_lr']:g} at {c['base_batch']}), {c['warmup_steps']} warmup steps; "
                 f"evaluated every {c['eval_every'] * c['per_rank_batch']:,} samples; 95% intervals over the rounds "
                 "that reached the target):", "",
             "| N | global batch | lr | reached | epochs to target | seconds to target | "
             "time-to-target speedup | throughput speedup |",
             "|---|---|---|---|---|---|---|---|"]
    speed = {s["nprocs"]: s for s in block.get("speedup", [])}
    thr = {s["nprocs"]: s["throughput"] for s in block.get("speedup", [])}
    for r in block["by_n"]:
        n, s, t = r["nprocs"], speed.get(r["nprocs"]), thr.get(r["nprocs"])
        lines.append(
            f"| {n} | {r.get('global_batch', '')} | "
            f"{'' if r.get('lr') is None else format(r['lr'], '.3g')} | "
            f"{r['reached']}/{r['rounds']} | "
            f"{fmt_ci(r.get('epochs'), r.get('epochs_lo'), r.get('epochs_hi'))} | "
            f"{fmt_ci(r.get('seconds'), r.get('seconds_lo'), r.get('seconds_hi'), '.1f')} | "
            + ("1" if n == 1 else fmt_ci(s["value"], s["lo"], s["hi"]) if s else "") + " | "
            + ("1" if n == 1 else fmt_ci(t["value"], t["lo"], t["hi"]) if t else "") + " |")
    lines += ["", "Throughput speedup here: the same runs' samples a second (evaluations included), "
              "so time-to-target speedup = throughput speedup / (epochs at N over epochs at "
              "N=1)."]
    ref = block.get("ddp_spawn_speedup") or []
    if ref:
        lines[-1] += (" `ddp_spawn` in the throughput rounds (the benchmark's model and batch): "
                      + ", ".join(f"{fmt_ci(t['value'], t['lo'], t['hi'])} at N={t['nprocs']}"
                                  for t in ref) + ".")
    lines += [f"- {note}" for note in block.get("notes", [])]
    return lines


def plot(block: dict, path, label: str = "") -> None:
    """time_to_accuracy.png: seconds to target per N (each run a dot), and the
    time-to-target speedup beside the same runs' throughput speedup."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2))
    by_n = [r for r in block["by_n"] if r.get("seconds") is not None]
    xs = list(range(len(by_n)))
    for x, r in zip(xs, by_n):
        lo, hi = r.get("seconds_lo"), r.get("seconds_hi")
        ax.bar(x, r["seconds"], 0.6, color="tab:blue", alpha=0.8)
        if lo is not None:
            ax.errorbar(x, r["seconds"], yerr=[[r["seconds"] - lo], [hi - r["seconds"]]],
                        color="black", capsize=4)
        runs = [q for q in block["runs"] if q.get("status", "ok") == "ok"
                and q["nprocs"] == r["nprocs"] and q["reached"]]
        ax.scatter([x] * len(runs), [q["seconds"] for q in runs], color="black", s=10,
                   zorder=3)
    ax.set_xticks(xs, [f"N={r['nprocs']}\nbatch {r.get('global_batch', '')}" for r in by_n])
    ax.set_ylabel("seconds to target (geometric mean, 95% CI; dots: runs)")
    ax.set_title(f"{100 * block['config']['target']:g}% test accuracy", fontsize=9)
    speed = block.get("speedup", [])
    thr = {s["nprocs"]: s["throughput"] for s in speed}
    for i, s in enumerate(speed):
        for dx, (v, lo, hi), colour, name in (
                (-0.2, (s["value"], s["lo"], s["hi"]), "tab:green", "time to target"),
                (0.2, tuple(thr.get(s["nprocs"], {}).get(k) for k in ("value", "lo", "hi")),
                 "tab:gray", "throughput (same runs)")):
            if v is None:
                continue
            bx.bar(i + dx, v, 0.4, color=colour, label=name if i == 0 else None)
            if lo is not None and hi is not None:
                bx.errorbar(i + dx, v, yerr=[[v - lo], [hi - v]], color="black", capsize=4)
        bx.hlines(s["nprocs"], i - 0.45, i + 0.45, colors="black", linestyles="--", lw=1.2)
    bx.set_xticks(range(len(speed)), [f"N={s['nprocs']}" for s in speed])
    bx.set_ylabel("speedup over N=1 (dashed: ideal N)")
    if speed:
        bx.legend(fontsize=8)
    check = block.get("epochs_check")
    bx.set_title("epochs check: " + (f"{check['ratio']:.2f}x the epochs of N=1, "
                                     f"{check['verdict']}" if check else "none"), fontsize=9)
    fig.suptitle(f"Time to accuracy: {label}" if label else "Time to accuracy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def block_of(cfg: TTAConfig, runs: list[dict], records: list[dict]) -> dict:
    """results.json's ``time_to_accuracy``: the configuration, the runs, their summary, and
    ddp_spawn's speedup at the same N in the throughput rounds (the records after
    ``add_speedups``)."""
    ref = {r["nprocs"]: {"value": r["speedup"], "lo": r.get("speedup_lo"),
                         "hi": r.get("speedup_hi")}
           for r in records if r["method"] == "ddp_spawn" and r.get("sweep") is None
           and r["nprocs"] > 1 and r.get("speedup") is not None}
    summary = tta_summary(runs, cfg.margin, ref)
    conf = {k: v for k, v in asdict(cfg).items() if k != "timeout"}
    return {"config": conf, "runs": runs, "by_n": summary["by_n"],
            "speedup": summary["speedup"],
            "throughput_speedup": [{"nprocs": s["nprocs"], **s["throughput"],
                                    "rounds": s["rounds"]} for s in summary["speedup"]],
            "ddp_spawn_speedup": [{"nprocs": n, **v} for n, v in sorted(ref.items())],
            "epochs_check": summary["epochs_check"], "notes": summary["notes"]}

