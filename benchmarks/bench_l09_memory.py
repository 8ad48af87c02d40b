"""Lesson 09: a rank's memory during one step, predicted and measured; activation checkpointing.

Two studies, each configuration in fresh processes (gloo, 1 thread per rank):

1. **The memory table**: DDP, ZeRO-1 and ZeRO-2 (lesson 08's optimizer), the FSDP by hand and
   FSDP2 (``fully_shard``) at N = 2 and N = 4, on the lesson's TinyTransformer (4 blocks of
   width 64, 237 k parameters), Adam fp32, ``--batch`` sequences of 64 tokens per rank. Per rank:
   the parameters, gradients and optimizer state kept after a step, the activations, and the
   **peak of one step**, each beside ``memory_table.predict_peak``. Measured with
   ``dpt.memory.MemoryTracker``, which counts the bytes of live tensors exactly (gloo's own
   buffers and the allocator's slack are not in them): the counts repeat from run to run,
   except where an asynchronous collective frees its buffers a little earlier or later (FSDP2
   at N = 4: one launch in several read about 3% higher on one rank). ``--memory-repeats``
   launches per configuration, the median per rank.
2. **Activation checkpointing** where activations dominate (8 blocks, ``--ac-batch`` x 256
   tokens per rank, DDP on 2 ranks): each rank's peak of a forward + backward with and
   without checkpointing, beside ``activation_checkpointing.model_activation_bytes``, and the
   step time: ``--repeats`` launches, the median of each launch's timed steps, then the median
   and range over launches (the slower rank of each launch).

    python benchmarks/bench_l09_memory.py                 # about 1.5 min on 2 cores
    python benchmarks/bench_l09_memory.py --repeats 9 --batch 2

Writes benchmarks/runs/lessons/l09_memory.json and .png (git-ignored; the committed results
are in benchmarks/reference/lessons/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from dpt.lessons import load

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "runs" / "lessons"  # git-ignored; committed: reference/lessons
MiB = 2**20
KINDS = ("params", "grads", "optimizer", "activations", "peak")


def memory_rows(methods, world_sizes, batch: int, repeats: int) -> list[dict]:
    mt = load("09_fsdp", "memory_table", "solutions")

    from dpt.ranks import run_distributed

    launches = {}
    for _ in range(repeats):
        for n in world_sizes:
            for method in methods:
                t0 = time.perf_counter()
                launches.setdefault((method, n), []).append(run_distributed(
                    mt.measure_worker, world_size=n, backend="gloo", threads=1, timeout=300,
                    echo=False, kwargs={"method": method, "batch": batch}))
                print(f"  measured {method} at N={n} ({time.perf_counter() - t0:.1f} s)",
                      flush=True)
    # Per rank, the median over launches: the counts repeat exactly, except where an
    # asynchronous collective frees its buffers a little earlier or later.
    measured = {key: [{**runs[0][i], **{k: statistics.median(launch[i][k] for launch in runs)
                                         for k in KINDS}}
                      for i in range(len(runs[0]))]
                for key, runs in launches.items()}
    rows = mt.table_rows(measured, batch)
    for row in rows:
        runs = launches[(row["method"], row["world_size"])]
        row["label"] = mt.LABELS[row["method"]]
        row["per_rank"] = [{**{k: r[k] for k in KINDS},
                            "peak_per_launch": [launch[i]["peak"] for launch in runs]}
                           for i, r in enumerate(measured[(row["method"], row["world_size"])])]
    return rows


def checkpointing_runs(repeats: int, batch: int, seq_len: int, layers: int, steps: int,
                       nproc: int) -> dict:
    ac = load("09_fsdp", "activation_checkpointing", "solutions")

    from dpt.ranks import run_distributed

    config = {"batch": batch, "seq_len": seq_len, "layers": layers, "steps": steps}
    launches = []
    for i in range(repeats):
        t0 = time.perf_counter()
        launches.append(run_distributed(ac.compare_worker, world_size=nproc, backend="gloo",
                                        threads=1, timeout=600, echo=False, kwargs=config))
        print(f"  checkpointing launch {i + 1}/{repeats} ({time.perf_counter() - t0:.1f} s)",
              flush=True)
    out = {**config, "nproc": nproc, "dim": 64, "heads": 4, "vocab": 256, "repeats": repeats}
    for key in ("plain", "checkpointed"):
        # the slower rank sets the pace of a step
        per_launch = [max(r[key]["step_s"] for r in ranks) for ranks in launches]
        out[key] = {
            "predicted_activations": ac.model_activation_bytes(
                batch, seq_len, layers=layers, checkpointed=key == "checkpointed"),
            "after_forward": [r[key]["after_forward"] for r in launches[0]],
            "peak": [r[key]["peak"] for r in launches[0]],
            "peaks_identical_over_launches": all(
                [r[key]["peak"] for r in ranks] == [r[key]["peak"] for r in launches[0]]
                for ranks in launches),
            "step_s_median": statistics.median(per_launch),
            "step_s_min": min(per_launch), "step_s_max": max(per_launch),
            "step_s_per_launch": per_launch}
    # paired within each launch: the two models ran back to back on the same machine state
    ratios = [c / p for c, p in zip(out["checkpointed"]["step_s_per_launch"],
                                    out["plain"]["step_s_per_launch"])]
    out["time_ratio"] = {"median": statistics.median(ratios), "min": min(ratios),
                         "max": max(ratios), "per_launch": ratios}
    return out


def markdown_table(rows: list[dict]) -> str:
    """The README's table: MiB per rank (the fullest rank), predicted / measured."""
    lines = ["| method | N | parameters | gradients | optimizer state | activations | "
             "buffers (predicted) | peak of a step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        cell = [f"{p[k] / MiB:.2f} / {m[k] / MiB:.2f}" for k in
                ("params", "grads", "optimizer", "activations")]
        lines.append(f"| {r['label']} | {r['world_size']} | " + " | ".join(cell)
                     + f" | {p['buffers'] / MiB:.2f} | **{p['peak'] / MiB:.2f} / "
                     f"{m['peak'] / MiB:.2f}** |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, ac = result["table"], result["checkpointing"]
    sizes = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes) + 1, figsize=(5.2 * (len(sizes) + 1), 4.8),
                             gridspec_kw={"width_ratios": [3] * len(sizes) + [2]})
    parts = (("params", "parameters", "C0"), ("optimizer", "optimizer state", "C1"),
             ("step", "the step: buffers + activations or gradients", "C3"))
    for ax, n in zip(axes, sizes):
        these = [r for r in rows if r["world_size"] == n]
        for i, r in enumerate(these):
            pred = dict(r["predicted"])
            pred["step"] = pred["peak"] - pred["params"] - pred["optimizer"]
            bottom = 0.0
            for key, label, color in parts:  # the predicted peak, stacked
                h = pred[key] / MiB
                ax.bar(i - 0.2, h, 0.38, bottom=bottom, color=color, alpha=0.55,
                       label=f"predicted: {label}" if i == 0 else None)
                bottom += h
            ax.bar(i + 0.2, r["measured"]["peak"] / MiB, 0.38, color="0.25",
                   label="measured peak" if i == 0 else None)
            resting = sum(r["measured"][k] for k in ("params", "grads", "optimizer")) / MiB
            ax.plot(i + 0.2, resting, "wo", mec="k",
                    label="measured: kept after the step" if i == 0 else None)
        ax.set_xticks(range(len(these)), [r["label"].split(" (")[0] for r in these],
                      rotation=20)
        top = max(max(r["predicted"]["peak"], r["measured"]["peak"]) for r in these) / MiB
        ax.set_ylim(0, top * 1.45)  # room for the legend
        ax.set(ylabel="MiB per rank (the fullest rank)",
               title=f"N = {n}: peak of one step, predicted (stacked) vs measured")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
    bx = axes[-1]
    keys = ("plain", "checkpointed")
    pred = [ac[k]["predicted_activations"] / MiB for k in keys]
    meas = [max(ac[k]["peak"]) / MiB for k in keys]
    bx.bar([0, 1], pred, 0.38, color="C3", alpha=0.55, label="predicted activations")
    bx.bar([0.4, 1.4], meas, 0.38, color="0.25", label="measured peak (fwd + bwd)")
    bx.set_xticks([0.2, 1.2], ["without", "with checkpointing"])
    bx.set_ylim(0, max(pred + meas) * 1.45)
    bx.set(ylabel="MiB per rank",
           title=f"activation checkpointing, {ac['layers']} blocks, {ac['batch']} x "
                 f"{ac['seq_len']} tokens per rank, N = {ac['nproc']}")
    bx.title.set_fontsize(9)
    tx = bx.twinx()
    med = [ac[k]["step_s_median"] * 1e3 for k in keys]
    err = [[m - ac[k]["step_s_min"] * 1e3 for m, k in zip(med, keys)],
           [ac[k]["step_s_max"] * 1e3 - m for m, k in zip(med, keys)]]
    tx.errorbar([0.2, 1.2], med, yerr=err, fmt="D", color="C4", capsize=4,
                label="step time (median, range)")
    tx.set_ylabel("ms per forward + backward")
    tx.set_ylim(0, max(med) * 1.6)
    h1, l1 = bx.get_legend_handles_labels()
    h2, l2 = tx.get_legend_handles_labels()
    bx.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="lesson 09: peak memory per rank, predicted and "
                                             "measured; activation checkpointing")
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank, memory table")
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--ac-batch", type=int, default=8, help="sequences per rank, checkpointing")
    ap.add_argument("--ac-layers", type=int, default=8)
    ap.add_argument("--ac-seq-len", type=int, default=256)
    ap.add_argument("--ac-nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per launch")
    ap.add_argument("--repeats", type=int, default=5, help="launches of the checkpointing study")
    ap.add_argument("--memory-repeats", type=int, default=3,
                    help="launches of each memory-table configuration (median per rank)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    mt = load("09_fsdp", "memory_table", "solutions")

    methods = args.methods or list(mt.METHODS)
    if (args.batch < 1 or args.ac_batch < 1 or args.repeats < 1 or args.steps < 1
            or args.memory_repeats < 1
            or min(args.nproc) < 1 or set(methods) - set(mt.METHODS)):
        ap.error(f"counts must be at least 1; methods among {', '.join(mt.METHODS)}")
    t0, load_before = time.perf_counter(), os.getloadavg()
    print("the memory table", flush=True)
    rows = memory_rows(methods, args.nproc, args.batch, args.memory_repeats)
    print("activation checkpointing", flush=True)
    ac = checkpointing_runs(args.repeats, args.ac_batch, args.ac_seq_len, args.ac_layers,
                            args.steps, args.ac_nproc)
    import torch

    result = {
        "model": f"TinyTransformer {mt.CONFIG}", "optimizer": "Adam fp32",
        "batch_per_rank": args.batch, "backend": "gloo (CPU)", "threads_per_rank": 1,
        "torch": torch.__version__,
        "how": "bytes of live tensors counted by dpt.memory.MemoryTracker (exact, "
               "deterministic); 'measured' is the fullest rank; predictions from "
               "memory_table.predict_peak with activation_checkpointing.model_activation_bytes",
        "prediction_leaves_out": "the gradients of the logits and log-probabilities at the "
        "start of backward, backward's and Adam's temporaries, shard padding, ZeRO's "
        "whole-tensor imbalance, buffers kept past their use (lesson 08's loop; the FSDP by "
        "hand keeps each unit's sent gradient until finish_grad_sync)",
        "measurement_leaves_out": "memory no tensor owns: gloo's staging buffers, the "
        "allocator's rounding and cache, the interpreter",
        "load_average_before_after": [load_before, os.getloadavg()],
        "table": rows, "checkpointing": ac, "seconds": time.perf_counter() - t0}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "l09_memory.json").write_text(json.dumps(result, indent=2))
    plot(result, OUT / "l09_memory.png")
    print(f"\nMiB per rank (the fullest rank), predicted / measured; {args.batch} sequence(s) "
          "of 64 tokens per rank\n")
    print(markdown_table(rows))
    print(f"\nactivation checkpointing ({ac['layers']} blocks, {ac['batch']} x {ac['seq_len']} "
          f"tokens per rank, DDP on {ac['nproc']} ranks, {ac['repeats']} launches):")
    for key in ("plain", "checkpointed"):
        a = ac[key]
        print(f"  {key:>12}: activations predicted {a['predicted_activations'] / MiB:6.1f} MiB, "
              f"peak measured {max(a['peak']) / MiB:6.1f} MiB per rank; step "
              f"{a['step_s_median'] * 1e3:.0f} ms [{a['step_s_min'] * 1e3:.0f}, "
              f"{a['step_s_max'] * 1e3:.0f}]")
    tr = ac["time_ratio"]
    print(f"  checkpointed / plain step time, paired per launch: {tr['median']:.2f} "
          f"[{tr['min']:.2f}, {tr['max']:.2f}]")
    print(f"load average (1, 5, 15 min) before {load_before}, after {os.getloadavg()}: step "
          "times are only as good as the machine was idle")
    print(f"wrote {OUT / 'l09_memory'}.json and .png ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
