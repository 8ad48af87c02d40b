# %% [markdown]
# # Lesson 13: slow links and lost ranks
#
# Every lesson so far all-reduced every gradient at every step over a network that never
# failed. This notebook drops both assumptions: it synchronises every H steps (LocalSGD,
# DiLoCo), in fragments and in fewer bits, counting every byte; then it keeps a job going when
# a replica dies, and counts the steps lost against a restart from a snapshot (lesson 04).
#
# | task | function | what it does |
# |---|---|---|
# | 13.1 | `local_sgd.average_` | the mean over the ranks, one flat all-reduce |
# | 13.2 | `PeriodicSync._after_step` | sync at every H-th optimizer step |
# | 13.3 | `diloco.pseudo_gradients` | Δ = start of the round − now |
# | 13.4 | `DiLoCo.sync` | the outer step on the averaged Δ |
# | 13.5 | `streaming.strided_fragments` | blocks into F strided fragments |
# | 13.6 | `streaming.fragment_due` | which fragment syncs after a step |
# | 13.7 | `StreamingDiLoCo.sync_fragment` | the outer step of one fragment |
# | 13.8 | `compress.average_cast_` | the average in fp16 or bf16 |
# | 13.9 | `compress.quantize_int8`, `dequantize_int8` | int8 with a scale per block |
# | 13.10 | `compress.average_int8_` | the average of int8 values, gathered |
# | 13.11 | `fault_tolerance.agree_quorum` | the members of an epoch, and a new group |
# | 13.12 | `fault_tolerance.heal` | a joiner gets model, optimizer and step from a peer |
# | 13.13 | `fault_tolerance.ft_step` | a step that commits only if every member's all-reduce did |
# | 13.14 | `fault_tolerance.steps_lost` | replica-steps lost, from the run's log |

# %%
from dpt.notebook import bench_result, needs_tasks, use_lesson

use_lesson("13_local_sgd")

import json

import matplotlib.pyplot as plt

# %% [markdown]
# Each cell below runs inside `with needs_tasks(...)`, which names the tasks it uses. A cell
# that reaches a task you have not done yet prints `skipped: this cell needs Task NN.K` instead
# of a traceback, and the rest of the notebook still runs.
#
# ## LocalSGD: average the weights every H steps (13.1, 13.2)
#
# DDP all-reduces the gradients at every step. LocalSGD lets each rank take H optimizer steps on
# its own data and then averages the *weights*, with one all-reduce of one flat buffer: the bytes
# per step fall by exactly H. At H = 1 with SGD it is DDP (the mean of N SGD steps from the same
# weights is one step with the mean gradient), and it stays DDP with momentum SGD (the buffers
# are linear in the gradients). With AdamW it is not: each rank divides by the root of its own
# second moment. Three ranks below train the course's MLP under torch's DDP and LocalSGD;
# `CommCounter` counts what LocalSGD puts into its all-reduces.

# %%
import local_sgd as ls
from dpt.models import MLP, count_parameters
from dpt.ranks import run_distributed

with needs_tasks("13.1", "13.2"):
    hs = [1, 4, 16]
    res = run_distributed(ls.compare_worker, world_size=3, backend="gloo", echo=False,
                          kwargs={"steps": 32, "per_rank": 8, "lr": 0.05, "hs": hs})[0]
    print(f"H=1, largest weight difference from DDP: SGD {res['sgd']:.1e}, "
          f"AdamW {res['adamw']:.1e}")
    ddp = 32 * count_parameters(MLP()) * 4  # DDP: every step's fp32 gradients
    print(f"{'H':>4}{'syncs':>7}{'payload bytes':>15}{'DDP / this':>12}")
    for h, (nbytes, calls, _wire) in res["bytes"].items():
        print(f"{h:>4}{calls:>7}{nbytes:>15,}{ddp / nbytes:>12.1f}")
    fig, ax = plt.subplots(figsize=(5, 2.8))
    ax.bar([str(h) for h in hs], [res["bytes"][h][0] / 1e6 for h in hs])
    ax.set_xlabel("H, inner steps per sync")
    ax.set_ylabel("MB into all-reduces, 32 steps")
    plt.show()

# %% [markdown]
# ## DiLoCo: an outer optimizer on the averaged drift (13.3, 13.4)
#
# DiLoCo (arXiv 2311.08105) keeps the weights of the round's start (the snapshot), and after H
# inner steps takes Δ = snapshot − weights as a gradient: averaged over the ranks, it goes to an
# outer SGD with Nesterov momentum (lr 0.7, momentum 0.9), stepped from the snapshot. With an
# outer SGD of lr 1 and no momentum it is LocalSGD. Every rank steps the outer optimizer on the
# same Δ̄ from the same weights, so its momentum is the same everywhere without being sent: the
# run below checks it bitwise. The losses are on a small fake task after 64 steps; at this scale
# the outer momentum does not pay off (the paper's runs take H = 500 over many thousand steps).

# %%
import diloco as dl

with needs_tasks("13.1", "13.2", "13.3", "13.4"):
    res = run_distributed(dl.compare_worker, world_size=3, backend="gloo", echo=False,
                          kwargs={"steps": 64, "per_rank": 8, "h": 16, "lr": 0.05})[0]
    print(f"H=1, outer SGD(lr 1): largest difference from DDP {res['h1']:.1e}")
    print(f"{'run':<22}{'test loss':>10}{'syncs':>7}{'payload bytes':>15}")
    for kind, name in (("ddp", "DDP"), ("local_sgd", "LocalSGD, H=16"),
                       ("diloco", "DiLoCo, H=16")):
        r = res[kind]
        syncs = "every" if kind == "ddp" else r["calls"]
        nbytes = "-" if kind == "ddp" else f"{r['bytes']:,}"
        print(f"{name:<22}{r['loss']:>10.4f}{syncs:>7}{nbytes:>15}")
    print(f"outer momentum bitwise equal on every rank: {res['same_momentum']}")

# %% [markdown]
# ## Streaming: one fragment at a time (13.5-13.7)
#
# DiLoCo sends its whole pseudo-gradient once a round: few bytes per step on average, but all
# of them in one burst, while the ranks wait. Streaming DiLoCo (arXiv 2501.18512) cuts the
# model into F fragments, block i in fragment i mod F (13.5: every fragment spans the network
# from bottom to top), and syncs one fragment every H/F inner steps (13.6), each with its own
# snapshot and its own outer optimizer (13.7). The *total* per round stays DiLoCo's; the
# *peak*, what the network must carry at once, falls by F.
#
# Below, 3 ranks train 6 blocks of Linear(64, 64) + ReLU for 24 inner steps at H = 6, once
# with F = 3 and once with F = 1 (plain DiLoCo); `CommCounter` records every all-reduce.

# %%
import streaming as sm
from dpt.ranks import run_distributed

with needs_tasks("13.1", "13.3", "13.5", "13.6", "13.7"):
    H, F, STEPS = 6, 3, 24
    res = run_distributed(sm.train_worker, world_size=3, backend="gloo", echo=False,
                          kwargs=dict(blocks=6, width=64, fragments=F, sync_every=H,
                                      steps=STEPS, per_rank=16, lr=1e-3))[0]
    print(sm.timeline(res[F]["history"], STEPS))
    for f, name in ((F, f"streaming, F={F}"), (1, "DiLoCo, F=1")):
        r = res[f]
        print(f"{name:<16} syncs {r['calls']:>3}  peak {r['peak']:>7,} B  "
              f"total {r['bytes']:>8,} B")
    fig, ax = plt.subplots(figsize=(7, 2.6))
    for f, style in ((1, "C0"), (F, "C1")):
        steps = [s for s, _, _ in res[f]["history"]]
        sizes = [b / 1e3 for _, _, b in res[f]["history"]]
        ax.bar([s + (0.2 if f == F else -0.2) for s in steps], sizes, width=0.4, color=style,
               label=f"F={f}")
    ax.set_xlabel("inner step")
    ax.set_ylabel("KB sent at the sync")
    ax.set_title("the same bytes per round, a third of the peak")
    ax.legend()
    plt.show()

# %% [markdown]
# Every rank must sync the same fragment at the same step: the schedule reads only the step
# count, which every rank shares (torchft uses its manager's step for the same reason). Were
# it to depend on the rank, the all-reduce would add values of *different* layers, silently
# when the fragments are the same size.
#
# ## Fewer bits on the wire (13.8-13.10)
#
# The outer optimizer does not need fp32's mantissa. fp16 and bf16 halve the bytes (13.8);
# fp16 overflows at 65504, so divide by N *before* the cast and let the all-reduce sum the
# shares of the mean. int8 with one scale per block (13.9: scale = max|x|/127, each value
# back within scale/2) quarters them, but int8 cannot be summed on the wire (100 + 100 wraps
# to −56): every rank gathers every rank's q and scales and averages them in fp32 (13.10).
# An all-gather sends (N−1) times its input per rank, where an all-reduce sends 2(N−1)/N
# times: a quarter of the payload is not a quarter of the wire.

# %%
import compress as cm

with needs_tasks("13.1", "13.8", "13.9", "13.10"):
    out = run_distributed(cm.compare_worker, world_size=3, backend="gloo", echo=False,
                          kwargs=dict(numel=101_770, block=256))[0]
    print(f"{'':<5} {'payload B':>10} {'ring B sent':>12} {'max error':>10}")
    for name in ("fp32", "fp16", "bf16", "int8"):
        r = out[name]
        print(f"{name:<5} {r['bytes']:>10,} {r['wire']:>12,.0f} {r['max_err']:>10.1e}")
    print(f"int8 within its bound Σ scale/2 / N everywhere: {out['int8_within_bound']}")

# %% [markdown]
# The error of int8 is set block by block: an outlier spoils only the scale of its own block.
# One rank's values, with an outlier of 0.5 at index 3, quantised in blocks of 256:

# %%
with needs_tasks("13.9"):
    x = cm.pseudo_gradient(0, 4096)
    q, scales = cm.quantize_int8(x, 256)
    err = (x - cm.dequantize_int8(q, scales, x.shape, 256)).abs()
    fig, ax = plt.subplots(figsize=(7, 2.6))
    ax.semilogy(err.numpy() + 1e-12, ".", ms=2, label="|x − x̂|")
    ax.step(range(0, 4096, 256), (scales / 2).numpy(), where="post", color="C3",
            label="scale / 2 of the block")
    ax.set_xlabel("value index")
    ax.set_ylabel("error")
    ax.legend()
    plt.show()

# %% [markdown]
# ## How many local steps? (measured, then projected)
#
# LocalSGD and DiLoCo send the model once every H steps instead of the gradients every step:
# the bytes fall by H exactly. What it costs is optimisation: the eval loss below, after the
# same samples for every configuration (`local_steps_sweep.py`, committed reference run).
# What it buys depends on the network: the projection (lesson 12's ring model) at 1 and
# 100 Gb/s. A projection, not a measurement: this machine's ranks share memory.

# %%
with needs_tasks():
    import local_steps_sweep as sweep

    result = json.loads(bench_result("l13_local_steps.json").read_text())
    print(sweep.format_table(result))
    figure = plt.imread(bench_result("l13_local_steps.png"))
    plt.figure(figsize=(11, 4.2))
    plt.imshow(figure)
    plt.axis("off")
    plt.show()
    for link in ("ethernet-1g", "ethernet-100g"):
        ms = [1000 * sweep.project_seconds(h, h, 0.007, 407_080, 3, link) / h
              for h in (1, 8, 32, 128)]
        print(f"MLP, 7 ms compute a step, {link}: ms per step at H = 1, 8, 32, 128:",
              ", ".join(f"{m:.2f}" for m in ms))

# %% [markdown]
# ## When a replica dies (13.11-13.14)
#
# Lesson 04 answered a dead worker the way torchrun's elastic agent does: stop every worker,
# start them all again, load the last snapshot. Every replica then computes again each step
# since that snapshot, and every replica waits while the job restarts. torchft keeps the
# survivors training instead, and needs four pieces for it, which `fault_tolerance.py` writes
# by hand:
#
# - a **quorum per membership** (13.11): the live replicas register in a store, the first
#   complete view is written once with `compare_set` and everyone uses that one, and the
#   members build a **new** process group (a group a peer died in is broken for good);
# - **healing** (13.12): the lowest-ranked member with state sends model, optimizer state
#   and step to a replacement, which continues bitwise equal to the survivors;
# - a **step that commits on a unanimous vote** (13.13): the gradient is averaged over the
#   LIVE members, and nobody steps if a collective failed (a peer died mid-step): the new
#   quorum redoes that step;
# - **what a policy costs** (13.14): replica-steps thrown away and replica-seconds idle.
#
# `supervisor.py` (given) runs the same job twice: 3 replicas, 40 steps, replica 2 killed at
# the start of step 15, once under each policy (`restart` snapshots every 10 steps).

# %%
import supervisor as sv
import fault_tolerance as ft

with needs_tasks("13.11", "13.12", "13.13", "13.14"):
    runs = {p: sv.supervise(replicas=3, steps=40, kill=(2, 15), policy=p, snapshot_every=10,
                            step_s=0.005)
            for p in ("ft", "restart")}
    print(f"{'policy':8} {'discarded':>9} {'rolled back':>11} {'lost':>5} {'idle s':>7}")
    for p, run in runs.items():
        lost = ft.steps_lost(run["events"], run["replicas"])
        print(f"{p:8} {lost['discarded']:9d} {lost['rolled_back']:11d} "
              f"{lost['replica_steps']:5d} {lost['idle_replica_s']:7.2f}")

# %% [markdown]
# Under `ft` the two survivors lose one step each: step 15, which they computed while their
# peer was already gone; their all-reduce failed, nobody applied it, and a quorum of two
# redid it at once. Under `restart` every replica recomputes steps 11-14 (3 × 4) on top of
# the two failed ones: the longer the time between snapshots, the more it loses. Idle time
# is the gap between a slot going down and its next committed step: the replacement's start
# (and its heal) under `ft`, every replica's stop and restart under `restart`.
#
# Below, each replica's applied step against time. A failed step is a cross; the replacement
# joins the survivors at their current step (a vertical jump: that is the heal), while a
# restart sends all three back to step 10.

# %%
with needs_tasks("13.11", "13.12", "13.13"):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    for ax, (p, run) in zip(axes, runs.items()):
        t0 = run["events"][0]["t"]
        for r in range(run["replicas"]):
            steps = [e for e in run["events"] if e["event"] == "step" and e["replica"] == r]
            ok = [(e["t"] - t0, e["step"]) for e in steps if e["committed"]]
            bad = [(e["t"] - t0, e["step"]) for e in steps if not e["committed"]]
            ax.plot(*zip(*ok), ".", ms=3, label=f"replica {r}")
            if bad:
                ax.plot(*zip(*bad), "x", color="k", ms=7)
        for e in run["events"]:
            if e["event"] == "down" and e.get("incarnation") == 0 and e["replica"] == 2:
                ax.axvline(e["t"] - t0, color="r", lw=0.8)
        ax.set(title=f"policy {p}", xlabel="seconds")
    axes[0].set_ylabel("step applied")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# `restart` above imitates torchrun: its replicas come back from a fork server that has
# already imported torch. `benchmarks/bench_l13_fault.py` runs the same job under the real
# `torchrun --max-restarts=1` (lesson 04's way) beside both policies, three rounds each, and
# scores all three with your `steps_lost`. The steps lost are the same as the imitation's,
# and so are the final weights, bit for bit; the idle time is not: the agent has to notice
# the death, stop the survivors, start three new Python processes and meet again.

# %%
with needs_tasks():
    result = json.loads(bench_result("l13_fault.json").read_text())

    def shown(d: dict) -> str:  # mean [95% interval]; one round has no interval
        return f"{d['mean']:.2f}" + ("" if d["lo"] is None else f" [{d['lo']:.2f}, {d['hi']:.2f}]")

    print(f"{result['rounds']} round(s); mean [95% interval]")
    for way, row in result["summary"].items():
        print(f"{way:9} replica-steps lost {shown(row['replica_steps']):22} "
              f"idle replica-seconds {shown(row['idle_replica_s'])}")
    print("torchrun's final weights equal the imitated restart's:",
          result["torchrun_equals_restart"])

# %% [markdown]
# ## What to take away
#
# - LocalSGD and DiLoCo cut the bytes by H exactly; at H = 1 they are DDP (for SGD), and the
#   price of a large H is optimisation, measured above at equal samples.
# - DiLoCo's outer optimizer needs no communication of its own: every rank steps it on the
#   same averaged Δ, so its state stays identical.
# - Fragments divide the peak, not the total; int8 quarters the payload but goes by
#   all-gather, so its wire cost grows with N.
# - A fault-tolerant step loses the failed step on the survivors only; a restart loses every
#   replica's steps since the snapshot. torchft does the former in practice (`torchft_job.py`).
