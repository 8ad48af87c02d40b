# %% [markdown]
# # Lesson 11: time to accuracy
#
# Lessons 02 to 10 made a training step faster. Nobody trains for steps: you train until the
# model is good enough, and the question is when that happens. N ranks at a per-rank batch b
# train on a global batch B = N·b, and that changes the optimisation. This notebook shows
# what stays the same (the step of one process on B), what breaks it (BatchNorm), what the
# learning rate must do as B grows, where a larger B stops saving steps, and the optimizers
# built for very large batches.
#
# | task | function | what it does |
# |---|---|---|
# | 11.1 | `global_batch.micro_batches` | a rank's share of the global batch, in K micro-batches |
# | 11.2 | `global_batch.accumulation_step` | one optimizer step over K micro-batches |
# | 11.3 | `sync_bn.global_moments` | the global batch's mean, variance and count, one all-reduce |
# | 11.4 | `SyncBatchNormByHand.forward` | batch norm with the global statistics |
# | 11.5 | `sync_bn.convert_sync_by_hand` | every BatchNorm of a model replaced |
# | 11.6 | `lr_scaling.scaled_lr` | the lr for a global batch: linear, sqrt, none |
# | 11.7 | `lr_scaling.warmup_lr` | linear warmup to the scaled lr |
# | 11.8 | `lr_scaling.train_to_target` | train until the target accuracy: steps, samples, seconds |
# | 11.9 | `lr_scaling.critical_batch` | the critical batch from measured steps |
# | 11.10 | `LARS.step` | SGD with a trust ratio per tensor |
# | 11.11 | `lamb_direction`, `LAMB.step` | Adam's direction with a trust ratio per tensor |
# | 11.12 | `shard_square_norms` | whole tensors' norms from element shards |
# | 11.13 | `ShardedLAMB.step` | LAMB on element shards |
# | 11.14 | `sharded_clip_grad_norm_` | gradient clipping on element shards |

# %%
from dpt.notebook import bench_result, needs_tasks, use_lesson

use_lesson("11_time_to_accuracy")

import json

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import batch_sweep as bs
import global_batch as gb
import large_batch as lb
import lr_scaling as ls
import sync_bn as sb
from dpt.models import MLP, ConvNet
from dpt.ranks import placement, run_distributed

print("2 ranks:", placement(2).label)

# %% [markdown]
# Each cell below runs inside `with needs_tasks(...)`, which names the tasks it uses. A cell
# that reaches a task you have not done yet prints `skipped: this cell needs Task NN.K` instead
# of a traceback, and the rest of the notebook still runs.
#
# ## 1. Same global batch, same step (11.1, 11.2)
#
# DDP averages the ranks' gradients, and the average of N means over b samples is the mean
# over N·b samples. Gradient accumulation gets the same mean in one process: K micro-batches,
# each loss divided by K, gradients added up in `.grad`, one step. Under DDP each backward
# would all-reduce; `no_sync()` keeps all but the last one local.
#
# Three ways to train on global batches of 32, ten SGD steps each: 2 ranks × 2 micro-batches
# of 8 (DDP with accumulation), one process × 4 micro-batches, one process on all 32.

# %%
with needs_tasks("11.1", "11.2"):
    ranks = run_distributed(gb.ddp_worker, world_size=2, timeout=120, echo=False,
                            kwargs={"optimizer": "sgd", "steps": 10, "global_batch": 32,
                                    "accum": 2})
    accumulated = gb.one_process("sgd", steps=10, global_batch=32, accum=4)
    whole = gb.one_process("sgd", steps=10, global_batch=32, accum=1)
    print(f"per step: {ranks[0]['all_reduces'] / 10:g} all-reduce(s), "
          f"{ranks[0]['steps'] / 10:g} optimizer step(s)")
    print(f"largest weight difference from one process on the whole batch: "
          f"2 ranks x 2 micro {gb.max_difference(ranks[0]['params'], whole):.1e}, "
          f"1 process x 4 micro {gb.max_difference(accumulated, whole):.1e}")

# %% [markdown]
# The most common accumulation bug is to forget the division. Below, the same accumulation
# without it, against the correct one: SGD takes K-times larger steps, while AdamW hardly
# notices, because Adam divides the gradient by its own running size. So a test that only
# tries AdamW would miss the bug.

# %%
with needs_tasks("11.1", "11.2"):
    def forgot_division(model, optimizer, micro, loss_fn):
        optimizer.zero_grad()
        for xb, yb in micro:
            loss_fn(model(xb), yb).backward()  # the sum of K means: K times the mean
        optimizer.step()

    for name in ("sgd", "adamw"):
        runs = {}
        for label, step in (("divided", gb.accumulation_step), ("not divided", forgot_division)):
            model = gb.new_model(0)
            opt = gb.make_optimizer(name, model.parameters())
            for x, y in gb.make_batches(10, 32):
                step(model, opt, gb.micro_batches(x, y, 0, 1, 4), F.cross_entropy)
            runs[label] = [p.detach() for p in model.parameters()]
        print(f"{name:>5}: forgetting the division moves the weights by "
              f"{gb.max_difference(runs['divided'], runs['not divided']):.1e}")

# %% [markdown]
# ## 2. BatchNorm across ranks (11.3-11.5)
#
# BatchNorm normalises with the statistics of *its* batch. Under DDP a rank sees only its own
# b samples, so per-rank BatchNorm trains a different model from one process on the global
# batch. SyncBatchNorm all-reduces Σx, Σx² and n instead (sums, so uneven shares work, and
# inside autograd, so the gradients flow between ranks). torch's `nn.SyncBatchNorm` runs on
# GPUs only; your `SyncBatchNormByHand` runs anywhere. Three ranks holding 4, 8 and 12 samples:

# %%
with needs_tasks("11.3", "11.4", "11.5"):
    ranks = run_distributed(sb.compare_worker, world_size=3, timeout=120, backend="gloo",
                            echo=False, kwargs={"total": 24, "steps": 3, "per_rank": 4})
    whole = torch.nn.BatchNorm2d(3)
    want = whole(sb.batch(24)).detach()
    for name, key in (("per-rank BatchNorm", "local"), ("SyncBatchNormByHand", "synced")):
        got = torch.cat([r[key] for r in ranks])
        print(f"{name:<20} outputs differ from one process by up to "
              f"{(got - want).abs().max():.1e}")
    torch.manual_seed(0)
    reference = sb.train(ConvNet(batch_norm=True), sb.images(3, 4, 3), 0, 1)
    print("ConvNet after 3 DDP steps, largest difference from one process: per-rank BN "
          f"{sb.largest(ranks[0]['per_rank_bn'], reference):.1e}, hand SyncBN "
          f"{sb.largest(ranks[0]['sync_bn'], reference):.1e}")

# %% [markdown]
# ## 3. The learning rate against the global batch (11.6, 11.7)
#
# With B four times larger, an epoch has four times fewer steps. Keep the small batch's
# learning rate and each step moves the weights about as far as before, so an epoch moves
# them four times less. Goyal et al. scale the lr linearly with B, and warm it up from the
# base lr over the first steps, while the weights still change fast. The square-root rule is
# milder, and is common with Adam.

# %%
with needs_tasks("11.6", "11.7"):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for B in (64, 256, 1024, 4096):
        lr_at = ls.lr_schedule(0.02, 64, B, "linear", warmup_steps=50)
        ax.plot(range(120), [lr_at(s) for s in range(120)], label=f"B = {B}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title("linear scaling from lr 0.02 at B = 64, 50 warmup steps")
    ax.legend()
    plt.show()
    for B in (256, 1024, 4096):
        print(f"B = {B:>4}: linear x{ls.scaled_lr(1, 64, B, 'linear'):g}, "
              f"sqrt x{ls.scaled_lr(1, 64, B, 'sqrt'):g}")

# %% [markdown]
# ## 4. Steps to a target accuracy as the batch grows (11.8, 11.9)
#
# `batch_sweep.py` trains the MLP on Fashion-MNIST at several global batches, one process
# each (part 1 showed that this is the step N ranks take), until the test accuracy reaches
# a target (your `train_to_target`), with the lr scaled linearly and without scaling. The
# quick version here uses one seed and a low target. Each run trains for seconds.

# %%
with needs_tasks("11.6", "11.7", "11.8", "11.9"):
    quick = bs.sweep(bs.parse(["--quick", "--no-progress"]))
    print(bs.format_table(quick["summary"]))

# %% [markdown]
# The full sweep (`benchmarks/bench_l11_batch_sweep.py`: 3 seeds per point, batches 64 to
# 8192, SGD with and without linear scaling, and LAMB) takes a few minutes. Below is your
# latest run, or the committed reference. McCandlish et al. model the steps to a target as
# S = S_min·(1 + B_noise/B). The fit below is your `critical_batch`, applied to the runs of
# the linear rule that reached the target. Below B_crit, doubling the batch nearly halves the
# steps. Above it, the steps stay near S_min, and the extra ranks buy nothing.

# %%
with needs_tasks():  # the sweep's runs, as measured
    full = json.loads(bench_result("l11_batch_sweep.json").read_text())
    print(f"{len(full['runs'])} runs, {full['config']['seeds']} seeds per point, "
          f"batches {', '.join(map(str, full['config']['batches']))}")

# %%
with needs_tasks("11.9"):
    ok = [r for r in full["runs"]
          if r["reached"] and (r["optimizer"], r["rule"]) == ("sgd", "linear")]
    s_min, b_crit = ls.critical_batch([r["batch"] for r in ok], [r["steps"] for r in ok])
    print(f"SGD, linear rule, {len(ok)} runs that reached {full['config']['target']:g}: "
          f"S_min = {s_min:.0f} steps, critical batch B_crit = {b_crit:.0f}")
    fig = bs.plot(full)
    plt.show()

# %% [markdown]
# ## 5. Optimizers for large batches (11.10-11.14)
#
# Linear scaling fails past some batch, and one reason is that one lr does not suit every
# tensor: the ratio ‖w‖/‖g‖ differs from tensor to tensor (You et al. measured it over orders
# of magnitude across a deep network's layers; the small MLP spreads less). After one
# backward of the MLP:

# %%
with needs_tasks():
    torch.manual_seed(0)
    model = MLP()
    x, y = gb.make_batches(1, 256)[0]
    F.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        print(f"{name:<16} |w| {p.norm():7.3f}   |g| {p.grad.norm():7.4f}   "
              f"|w|/|g| {p.norm() / p.grad.norm():8.1f}")

# %% [markdown]
# LARS and LAMB give each tensor its own step size through a *trust ratio* ∝ ‖w‖/‖update‖.
# Once the weights are sharded by elements (DeepSpeed's flat partitions, FSDP), no rank holds
# a whole tensor, and its norm needs every rank's piece. Squares add, norms do not: one
# all-reduce of the shards' sums of squares, then the square root. Sharded LAMB on 2 ranks
# against LAMB in one process:

# %%
with needs_tasks("11.11", "11.12", "11.13"):
    ranks = run_distributed(lb.compare_worker, world_size=2, timeout=120, echo=False,
                            kwargs={"steps": 10, "batch": 64, "seed": 0})
    print(f"largest weight difference after 10 steps: {ranks[0]['max_diff']:.1e}; "
          f"optimizer state per rank {ranks[0]['state_elements']:,} elements "
          f"(LAMB in one process: {ranks[0]['full_state_elements']:,})")

# %% [markdown]
# The full sweep above also ran LAMB (square-root rule) at the largest batches. For each
# optimizer: the largest batch at which every seed reached the target, and its steps with
# their 95% interval, from the committed (or your) sweep:

# %%
with needs_tasks():
    for opt, rule in (("sgd", "linear"), ("sgd", "none"), ("lamb", "sqrt")):
        rows = [r for r in full["summary"]["rows"] if (r["optimizer"], r["rule"]) == (opt, rule)
                and r["reached"] == r["seeds"]]
        if rows:
            r = max(rows, key=lambda r: r["batch"])
            print(f"{opt.upper():<5} {rule:<7} largest batch with {r['seeds']}/{r['seeds']} "
                  f"seeds at the target: {r['batch']:>5}, {r['steps']:.0f} "
                  f"[{r['steps_lo']:.0f}, {r['steps_hi']:.0f}] steps")
    missed = [f"{r['optimizer'].upper()} {r['rule']} {r['batch']} ({r['reached']}/{r['seeds']})"
              for r in full["summary"]["rows"] if r["reached"] < r["seeds"]]
    print("not every seed reached it:", ", ".join(missed) or "none")

# %% [markdown]
# ## 6. Time to accuracy in the benchmark
#
# `make benchmark` now also trains to a target accuracy at N=1 and at the largest N, with
# the lr scaled linearly. It reports the wall time to the target as a ratio with its
# interval, beside the throughput speedup, and checks, as MLPerf does, that the N-rank run
# needs no more epochs than one rank, within a stated margin. Lesson 14 reads it.
