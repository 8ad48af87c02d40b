# %% [markdown]
# # Lesson 08: sharding, a ZeRO optimizer by hand, and FSDP2
#
# Data parallelism as lessons 03 to 05 built it keeps a full copy of everything on every
# rank: the parameters, their gradients and the optimizer's state. The DTU MLOps
# distributed-training module points at sharding as the way to save that memory, and the
# PyTorch Lightning MNIST notebook lists Lightning's "sharded" (SDP)
# and "fully sharded" (FSDP) plugins. This lesson counts where a rank's bytes go, removes
# the copies one kind at a time, and checks every count against what the code allocates.
#
# | task | function | what it does |
# |---|---|---|
# | 08.1 | `zero_accounting.predict_bytes` | bytes per rank for DDP, ZeRO-1, -2, -3 |
# | 08.2 | `zero_optimizer.partition_params` | assign each parameter to an owner, balanced by size |
# | 08.3 | `ShardedOptimizer.step` | step only the owned parameters, then broadcast them |
# | 08.4 | `fsdp2_train.shard_model` | `fully_shard` per block, then the root |
# | 08.5 | `fsdp2_train.full_state_dict` | gather a full state dict onto rank 0 |

# %%
from dpt.notebook import (
    bench_result,
    check_run,
    dataset_label,
    needs_gpus,
    needs_tasks,
    script_env,
    use_lesson,
)

use_lesson("08_sharding")

import subprocess
import sys

import matplotlib.pyplot as plt
import torch

import fsdp2_train as ft
import zero_accounting as acc
import zero_optimizer as zo
from dpt.models import ConvNet, count_parameters
from dpt.ranks import placement, run_distributed

# %% [markdown]
# Each cell below runs inside `with needs_tasks(...)`, which names the tasks it uses. A cell
# that reaches a task you have not done yet prints `skipped: this cell needs Task NN.K` instead
# of a traceback, and the rest of the notebook still runs. Edits to your lesson files are
# picked up when you re-run a cell.

# %% [markdown]
# ## 1. The accounting
#
# Adam in fp32 keeps, per parameter, 4 bytes of weight, 4 of gradient and 8 of state
# (`exp_avg` and `exp_avg_sq`): 16 bytes. Under DDP every rank holds all 16. ZeRO (Rajbhandari
# et al.) shards them in stages: stage 1 the optimizer state, stage 2 the gradients as well,
# stage 3 the parameters too, which is what FSDP does. With N ranks:
#
# | stage | params | grads | Adam state |
# |---|---|---|---|
# | DDP | 4P | 4P | 8P |
# | ZeRO-1 | 4P | 4P | 8P/N |
# | ZeRO-2 | 4P | 4P/N | 8P/N |
# | ZeRO-3 / FSDP | 4P/N | 4P/N | 8P/N |

# %%
with needs_tasks("08.1"):
    P = count_parameters(ConvNet())
    print(f"ConvNet: P = {P:,} parameters")
    for stage in acc.STAGES:
        row = acc.predict_bytes(P, 2, stage)
        print(f"{acc.STAGE_LABELS[stage]:<36} N=2: " +
              ", ".join(f"{k} {v / 1024:6.1f} KiB" for k, v in row.items()))

    # A model worth sharding: 7 B parameters, and the ZeRO paper's mixed-precision count
    # (2 bytes fp16 weight + 2 fp16 grad + K=12 fp32 master weight and Adam state).
    big = 7e9
    ns = [1, 2, 4, 8, 16, 32, 64]
    fig, ax = plt.subplots(figsize=(6, 4))
    for stage in acc.STAGES:
        ax.plot(ns, [acc.predict_bytes(big, n, stage, 2, 2, 12)["total"] / 2**30 for n in ns],
                "o-", label=acc.STAGE_LABELS[stage])
    ax.axhline(80, color="gray", ls=":", label="one 80 GB GPU")
    ax.set(xscale="log", yscale="log", xticks=ns, xticklabels=ns, xlabel="ranks N",
           ylabel="GiB per rank (predicted)", title="7B parameters, mixed-precision Adam")
    ax.legend(fontsize=8)
    plt.show()

# %% [markdown]
# The same count as a picture: for the ConvNet on 4 ranks, what each rank keeps of each
# kind. Every bar's length is what your `predict_bytes` returns; the pale bar behind it is
# the whole, as one process holds it, and a rank's shard is drawn where its 1/N slice sits.
# From one row to the next, one more kind is cut into four.

# %%
with needs_tasks("08.1"):
    from figures import zero_stages

    zero_stages.draw(P, world_size=4)
    plt.show()

# %% [markdown]
# Activations come on top, and they are not sharded by any of these stages (that is what
# activation checkpointing and tensor/sequence parallelism are for; lesson 09 measures them
# and checkpoints them).
#
# Check the count against reality on one process: `measure_bytes` sums
# `numel * element_size` over the parameters, gradients and the optimizer's state tensors.

# %%
with needs_tasks("08.1"):
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    opt.step()
    print("measured :", acc.measure_bytes(model, opt))
    print("predicted:", acc.predict_bytes(P, 1, "ddp"))

# %% [markdown]
# ## 2. A sharded optimizer by hand (ZeRO-1)
#
# Every rank computes the same assignment of parameters to owners. Balanced by size, not by
# count: greedily give the biggest remaining tensor to the least-loaded rank.

# %%
with needs_tasks("08.2"):
    sizes = [p.numel() for p in ConvNet().parameters()]
    owners = zo.partition_params(sizes, 2)
    for r in range(2):
        print(f"rank {r} owns {sum(s for s, o in zip(sizes, owners) if o == r):6,} elements "
              f"in {owners.count(r)} tensors")

# %% [markdown]
# `ShardedOptimizer(params, torch.optim.Adam, lr=...)` builds the real Adam on each rank for
# its own parameters only. DDP still all-reduces every gradient; then each rank steps what it
# owns and broadcasts it, so all ranks hold the same weights again. Two ranks need two
# processes, and a notebook cannot hand its own functions to fresh processes (they cannot
# unpickle code defined in a cell), so the ranks run `zero_optimizer.demo_worker`, a
# function in a file, started by `run_distributed` (free port, fail fast, timeout).

# %%
with needs_tasks("08.2", "08.3"):
    for r in run_distributed(zo.demo_worker, world_size=2, kwargs={"steps": 5}, echo=False):
        print(f"rank {r['rank']}: max |plain - sharded| = {r['max_diff']:.1e}; Adam state "
              f"{r['sharded_state'] / 1024:.1f} KiB of {r['plain_state'] / 1024:.1f} KiB "
              f"({r['owned']:.0%} owned)")

# %% [markdown]
# Same weights as plain Adam, and each rank keeps about half the state. It is not exactly
# half: ZeRO-1 shards whole tensors, and `fc.weight` alone is over half the ConvNet. FSDP
# (below) cuts every tensor instead. `ShardedOptimizer.reduce_gradients()` goes one stage
# further (ZeRO-2): used instead of DDP, it reduces each gradient only to its owner and frees
# it elsewhere. torch ships the stage-1 idea as `ZeroRedundancyOptimizer`; ours must take the
# same steps.
#
# ## 3. FSDP2: `fully_shard`
#
# `fully_shard(block)` turns every parameter of `block` into a DTensor sharded on dim 0: each
# rank stores 1/N of it. Apply it to each block, then to the root: before a block's forward
# FSDP all-gathers its parameters, after it frees them, and in backward it reduce-scatters the
# block's gradients, so a rank's gradients and Adam state are 1/N as well. It runs on CPU
# with gloo too. We train the ConvNet on Fashion-MNIST with 2 ranks, and the same with DDP:
# on the GPUs when this machine has any (sharing them with gloo when there are fewer GPUs
# than ranks), else on the CPU (`placement(2).label` says which).

# %%
runs = {}
SETUP = {"steps": 30, "batch_size": 64, "data": "fashion-mnist"}
with needs_tasks("08.4", "08.5"):
    runs["fsdp2"] = run_distributed(ft.train_worker, world_size=2, timeout=240, echo=False,
                                    kwargs={"mode": "fsdp2", **SETUP})
with needs_tasks():  # torch's DDP: no task of yours
    runs["ddp"] = run_distributed(ft.train_worker, world_size=2, timeout=240, echo=False,
                                  kwargs={"mode": "ddp", **SETUP})
with needs_tasks():  # the methods that ran
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode, ranks in runs.items():
        ax.plot(ranks[0]["losses"], label=mode, ls="-" if mode == "ddp" else "--")
    ax.set(xlabel="step", ylabel="loss (mean over ranks)",
           title=f"{' and '.join(m.upper() for m in runs)}, 2 ranks, {placement(2).label}, "
                 f"{dataset_label(SETUP['data'])}")
    ax.legend()
    plt.show()

# %%
with needs_tasks("08.4", "08.5"):
    print(f"{'parameter':<18}{'full shape':<18}{'rank 0 local':<18}{'rank 1 local':<18}type")
    for a, b in zip(runs["fsdp2"][0]["shards"], runs["fsdp2"][1]["shards"]):
        print(f"{a['name']:<18}{str(a['full']):<18}{str(a['local']):<18}{str(b['local']):<18}"
              f"{a['type']} {a['placements']}")
with needs_tasks():
    for mode, ranks in runs.items():
        print(mode, "rank 0 holds", {k: f"{v / 1024:.1f} KiB" for k, v in ranks[0]["memory"].items()})

# %% [markdown]
# Saving: `full_state_dict(model)` calls `get_model_state_dict` with
# `StateDictOptions(full_state_dict=True, cpu_offload=True)`. Every rank must call it (it
# all-gathers), and only rank 0 keeps the result, as plain CPU tensors with the same keys a
# plain `ConvNet` has. So it loads into a model without any FSDP around it:

# %%
with needs_tasks("08.4", "08.5"):
    from dpt.data import load_tensors  # noqa: E402

    state = runs["fsdp2"][0]["state_dict"]
    print("rank 0:", len(state), "tensors; rank 1:", len(runs["fsdp2"][1]["state_dict"]))
    plain = ConvNet()
    plain.load_state_dict(state)
    plain.eval()
    x, y = load_tensors("fashion-mnist", train=False)
    with torch.no_grad():
        acc_fsdp = (plain(x[:2000]).argmax(1) == y[:2000]).float().mean().item()
    print(f"test accuracy of the gathered model after 30 steps: {acc_fsdp:.1%}")

# %% [markdown]
# ## 4. Lightning's `fsdp` strategy
#
# In Lightning the whole of section 3 is one argument: `pl.Trainer(strategy="fsdp",
# accelerator="gpu", devices=N)`, one GPU per process. As lesson 07 showed, its FSDPStrategy
# refuses the CPU, so on a machine without a GPU `lightning_fsdp_trainer` explains itself
# instead, and on a machine with one GPU this cell says it needs two. With GPUs the Trainer is
# built by the script (`python solutions/08_sharding/fsdp2_train.py --lightning --nproc 2`):
# inside Jupyter, Lightning refuses to build a strategy that starts its ranks by re-running
# the script.

# %%
with needs_tasks():
    if not torch.cuda.is_available():
        try:
            ft.lightning_fsdp_trainer(devices=2)
        except RuntimeError as exc:
            print(exc)
    else:
        needs_gpus(2)
        proc = subprocess.run([sys.executable, ft.__file__, "--lightning", "--nproc", "2"],
                              capture_output=True, text=True, timeout=300, env=script_env())
        check_run(proc, "fsdp2_train.py --lightning")
        print(proc.stdout.strip())

# %% [markdown]
# ## 5. What it costs
#
# Sharding trades memory for communication: ZeRO-1 adds a broadcast of every parameter per
# step, FSDP an all-gather in forward and again in backward plus a reduce-scatter instead
# of the all-reduce. `benchmarks/bench_l08_memory.py` measures memory per rank and steps per
# second for DDP, the sharded optimizer and FSDP2 at N = 1 and 2, next to the predicted line
# up to N = 8. On the course's idle 2-core machine, with a deep MLP of equal layers (7.1 M
# parameters, Adam), the state per rank at N = 2 was 108.5 MB for DDP, 84.4 MB for the sharded
# optimizer (predicted 81.4: it holds 0.55 of Adam's state, since it splits whole tensors) and
# 54.3 MB for FSDP2 (exactly half). Those bytes are the same in every run; the speed is not.
# In that idle run (the median of 3 repeats) FSDP2 paid with half of DDP's steps per second
# (4.9 against 9.6) and the sharded optimizer ran as fast as DDP (9.8). In 3 repeats on a busy
# machine FSDP2 made 0.48-0.73 of DDP's steps per second, the slowest every time, and the
# sharded optimizer 0.75-1.27, either side of DDP. The lesson's NOTES.md has both runs; the
# committed plot:

# %%
with needs_tasks():
    from IPython.display import Image, display

    display(Image(filename=str(bench_result("l08_memory.png"))))
