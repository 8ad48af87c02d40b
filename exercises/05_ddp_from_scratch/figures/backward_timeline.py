"""Draw one training step of lesson 05's DDPs as a timeline: backward on a compute lane, the
all-reduces on a communication lane, and the optimizer step, for ``NaiveDDP`` (every
gradient all-reduced after backward), ``OverlapDDP`` (each gradient's all-reduce launched the
moment it is ready) and ``BucketedDDP`` (a bucket's all-reduce launched the moment its last
gradient is in, while backward goes on). A wrapper that was not measured is left out.

The events are measured, not made up: ``scratch_demo.timeline_rank`` records them on each
rank (hooks on the gradients, a wrapped ``dist.all_reduce``). The committed figure is drawn
from the committed measurement, ``backward_timeline.json``::

    .venv/bin/python exercises/05_ddp_from_scratch/figures/backward_timeline.py  # measure again
    .venv/bin/python tools/draw_figures.py   # redraw backward_timeline.svg from the JSON

The lesson's notebook measures your own wrappers with :func:`measure`, draws them with
:func:`draw`, and prints :func:`contradictions`: a step drawn is the one of median length
among several, yet a busy machine can still reverse an order the lesson explains.
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MEASURED = HERE / "backward_timeline.json"
BUCKET_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
PLAIN = "#9db4d6"  # backward of a layer when there are no buckets (naive)
COMM = "#e5ae38"


def measure(batch: int = 64, bucket_cap_mb: float = 9.0, steps: int = 7,
            timeout: float = 300) -> dict:
    """Run ``scratch_demo.timeline_rank`` on 2 CPU ranks (gloo) and return what each saw:
    ``steps`` recorded steps per wrapper, taken in turns, the one of median length kept."""
    from dpt.lessons import load
    from dpt.ranks import run_distributed

    scratch_demo = load("05_ddp_from_scratch", "scratch_demo", __file__)  # this lesson's

    ranks = run_distributed(scratch_demo.timeline_rank, world_size=2, backend="gloo",
                            kwargs={"batch": batch, "bucket_cap_mb": bucket_cap_mb,
                                    "steps": steps}, timeout=timeout, echo=False)
    return {"config": ranks[0]["config"], "ranks": ranks}


def measured_runs(measured: dict, rank: int = 0) -> dict:
    """The wrappers measured on ``rank``, in order: name -> its step (a wrapper that reached a
    task not done yet holds that task's message instead, and is left out)."""
    return {name: run for name, run in measured["ranks"][rank]["runs"].items()
            if isinstance(run, dict)}


def how_many(cfg: dict) -> str:
    """Which step is drawn, in words: "the median-length step of 7, the wrappers in turns"."""
    turns = ", the wrappers taking turns" if cfg.get("interleaved") else ""
    return f"the median-length step of {cfg['steps']} per wrapper{turns}"


# What the lesson says about the order, as (faster, slower): a measured step that reverses
# one of them is reported by contradictions().
CLAIMS = (("bucketed", "naive"), ("overlap", "naive"))


def contradictions(measured: dict, rank: int = 0) -> list[str]:
    """One line for each order the lesson explains that this measurement reverses: bucketed
    (or overlapped) DDP done no sooner than naive DDP. Empty when the picture agrees."""
    runs = measured_runs(measured, rank)
    lines = []
    for fast, slow in CLAIMS:
        if fast in runs and slow in runs and runs[fast]["step"][1] >= runs[slow]["step"][1]:
            lines.append(f"on this run {fast} was not faster than {slow} "
                         f"({runs[fast]['step'][1]:.0f} ms against {runs[slow]['step'][1]:.0f} "
                         "ms): a loaded machine? re-run the cell")
    return lines


def _box(ax, start, end, y, height, color, text="", hatch=None, text_color="black",
         size=7, ha="center"):
    ax.broken_barh([(start, max(end - start, 0.05))], (y - height / 2, height),
                   facecolors=color, edgecolors="white" if hatch is None else "#666666",
                   linewidth=0.6, hatch=hatch)
    if text:
        x = (start + end) / 2 if ha == "center" else start + 0.3
        ax.text(x, y, text, ha=ha, va="center", fontsize=size, color=text_color, clip_on=True)


def _lane(ax, run: dict, name: str, end: float) -> None:
    """One variant's step: compute at y=1, and below it one row per bucket's all-reduce
    (bucketed) or one row for all the per-gradient all-reduces (naive, overlap)."""
    # A layer's weight is listed in the last bucket naming the layer (its bias, registered
    # after it, can close the bucket before): colour each layer by its weight's bucket.
    bucket_of = {layer: b for b, layers in enumerate(run.get("buckets", [])) for layer in layers}
    start = run["backward"][0]
    for layer in run["layers"]:
        b = bucket_of.get(layer["name"])
        color = PLAIN if b is None else BUCKET_COLORS[b % len(BUCKET_COLORS)]
        width = layer["ready"] - start
        _box(ax, start, layer["ready"], 1, 0.6, color,
             layer["name"] if width > 0.03 * end else "",
             text_color="black" if b is None else "white")
        start = layer["ready"]
    sync, step = run["sync"], run["step"]
    _box(ax, sync[0], sync[1], 1, 0.6, "white",
         "wait" if sync[1] - sync[0] > 0.05 * end else "", hatch="///")
    _box(ax, step[0], step[1], 1, 0.6, "#333333",
         "step" if step[1] - step[0] > 0.03 * end else "", text_color="white")
    events = run["allreduce"]
    rows = len(events) if "buckets" in run else 1
    ys = [0.3 - 0.42 * i for i in range(rows)]
    if "buckets" in run:
        for b, e in enumerate(events):
            color = BUCKET_COLORS[b % len(BUCKET_COLORS)]
            layers = ", ".join(n for n, k in bucket_of.items() if k == b)
            _box(ax, e["launch"], e["done"], ys[b], 0.34, color,
                 f"bucket {b} ({layers}): {e['bytes'] / 2**20:.1f} MB", text_color="white",
                 ha="left")
            ax.annotate("", xy=(e["launch"], ys[b] + 0.17), xytext=(e["launch"], 0.7),
                        arrowprops={"arrowstyle": "-|>", "color": color, "lw": 1.0,
                                    "shrinkA": 0, "shrinkB": 0}, zorder=0.5)  # under bars
    else:
        overlapped = any(e["async"] for e in events)
        for e in events:
            _box(ax, e["launch"], e["done"], ys[0], 0.34, COMM)
            if overlapped:
                ax.plot([e["launch"]], [ys[0] + 0.2], marker="v", ms=3, color="#8c6d1f")
        if events:
            how = ("each launched (triangle) the moment its gradient is ready; gloo runs them "
                   "one after another" if overlapped else
                   "one after another, once backward is over")
            ax.text(events[0]["launch"], ys[0] - 0.3, f"{len(events)} all-reduces, one per "
                    f"gradient, {how}", ha="left", va="center", fontsize=7)
    if events:
        last = max(e["done"] for e in events)
        ax.axvline(last, color="#c44e52", lw=0.8, ls="--")
    ax.text(step[1], 1.48, f"done at {step[1]:.0f} ms", ha="right", va="center", fontsize=8,
            weight="bold")
    ax.set_yticks([1, sum(ys) / len(ys)], ["compute", "all-reduces"], fontsize=8)
    ax.set_ylim(ys[-1] - (0.55 if "buckets" not in run else 0.3), 1.65)
    ax.set_title(name, fontsize=9, loc="left")


TITLES = {
    "naive": "NaiveDDP: backward, then every gradient's all-reduce, then the step",
    "overlap": "OverlapDDP: each gradient's all-reduce is launched as soon as the gradient is "
               "ready, while backward goes on",
    "bucketed": "BucketedDDP ({cap:g} MB buckets): a bucket's all-reduce is launched (arrow) "
                "when its last gradient is in, while backward goes on",
}


def draw(measured: dict | None = None, rank: int = 0):
    """The timeline of one step per wrapper measured, one above the other, on one time axis
    (rank ``rank``'s)."""
    import matplotlib.pyplot as plt

    if measured is None:
        measured = json.loads(MEASURED.read_text())
    cfg, runs = measured["config"], measured_runs(measured, rank)
    if not runs:  # every wrapper reached a task not done yet: say the first one
        pending = [r for r in measured["ranks"][rank]["runs"].values() if isinstance(r, str)]
        if pending:
            raise NotImplementedError(pending[0])
        raise ValueError("no wrapper was measured: nothing to draw")
    end = max(r["step"][1] for r in runs.values())
    heights = [2.4 if "buckets" not in r else 1.6 + 0.42 * len(r["allreduce"])
               for r in runs.values()]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 0.75 * sum(heights) + 1.6),
                             sharex=True, gridspec_kw={"height_ratios": heights})
    axes = list(axes) if len(runs) > 1 else [axes]
    for ax, (name, run) in zip(axes, runs.items()):
        title = TITLES.get(name, name).format(cap=cfg["bucket_cap_mb"])
        _lane(ax, run, title, end)
    axes[-1].set_xlim(0, end * 1.03)
    axes[-1].set_xlabel(f"ms since loss.backward() was called (rank {rank}'s clock)")
    fig.suptitle(
        f"One training step, measured (not a schematic): {how_many(cfg)}; rank {rank} of "
        f"{cfg['world_size']}, {cfg['backend']}, {cfg['threads_per_rank']} thread per rank, "
        f"batch {cfg['batch']} per rank;\nan MLP of {cfg['depth']} x Linear({cfg['width']}, "
        f"{cfg['width']}) + out, {cfg['grad_mb']:g} MB of gradients. Backward computes the "
        "layers last to first; hatched: waiting in finish_gradient_synchronization();\n"
        "dashed red: the last all-reduce is done, and the optimizer step can start",
        fontsize=8.5)
    fig.tight_layout()
    return fig


FIGURES = {"backward_timeline.svg": draw}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="measure steps of NaiveDDP, OverlapDDP and "
                                                 "BucketedDDP on 2 CPU ranks; write "
                                                 "backward_timeline.json")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bucket-cap-mb", type=float, default=9.0)
    parser.add_argument("--steps", type=int, default=7,
                        help="recorded steps per wrapper; the one of median length is kept")
    parser.add_argument("--out", type=Path, default=MEASURED)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.bucket_cap_mb <= 0:
        print("error: --batch, --steps and --bucket-cap-mb must be positive", file=sys.stderr)
        return 2
    measured = measure(args.batch, args.bucket_cap_mb, args.steps)
    args.out.write_text(json.dumps(measured, indent=1) + "\n")
    for name, run in measured["ranks"][0]["runs"].items():
        if isinstance(run, str):
            print(f"{name:9s} not measured: {run}")
            continue
        print(f"{name:9s} backward {run['backward'][1]:6.1f} ms, waited after it "
              f"{run['sync'][1] - run['sync'][0]:6.1f} ms, step done at {run['step'][1]:6.1f} ms")
    for line in contradictions(measured):
        print(line)
    print(f"wrote {args.out}; `python tools/draw_figures.py` redraws the SVG from it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
