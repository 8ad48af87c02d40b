# %% [markdown]
# # Lesson 14: reading the benchmark
#
# `make benchmark` runs every method the lessons registered at N = 1, 2, 4, ... ranks, in
# interleaved rounds, and writes `benchmarks/runs/<time>/results.json` (a folder git ignores;
# `benchmarks/runs/latest` points at the last one). This notebook reads your latest run, or,
# until you have one, the committed reference results in `benchmarks/reference/` (a 2-core CPU
# with gloo, one thread per rank), and answers the source tutorials' question:
# **how much faster is N devices, and why not N times?**

# %%
import json
from pathlib import Path

from dpt.notebook import use_lesson

use_lesson("14_benchmarks")
from dpt.data import REPO_ROOT

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from benchmarks.analysis import BUSY, fmt_ci, fmt_ms
from benchmarks.costmodel import PRESETS
from benchmarks.run import (
    cost_model_text,
    latest_results,
    make_plots,
    predicted_speedups,
    summary_markdown,
)

results, source = latest_results()
result = json.loads(results.read_text())
root = Path(REPO_ROOT).resolve()
print(f"showing {source}:", results.relative_to(root) if results.is_relative_to(root) else results)
print("machine:", result["machine"]["label"], "|", result["machine"]["cpu"])
print("measured:", result["stamp"], "| scaling:", result["config"]["scaling"],
      "| rounds:", result["config"].get("rounds", 1))
# The largest N this run reached: 2 on a 2-core CPU, 8 on an 8-GPU box, 1 on one GPU
n_max = max(result["config"].get("nprocs") or [r["nprocs"] for r in result["records"]])
print("largest N:", n_max)

# %% [markdown]
# ## The table, and whether to believe it
#
# Throughput is samples per second over all ranks. Speedup divides it by the same method's
# throughput at N = 1; efficiency divides the speedup by N. Each method runs in several
# *rounds*, N = 1 and N = k back to back in each, so a speedup is a ratio taken within a round,
# and the rounds give its 95% interval (in brackets). Two methods whose intervals overlap have
# not been told apart. That interval covers this run only: the next run lands its ranks on
# other memory and other moments of a shared host. To check a figure against a target, run
# the benchmark a few times and pool them: `python -m benchmarks.compare --pool RUN RUN ...`
# takes every round of every run together (each ratio still paired within its round).
#
# The run also times a **control**, `independent`: N ranks that never communicate. On an idle
# machine it reaches close to N times its N = 1 throughput. When it falls short, or a speedup
# comes out above N by more than its interval, or other processes used the CPU during a
# method's runs, the result is marked *unreliable: machine busy*: a number measured while
# something else was running is not one to teach.

# %%
display(Markdown(summary_markdown(result)))

# %% [markdown]
# A faster step is not a faster training. A run that includes lesson 11's **time to accuracy**
# also trains to a target test accuracy at N = 1 and at the largest N, with the learning rate
# scaled linearly. The summary above then has a table with both speedups: one for time to the
# target, one for throughput. The time-to-target speedup is the throughput speedup divided by
# the ratio of epochs the larger global batch needed. The MLPerf-style check reads that ratio
# against a margin.

# %%
tta = result.get("time_to_accuracy")
if tta:
    for row in tta["speedup"]:
        thr = row["throughput"]
        print(f"N={row['nprocs']}: time-to-target speedup "
              f"{fmt_ci(row['value'], row['lo'], row['hi'])}, throughput speedup "
              f"{fmt_ci(thr['value'], thr['lo'], thr['hi'])}")
else:
    print(f"{source}: no time-to-accuracy block (a run from before lesson 11, or --no-tta)")

# %% [markdown]
# ## Speedup and efficiency
#
# One bar per method (its own colour and marker in every plot), the 95% interval as an error
# bar and the ideal (N x, or an efficiency of 1) as a dashed line over each bar. Hatched bars
# are the ones marked unreliable. Then where a step's time goes (the step under `no_sync`
# against the full step), throughput and memory, the cost model's projection, and the per-rank
# batch sweep. On a machine with more than 2 devices a last plot draws speedup over N.

# %%
import tempfile

with tempfile.TemporaryDirectory() as tmp:
    for png in make_plots(result, Path(tmp)):
        img = plt.imread(png)
        plt.figure(figsize=(9, 5.5))
        plt.imshow(img)
        plt.axis("off")
        plt.show()

# %% [markdown]
# ## Why not N x on N devices?
#
# A data-parallel step is the compute of one rank's batch, then an all-reduce of the gradients.
# The ring all-reduce sends each byte 2(N-1)/N times, so its time is about
# `t = alpha + 2(N-1)/N * bytes / bandwidth`. With compute `c` per step at N = 1, the
# weak-scaling speedup (each rank keeps its batch) is `N * c / (c + t)`; the strong-scaling one
# (the global batch split N ways, each rank computing about `c / N`) is `c / (c / N + t)`.
# Where the measured speedup falls below even that, the rest is lost to things the model
# leaves out: cores shared between ranks and gloo's own threads, memory bandwidth, and ranks
# waiting for the slowest one at every synchronization point.
#
# With a single device there is no all-reduce to time: the model then *projects* onto a named
# interconnect (`--interconnect`), and says so.

# %%
cm = result.get("cost_model")
recs = {(r["method"], r["nprocs"]): r for r in result["records"]
        if r["status"] == "ok" and r.get("sweep") is None}
n_model = max(2, n_max)  # the N to predict at: this run's, or 2 when it had one device
if cm:
    cm = {"scaling": result["config"]["scaling"], **cm}
    print(cost_model_text(cm))
    ring = 2 * (n_model - 1) / n_model * cm["grad_bytes"] / cm["bandwidth_Bps"]
    print(f"predicted all-reduce at N={n_model}: {fmt_ms(cm['alpha_s'] + ring)} ms; "
          f"predicted speedup {predicted_speedups(cm, [n_model])[0]:.2f}")
for name in ("independent", "ddp_spawn", "ddp_no_buffer_broadcast", "ddp_bucketed", "ddp_naive"):
    r = recs.get((name, n_max))
    if n_max > 1 and r and "speedup" in r:
        extra = (f", communication + waiting {fmt_ms(r['comm_s'])} ms/step" if "comm_s" in r
                 else "")
        busy = f"  [{BUSY}]" if r.get("reliability") == BUSY else ""
        print(f"measured {name:<24} speedup at N={n_max}: "
              f"{fmt_ci(r['speedup'], r.get('speedup_lo'), r.get('speedup_hi'))}{extra}{busy}")

# %% [markdown]
# `independent` runs N ranks that never talk: it is the ceiling this hardware allows. The gap
# between it and ideal is the machine (two ranks on two cores share caches and memory bandwidth,
# and anything else running on the box). The gap between `independent` and DDP is the price of
# communication *and synchronization*: every all-reduce (and, with batch norm, the buffer
# broadcast at every forward) makes the faster rank wait for the slower one.
#
# ## Projecting onto your cluster
#
# Change the bandwidth to your interconnect's. A tiny ConvNet has little compute per byte of
# gradient, so it scales worst; a large model on NVLink scales close to ideal.

# %%
if cm:
    ns = [1, 2, 4, 8, 16, 32, 64]
    plt.figure(figsize=(6, 4))
    plt.plot(ns, ns, "k:", label="ideal")
    for link in PRESETS.values():
        plt.plot(ns, predicted_speedups(cm, ns, bandwidth_Bps=link.bandwidth_GBps * 1e9,
                                        alpha_s=link.latency_us * 1e-6), "--",
                 label=f"{link.label} ({link.bandwidth_GBps:g} GB/s)")
    mine = "this machine (fitted)" if cm.get("source") != "projection" else "projected"
    plt.plot(ns, predicted_speedups(cm, ns), "o-", label=mine)
    plt.xscale("log", base=2)
    plt.yscale("log", base=2)
    plt.xlabel("N")
    plt.ylabel("predicted speedup")
    plt.legend(fontsize=7)
    plt.title(f"Cost model, {cm['scaling']} scaling")
    plt.show()
