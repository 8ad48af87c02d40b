# %% [markdown]
# # Lesson 02: `nn.DataParallel`, and DataParallel by hand
#
# Data parallelism in its oldest form: **one process, several devices**. Every forward splits
# the batch over the devices, runs a copy of the model on each, and collects the outputs on the
# first one. You write the four steps yourself in `dp_by_hand.py`, then use torch's wrapper in
# `data_parallel.py`, and finally time it in `dp_timing.py`:
#
# | task | where | what it does |
# |---|---|---|
# | 02.1 | `scatter` | split the batch along dimension 0, keeping the short last chunk |
# | 02.2 | `replicate` | N replicas wired to copies of the root's weights; replica 0 shares its buffers |
# | 02.3 | `Broadcast.backward` | sum the replicas' gradients back onto the root's weights |
# | 02.4 | `parallel_apply` | one thread per replica, outputs in order |
# | 02.5 | `gather` | concatenate the outputs on the root |
# | 02.6 | `DataParallelByHand.forward` | the four steps together |
# | 02.7 | `wrap` | root device first, then `nn.DataParallel` |
# | 02.8 | `save_plain` / `load_plain` | a checkpoint through `.module` that loads into a plain model |
# | 02.9 | `time_forward` | warm-up, synchronize, median |

# %%
from dpt.notebook import needs_tasks, use_lesson

use_lesson("02_data_parallel")

import copy
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

import data_parallel as dpl
import dp_by_hand as dbh
import dp_timing
from dpt.data import make_loader, prepare
from dpt.dist import cpu_budget
from dpt.models import MLP, ConvNet

# %% [markdown]
# Each cell below runs inside `with needs_tasks(...)`, which names the tasks it uses. A cell
# that reaches a task you have not done yet prints `skipped: this cell needs Task NN.K` instead
# of a traceback, and the rest of the notebook still runs. Edits to your lesson files are
# picked up when you re-run a cell.

# %% [markdown]
# ## `nn.DataParallel` on this machine
#
# The wrapper takes `device_ids` (default: every visible GPU). The model goes to the root
# device, `device_ids[0]`, *before* wrapping, and so does each batch: DataParallel scatters
# from there. What it does depends on how many GPUs there are, so let the code say it:

# %%
with needs_tasks():
    print(dpl.explain_devices())
    print("GPUs:", dpl.gpu_count(), "| cores:", cpu_budget())

# %% [markdown]
# Without GPUs, the wrapper has an empty device list, and its `forward` is `self.module(x)`:
# the training below is lesson 01's, with a wrapper around it. That is deliberate. The same
# lines split each batch over the GPUs of a multi-GPU machine, and nothing in the loop changes:
# the loss is the mean over the *gathered* batch, computed on the root, and `backward()` sums
# the replicas' gradients into the root's parameters, where the optimizer steps.

# %%
with needs_tasks("02.7"):
    prepare("fashion-mnist")
    torch.manual_seed(0)
    train = make_loader("fashion-mnist", train=True, batch_size=64, seed=0)
    test = make_loader("fashion-mnist", train=False, batch_size=500, limit=2000)  # a quick look
    dp_model, root = dpl.wrap(ConvNet())
    optimizer = torch.optim.SGD(dp_model.parameters(), lr=0.05, momentum=0.9)
    losses, start = [], time.perf_counter()
    for i, batch in enumerate(train):
        if i == 40:
            break
        losses.append(dpl.train_step(dp_model, batch, optimizer, root))
    print(f"{len(losses)} steps in {time.perf_counter() - start:.1f}s on {root}, "
          f"test accuracy {dpl.accuracy(dp_model, test, root):.4f}")

# %% [markdown]
# ### Save through `.module`
#
# `dp_model.state_dict()` has every key prefixed with `module.`, and a plain model refuses it.
# Save `dp_model.module.state_dict()` and the checkpoint loads anywhere, wrapped or not.

# %%
with needs_tasks("02.7", "02.8"):
    print("wrapper keys:", list(dp_model.state_dict())[:2])
    with tempfile.TemporaryDirectory() as tmp:
        path = dpl.save_plain(dp_model, Path(tmp) / "dp.pt", epoch=1)
        plain = ConvNet()
        dpl.load_plain(path, plain)
        print("plain model after reload: accuracy", f"{dpl.accuracy(plain, test, torch.device('cpu')):.4f}")

# %% [markdown]
# ## DataParallel by hand
#
# Here are the four steps, drawn for 3 devices and a batch of 7 (the same figure is
# `figures/data_parallel.svg` in the lesson folder; `figures/dp_diagram.py` draws it):

# %%
with needs_tasks():
    from figures import dp_diagram

    dp_diagram.draw(n=3, batch=7)
    plt.show()

# %% [markdown]
# You write each step as a function: `scatter`, `replicate`, `parallel_apply`, `gather`.
# With no GPU we use one thread per replica, and each thread gets `cores // N` intra-op
# threads, so that N replicas do not oversubscribe the cores. Torch releases the GIL inside its kernels, so the replicas really do run at the
# same time. On CUDA the same functions call torch's `nn.parallel` primitives.

# %%
with needs_tasks("02.1", "02.2", "02.4", "02.5"):
    x = torch.randn(7, 1, 28, 28)
    chunks = dbh.scatter(x, 3)
    print("scatter 7 samples over 3:", [len(c) for c in chunks])
    model = ConvNet(batch_norm=False)
    replicas = dbh.replicate(model, len(chunks))
    print("replica 0 weight is a leaf?", replicas[0].fc.weight.is_leaf,
          "| grad_fn:", type(replicas[0].fc.weight.grad_fn).__name__)
    outs = dbh.parallel_apply(replicas, chunks)
    print("gathered:", tuple(dbh.gather(outs).shape))

# %% [markdown]
# The replicas' weights are not leaves: they are outputs of `Broadcast`, whose backward *sums*
# the N gradients onto the root's weights. Summing is right because the loss is the mean over
# the full batch. Each replica's gradient is its chunk's share of that mean, so the shares add
# up to the full-batch gradient. Averaging them would divide the gradient by N. Let us check
# against one model on the full batch, with an uneven split:

# %%
with needs_tasks("02.1", "02.2", "02.3", "02.4", "02.5", "02.6"):
    torch.manual_seed(0)
    model = ConvNet(batch_norm=False)
    single = copy.deepcopy(model)
    x, y = torch.randn(10, 1, 28, 28), torch.randint(0, 10, (10,))
    dp = dbh.DataParallelByHand(model, n_replicas=3)  # chunks of 4, 4, 2
    F.cross_entropy(dp(x), y).backward()
    F.cross_entropy(single(x), y).backward()
    worst = max((p.grad - q.grad).abs().max().item()
                for p, q in zip(model.parameters(), single.parameters()))
    print(f"largest gradient difference vs. one model on the full batch: {worst:.1e}")

# %% [markdown]
# ## The caveats
#
# **State changed in `forward` is lost.** Replicas are rebuilt on every forward and thrown
# away after it. A counter kept as a Python attribute never moves on the root. A buffer updated
# in place moves only through replica 0, because replica 0 shares the root's buffers (torch
# guarantees this for `device_ids[0]`), so it counts forwards, not samples or replicas.

# %%
with needs_tasks("02.1", "02.2", "02.4", "02.5", "02.6"):
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.python_calls = 0
            self.register_buffer("buffer_calls", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.python_calls += 1
            self.buffer_calls += 1
            return self.lin(x)


    counting = Counting()
    wrapped = dbh.DataParallelByHand(counting, n_replicas=3)
    for _ in range(4):
        wrapped(torch.randn(6, 4))
    print(f"4 forwards x 3 replicas: python counter {counting.python_calls}, "
          f"buffer counter {counting.buffer_calls.item()}")

# %% [markdown]
# What to do instead: compute anything that must see the whole batch, or persist across steps,
# on the root, from the gathered outputs, after the forward. Lightning 1.x had a hook for
# exactly this, `training_step_end(outputs)`. It ran on the root with all replicas' outputs,
# which is where a softmax over the full batch or a torchmetrics update belonged. Lightning 2.x
# removed both the hook and the `dp` strategy. Use DDP (lesson 03), where every process keeps
# its own model and nothing is rebuilt.
#
# **Batch norm.** Each replica normalizes with the mean and variance of its own chunk, not of
# the whole batch. The running statistics kept for evaluation come from replica 0's chunk only:
# the other replicas update clones that are then thrown away.

# %%
with needs_tasks("02.1", "02.2", "02.4", "02.5", "02.6"):
    torch.manual_seed(0)
    bn_model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    xb = torch.randn(12, 4) + torch.linspace(-3, 3, 12)[:, None]  # chunks differ on purpose
    dbh.DataParallelByHand(bn_model, n_replicas=3)(xb)
    first_only = copy.deepcopy(bn_model)
    first_only[1].reset_running_stats()
    first_only(xb[:4])
    full = copy.deepcopy(bn_model)
    full[1].reset_running_stats()
    full(xb)
    print("root running_mean   ", bn_model[1].running_mean)
    print("from chunk 0 only   ", first_only[1].running_mean)
    print("from the full batch ", full[1].running_mean)

# %% [markdown]
# What to do instead: use large enough chunks per device, or `nn.SyncBatchNorm` with DDP, which
# computes the statistics over all devices. Or choose a model without batch norm (group norm,
# layer norm).
#
# ## The timing study
#
# Does splitting the batch make inference faster? `time_forward` does warm-up runs first,
# synchronizes the device before each clock read, and takes the median of repeats. On a
# machine with two or more GPUs a device is a GPU, and we compare one GPU with
# `nn.DataParallel` and with your `DataParallelByHand` over all of them. Otherwise a "device"
# is a share of the CPU cores, `cores // N` threads, and we compare one device, N devices by
# hand, and one model given all the threads (the CPU's own intra-op parallelism).
# `dp_timing.resolve_devices()` picks N, and refuses an N the machine does not have. The full
# sweep is `.venv/bin/python solutions/02_data_parallel/dp_timing.py`. This one is small so
# that the notebook stays quick.

# %%
with needs_tasks("02.1", "02.2", "02.4", "02.5", "02.6", "02.7", "02.9"):
    n = dp_timing.resolve_devices()  # every GPU when there are two or more, else every core
    print(f"N = {n} devices")
    result = dp_timing.sweep([1, 8, 64], n, model_name="convnet", warmup=2, repeats=3)
    fig = dp_timing.plot(result)
    plt.show()
    for name, secs in result["lines"].items():
        print(f"{name:42s}", "  ".join(f"{1000 * s:7.1f} ms" for s in secs))

# %% [markdown]
# **Why DataParallel can be slower for small batches.** Every forward pays a fixed cost before
# any useful work: the weights are copied to every device (the replicas are rebuilt on each
# call), the batch is split and sent out, N threads start, and the outputs are gathered onto
# one device. That cost does not shrink with the batch. With a batch of a few samples, each
# device gets too little work to be busy, and the overhead wins: N devices lose to one. As the
# batch grows, compute grows with it and the overhead stays the same, so the split pays off and
# approaches N× faster. In 5 runs of the README's quick command (FashionCNN) on an idle 2-core
# CPU, by hand was 7 to 11x slower at batch 1 and 1.5 to 2.4x faster at batch 256 (noise can
# even carry it past N). Where the lines cross moves with the model and the load, so this
# small sweep (the ConvNet, up to 64) may not reach it. The shape of the curve is the lesson.
# DDP (next lesson) removes most of that fixed cost: its replicas live for the whole run, and
# only gradients cross between devices.
