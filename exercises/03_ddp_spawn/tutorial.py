# %% [markdown]
# # Lesson 03: DistributedDataParallel, launched with `mp.spawn`
#
# Lesson 01 trained one model in one process. Data parallelism runs one process per device,
# each with a full copy of the model and its own slice of every epoch. During `backward()`
# DDP averages the gradients of all processes, so every copy takes the same step and stays
# identical. You write the pieces in `ddp_spawn.py`:
#
# | task | function | what it does |
# |---|---|---|
# | 03.1 | `ddp_setup` / `ddp_teardown` | backend from the device, MASTER_ADDR/PORT, one device and a share of the CPU threads per process; leave the group even on errors |
# | 03.2 | `global_rank` / `check_launch` | seed 003's `rank = nr * gpus + local_rank`, and refusing launches that cannot work |
# | 03.3 | `make_train_loader` / `train_epoch` | `DistributedSampler` shards, `set_epoch` every epoch |
# | 03.4 | `wrap_model` / `save_checkpoint` | the DDP wrap; rank 0 alone saves `model.module.state_dict()` |
# | 03.5 | `evaluate_distributed` | every rank counts its shard, counts are all-reduced, padding dropped |
#
# **Why this notebook does not call `mp.spawn` itself.** `mp.spawn` starts fresh Python
# processes and sends them the function to run by *pickling* it, i.e. by module and name. A
# function typed into a notebook lives in `__main__` of the kernel, which a fresh process cannot
# import, so spawn fails. We therefore keep every rank function in a file (`ddp_spawn.py`) and
# start the ranks with `dpt.testing.run_distributed`, which imports that file in each new
# process (the script itself uses `mp.spawn`, see the end).

# %%
from dpt.notebook import use_lesson

use_lesson("03_ddp_spawn")

import matplotlib.pyplot as plt
import torch
from torch.utils.data import DistributedSampler

import ddp_spawn
from dpt.data import prepare
from dpt.testing import run_distributed

prepare("fashion-mnist")

# %% [markdown]
# ## Who is who: nodes, processes, ranks
#
# Seed 003 runs the same command on every machine: `-n` machines, `-g` processes on each, and
# `-nr` says which machine this is. Process `local_rank` of machine `nr` is global rank
# `nr * gpus + local_rank`: machine 0 holds ranks 0..g-1, machine 1 the next g, and so on.

# %%
nodes, gpus = 2, 3
for nr in range(nodes):
    print(f"node {nr}: local ranks {list(range(gpus))} -> global ranks "
          f"{[ddp_spawn.global_rank(nr, gpus, lr) for lr in range(gpus)]}")
print("world size:", ddp_spawn.check_launch(nodes, gpus, 0, "cpu"))

# %% [markdown]
# ## Sharding, and the padding trap
#
# `DistributedSampler` gives rank `r` every `world_size`-th index of a (shuffled) list. When
# the dataset does not divide evenly, it *pads* the list by repeating its first entries, so that
# every rank gets the same number of batches (otherwise one rank would wait forever in an
# all-reduce the others never start). For training a few repeats do no harm. For
# **evaluation** they do: the repeated samples are counted twice. Look at 5 samples on 2 ranks:

# %%
for rank in range(2):
    s = DistributedSampler(range(5), num_replicas=2, rank=rank, shuffle=False)
    print(f"rank {rank} evaluates samples {list(s)}")

# %% [markdown]
# Sample 0 appears on both ranks: 6 samples counted instead of 5. `evaluate_distributed` knows
# where each index sits in the padded list (`rank`, `rank + world_size`, ...): positions past
# the dataset's length are repeats, and it drops them. Then each rank's `(correct, total)` is
# all-reduced, so every rank reports the accuracy of the *whole* test set, exactly once.
#
# ## Train on two ranks
#
# `run_training` is what each process runs: `ddp_setup`, data, the same seed on every rank,
# `wrap_model` (DDP also broadcasts rank 0's weights), the epochs with `set_epoch`, rank 0's
# checkpoint, the all-reduced evaluation, and `ddp_teardown` in a `finally`. We run it on a
# quarter of Fashion-MNIST to stay quick.

# %%
args = ddp_spawn.build_parser().parse_args(
    ["-g", "2", "--device", "cpu", "--epochs", "1", "--train-limit", "12000",
     "--test-limit", "2001", "--no-progress", "--timeout", "60"])
results = run_distributed(ddp_spawn.run_training, 2, args=(args,), backend=None,
                          timeout=150)
r0, r1 = results
print(f"accuracy on all {r0['total']} test samples: {r0['accuracy']:.4f} "
      f"(rank 1 reports {r1['accuracy']:.4f}); training took {r0['seconds']:.1f}s")
same = all(torch.equal(r0["state"][k], r1["state"][k]) for k in r0["state"])
print("both ranks end with identical weights:", same)

# %% [markdown]
# The two ranks trained on different halves of the data, so their losses differ step by step,
# yet their weights are identical: every step used the average of both gradients.

# %%
plt.figure(figsize=(7, 3.5))
for r in results:
    plt.plot(r["history"], label=f"rank {r['rank']}", alpha=0.8)
plt.xlabel("step")
plt.ylabel("training loss (own shard)")
plt.title("DDP on 2 ranks: different data, same model")
plt.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Effective batch size
#
# With `--batch-size 64` on 2 ranks, one optimizer step averages the gradients of 2 x 64 = 128
# samples: DDP with world size N and per-rank batch B takes the same step as one process with
# batch N x B (the tests check this, weight for weight). An epoch therefore has N times fewer
# steps; if you scale out, consider scaling the learning rate, or keep the global batch fixed
# by shrinking B.
#
# ## The script, and two "nodes" on one machine
#
# From the repository root, `python exercises/03_ddp_spawn/ddp_spawn.py -g 2` starts two
# processes with `mp.spawn`. To rehearse a multi-node job on one machine, open two terminals
# and give both the same port (each "node" has 1 process; `--threads 1` because both share
# the cores):
#
# ```
# python exercises/03_ddp_spawn/ddp_spawn.py -n 2 -g 1 -nr 0 --master-port 29533 --threads 1
# python exercises/03_ddp_spawn/ddp_spawn.py -n 2 -g 1 -nr 1 --master-port 29533 --threads 1
# ```
#
# Node 0 waits until node 1 joins, then both train together; only global rank 0 prints.
