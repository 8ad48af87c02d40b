# %% [markdown]
# # Lesson 03: DistributedDataParallel, launched with `mp.spawn`
#
# Lesson 01 trained one model in one process. Data parallelism runs one process per device,
# each with a full copy of the model and its own slice of every epoch. During `backward()`
# DDP averages the gradients of all processes, so every copy takes the same step and stays
# identical. `ddp_spawn.py` is lesson 01's `single_device.py` plus what that takes: read
# `CHANGES.diff` in the lesson folder first, it is the lesson in one page. You write:
#
# | task | where | what it does |
# |---|---|---|
# | 03.1 | `ddp_setup` | who this process is in the whole job (`-n` machines, `-g` processes each, machine `-nr`) |
# | 03.2 | `join_group`, end of `main` | the device and its backend, then join the process group; leave it whatever happens |
# | 03.3 | `prepare_dataloader` | each rank's own share of the data, shuffled alike on every rank |
# | 03.4 | `Trainer._run_epoch` | a new order every epoch, the same on every rank |
# | 03.5 | `Trainer._save_checkpoint` | one writer, the plain model inside DDP, everybody waits for the file |
# | 03.6 | `evaluate` | the accuracy of the whole test set, every sample counted once |
# | 03.7 | `launch` | where rank 0 waits (`MASTER_ADDR`, `MASTER_PORT`), then start the processes with `mp.spawn` |
#
# The functions marked `from lesson 01_single_device` are lesson 01's, unchanged: run
# `make carry` at the course's root to copy your lesson-01 answers into them.
#
# **Why this notebook starts the script in a subprocess.** `mp.spawn` starts fresh Python
# processes and sends them the function to run by *pickling* it, i.e. by module and name. A
# function typed into a notebook lives in `__main__` of the kernel, which a fresh process cannot
# import. So the training lives in `ddp_spawn.py`, and we run it as you would in a terminal.

# %%
from dpt.notebook import check_run, needs_tasks, ranks_device, script_env, use_lesson

folder = use_lesson("03_ddp_spawn")

import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from dpt.data import is_present, load_tensors, prepare
from dpt.models import ConvNet

DATASET = "mnist" if is_present("mnist") else "fashion-mnist"  # MNIST after `make data`
prepare(DATASET)

# %% [markdown]
# Each cell below runs inside `with needs_tasks(...)`, which names the tasks it uses. A cell
# that reaches a task you have not done yet prints `skipped: this cell needs Task NN.K` instead
# of a traceback, and the rest of the notebook still runs. Edits to your lesson files are
# picked up when you re-run a cell.

# %% [markdown]
# ## Who is who: machines, processes, ranks
#
# The tutorial *Distributed data parallel training in PyTorch* runs the same command on every
# machine: `-n` machines, `-g` processes on each, and `-nr` says which machine this is. The
# ranks are numbered machine after machine: machine 0 holds ranks 0..g-1, machine 1 the next
# g, and so on, and there are `n * g` in all. `ddp_setup` (03.1) works out its own rank from
# that, and `join_group` (03.2) joins the group: process `local_rank` of a machine takes its
# GPU `local_rank` (or the CPU), the backend goes with the device (NCCL for GPUs, gloo for the
# CPU), and `dist.init_process_group` finds rank 0 at `MASTER_ADDR:MASTER_PORT`, which
# `launch` (03.7) sets before `mp.spawn` starts one process per device, each running `main`.
# `main` leaves the group in its `finally`, so a failing process does not leave the others
# waiting.
#
# ## Sharding, and the padding trap
#
# `DistributedSampler` gives rank `r` every `world_size`-th index of a (shuffled) list. When
# the dataset does not divide evenly, it *pads* the list by repeating its first entries, so that
# every rank gets the same number of batches (otherwise one rank would wait forever in an
# all-reduce the others never start). For training a few repeats do no harm. For
# **evaluation** they do: the repeated samples are counted twice. Look at 5 samples on 2 ranks:

# %%
with needs_tasks():
    for rank in range(2):
        s = DistributedSampler(range(5), num_replicas=2, rank=rank, shuffle=False)
        print(f"rank {rank} evaluates samples {list(s)}")

# %% [markdown]
# Sample 0 appears on both ranks: 6 samples counted instead of 5. Your `evaluate` (03.6) must
# count each sample once, and then add up the ranks' counts, so that every rank reports the
# accuracy of the *whole* test set.
#
# For training, the sampler shuffles one list (the same `seed + epoch` on every rank), pads
# it with its first entries, and deals it out: rank r takes positions r, r + N, r + 2N, ...
# Here are 11 samples on 3 ranks over two epochs, and the evaluation case above (the same
# figure is `figures/distributed_sampler.svg` in the lesson folder; `figures/sampler_diagram.py`
# draws it from what `DistributedSampler` returns). Each epoch every sample goes to one rank,
# the repeat (red) makes 12, and `set_epoch` deals a new order.

# %%
with needs_tasks():
    import matplotlib.pyplot as plt
    from figures import sampler_diagram

    sampler_diagram.draw()
    plt.show()

# %% [markdown]
# ## Train on two ranks
#
# The script starts 2 processes (`-g 2`). Each joins the group, trains lesson 01's `Trainer`
# wrapped in DDP on its half of every epoch, and rank 0 saves a checkpoint after each epoch.
# We train on a fifth of the training set and test on 2001 samples (odd, so one rank's share is
# padded) to stay quick. The ranks run on the GPUs when this machine has one per rank, else on
# the CPU with gloo: `ranks_device(2)` picks `--device` (with `DPT_SHARE_GPU=1`, two ranks
# also share one GPU, with gloo).

# %%
with needs_tasks("01.1", "01.3", "03.1", "03.2", "03.3", "03.4", "03.5", "03.6",
                 "03.7"):  # the whole script
    work = Path(tempfile.mkdtemp(prefix="l03-"))
    DEVICE = ranks_device(2)
    print("ranks on:", DEVICE)
    cmd = [sys.executable, str(folder / "ddp_spawn.py"), "--dataset", DATASET, "-g", "2",
           "--device", DEVICE,
           "--epochs", "2", "--train-limit", "12000", "--test-limit", "2001", "--no-progress",
           "--timeout", "120", "--checkpoint", str(work / "ck.pt")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=script_env())
    check_run(run, "ddp_spawn.py")
    print(run.stdout[-2000:], run.stderr[-2000:])

# %% [markdown]
# Now check the claim of 03.5 and 03.6 from the outside: the checkpoint loads into a plain
# `ConvNet` (no `module.` prefix), and evaluated in this one process on the same 2001 samples
# it gives the count the two ranks reported together. (The same sums in another batch split or
# thread count can differ in the last bits, and ranks on a recent GPU compute convolutions in
# TF32 by default: a borderline sample can then tip the other way.)

# %%
with needs_tasks("01.1", "01.3", "03.1", "03.2", "03.3", "03.4", "03.5", "03.6",
                 "03.7"):  # its checkpoint
    state = torch.load(work / "ck.pt", weights_only=True, map_location="cpu")
    model = ConvNet()
    model.load_state_dict(state["model"])
    model.eval()
    x, y = load_tensors(DATASET, train=False, limit=2001)
    with torch.no_grad():
        correct = int((model(x).argmax(1) == y).sum())
    print(f"epoch {state['epoch']} checkpoint, evaluated here: {correct}/2001")

# %% [markdown]
# ## Effective batch size
#
# With `--batch-size 64` on 2 ranks, one optimizer step averages the gradients of 2 x 64 = 128
# samples: DDP with world size N and per-rank batch B takes the same step as one process with
# batch N x B, weight for weight. An epoch therefore has N times fewer
# steps; if you scale out, consider scaling the learning rate, or keep the global batch fixed
# by shrinking B.
#
# ## Two "nodes" on one machine
#
# To rehearse a multi-node job on one machine, open two terminals and give both the same port
# (each "node" has 1 process; `--threads 1` because both share the cores; on a machine with
# two GPUs, `CUDA_VISIBLE_DEVICES` gives each "node" its own). Node 1 must be told where
# node 0 is (`--master-addr`; here, this machine); node 0 hosts the rendezvous itself:
#
# ```
# CUDA_VISIBLE_DEVICES=0 python exercises/03_ddp_spawn/ddp_spawn.py -n 2 -g 1 -nr 0 --master-port 29533 --threads 1
# CUDA_VISIBLE_DEVICES=1 python exercises/03_ddp_spawn/ddp_spawn.py -n 2 -g 1 -nr 1 --master-addr 127.0.0.1 --master-port 29533 --threads 1
# ```
#
# Node 0 waits until node 1 joins, then both train together; only global rank 0 prints.
