"""Draw one training step of lesson 05's DDPs as a timeline: backward on a compute lane, the
all-reduces on a communication lane, and the optimizer step, for ``NaiveDDP`` (every
gradient all-reduced after backward) against ``BucketedDDP`` (a bucket's all-reduce launched
the moment its last gradient is in, while backward goes on).

The events are measured, not made up: ``scratch_demo.timeline_rank`` records them on each
rank (hooks on the gradients, a wrapped ``dist.all_reduce``). The committed figure is drawn
from the committed measurement, ``backward_timeline.json``::

    .venv/bin/python solutions/05_ddp_from_scratch/figures/backward_timeline.py  # measure again
    .venv/bin/python tools/draw_figures.py   # redraw backward_timeline.svg from the JSON

The lesson's notebook measures your own wrappers with :func:`measure` and draws them with
:func:`draw`.
"""

from __future__ import annotations

import importlib.util
import sys

if importlib.util.find_spec("torch") is None:  # not the course's venv: say so in one line
    sys.exit(f"error: {sys.executable} has no torch; use the course's venv: .venv/bin/python "
             f"{sys.argv[0]} (or `source .venv/bin/activate` first; `make setup` creates it)")

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
MEASURED = HERE / "backward_timeline.json"
BUCKET_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
PLAIN = "#9db4d6"  # backward of a layer when there are no buckets (naive)
COMM = "#e5ae38"


def measure(batch: int = 64, bucket_cap_mb: float = 9.0, steps: int = 3,
            timeout: float = 300) -> dict:
    """Run ``scratch_demo.timeline_rank`` on 2 CPU ranks (gloo) and return what each saw."""
    lesson = str(HERE.parent)
    if lesson not in sys.path:  # rank processes import scratch_demo by name
        sys.path.insert(0, lesson)
    import scratch_demo

    from dpt.testing import run_distributed

    ranks = run_distributed(scratch_demo.timeline_rank, world_size=2, backend="gloo",
                            kwargs={"batch": batch, "bucket_cap_mb": bucket_cap_mb,
                                    "steps": steps}, timeout=timeout, echo=False)
    return {"config": ranks[0]["config"], "ranks": ranks}


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
    (bucketed) or one row for all the per-gradient all-reduces (naive)."""
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
        for e in events:
            _box(ax, e["launch"], e["done"], ys[0], 0.34, COMM)
        if events:
            ax.text(events[0]["launch"], ys[0] - 0.3, f"{len(events)} all-reduces, one per "
                    "gradient, one after another, once backward is over", ha="left",
                    va="center", fontsize=7)
    if events:
        last = max(e["done"] for e in events)
        ax.axvline(last, color="#c44e52", lw=0.8, ls="--")
    ax.text(step[1], 1.48, f"done at {step[1]:.0f} ms", ha="right", va="center", fontsize=8,
            weight="bold")
    ax.set_yticks([1, sum(ys) / len(ys)], ["compute", "all-reduces"], fontsize=8)
    ax.set_ylim(ys[-1] - (0.55 if "buckets" not in run else 0.3), 1.65)
    ax.set_title(name, fontsize=9, loc="left")


def draw(measured: dict | None = None, rank: int = 0):
    """The timeline of one step, naive above bucketed, on one time axis (rank ``rank``'s)."""
    import matplotlib.pyplot as plt

    if measured is None:
        measured = json.loads(MEASURED.read_text())
    cfg, runs = measured["config"], measured["ranks"][rank]["runs"]
    titles = {"naive": "NaiveDDP: backward, then every gradient's all-reduce, then the step",
              "bucketed": f"BucketedDDP ({cfg['bucket_cap_mb']:g} MB buckets): a bucket's "
                          "all-reduce is launched (arrow) when its last gradient is in, while "
                          "backward goes on"}
    end = max(r["step"][1] for r in runs.values())
    heights = [2.4 if "buckets" not in r else 1.6 + 0.42 * len(r["allreduce"])
               for r in runs.values()]
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 0.75 * sum(heights) + 1.4),
                             sharex=True, gridspec_kw={"height_ratios": heights})
    axes = list(axes) if len(runs) > 1 else [axes]
    for ax, (name, run) in zip(axes, runs.items()):
        _lane(ax, run, titles.get(name, name), end)
    axes[-1].set_xlim(0, end * 1.03)
    axes[-1].set_xlabel(f"ms since loss.backward() was called (rank {rank}'s clock)")
    fig.suptitle(
        f"One training step, measured (not a schematic): rank {rank} of {cfg['world_size']}, "
        f"{cfg['backend']}, {cfg['threads_per_rank']} thread per rank, batch {cfg['batch']} "
        f"per rank;\nan MLP of {cfg['depth']} x Linear({cfg['width']}, {cfg['width']}) + out, "
        f"{cfg['grad_mb']:g} MB of gradients. Backward computes the layers last to first; "
        "hatched: waiting in finish_gradient_synchronization();\ndashed red: the last "
        "all-reduce is done, and the optimizer step can start", fontsize=8.5)
    fig.tight_layout()
    return fig


FIGURES = {"backward_timeline.svg": draw}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="measure one step of NaiveDDP and BucketedDDP "
                                                 "on 2 CPU ranks; write backward_timeline.json")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bucket-cap-mb", type=float, default=9.0)
    parser.add_argument("--steps", type=int, default=3, help="recorded steps; the median is kept")
    parser.add_argument("--out", type=Path, default=MEASURED)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.bucket_cap_mb <= 0:
        print("error: --batch, --steps and --bucket-cap-mb must be positive", file=sys.stderr)
        return 2
    measured = measure(args.batch, args.bucket_cap_mb, args.steps)
    args.out.write_text(json.dumps(measured, indent=1) + "\n")
    for name, run in measured["ranks"][0]["runs"].items():
        print(f"{name:9s} backward {run['backward'][1]:6.1f} ms, waited after it "
              f"{run['sync'][1] - run['sync'][0]:6.1f} ms, step done at {run['step'][1]:6.1f} ms")
    print(f"wrote {args.out}; `python tools/draw_figures.py` redraws the SVG from it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
