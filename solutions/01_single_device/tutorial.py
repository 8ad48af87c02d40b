# %% [markdown]
# # Lesson 01: training on one device
#
# Before we spread training over many devices we need a loop worth spreading. This lesson
# builds it in `single_device.py`, a `Trainer` in the shape of `single_gpu.py` from PyTorch's
# DDP tutorial series. Lessons 03 and 04 grow this same file (each has a `CHANGES.diff`):
#
# | task | function | what it does |
# |---|---|---|
# | 01.1 | `Trainer._run_batch` | one optimization step on a batch |
# | 01.2 | `evaluate` | count correct answers over *every* test sample |
# | 01.3 | `save_checkpoint` / `load_checkpoint` | model, optimizer and epoch, safe from a crash mid-save |
#
# Run `make grade` to see which tasks pass; `HINTS.md` in the lesson folder helps when you are
# stuck. This notebook calls your code from `exercises/01_single_device/`.

# %%
from dpt.notebook import dataset_label, needs_tasks, use_lesson

use_lesson("01_single_device")

import time

import matplotlib.pyplot as plt
import torch

import single_device as sd
from dpt.data import is_present, make_loader, prepare
from dpt.device import pick_device
from dpt.models import ConvNet, count_parameters

# %% [markdown]
# Each cell below runs inside `with needs_tasks(...)`, which names the tasks it uses. A cell
# that reaches a task you have not done yet prints `skipped: this cell needs Task NN.K` instead
# of a traceback, and the rest of the notebook still runs. Edits to your lesson files are
# picked up when you re-run a cell.

# %% [markdown]
# ## One device, whichever it is
#
# Nothing in `single_device.py` says `cuda`. `pick_device("auto")` returns CUDA when there is a
# GPU, then Apple's MPS, then the CPU, and every tensor follows that `device`. Asking for a
# device the machine lacks (`--device cuda` on a laptop) is an error with one clear line,
# not a crash deep inside torch.

# %%
with needs_tasks():
    device = pick_device("auto")
    print("device:", device, "| CPU threads:", torch.get_num_threads())
    # MNIST, as the tutorials this course grew from, when `make data` fetched it; else
    # Fashion-MNIST, which `make test` always provides (`--dataset` picks one in the scripts).
    DATASET = "mnist" if is_present("mnist") else "fashion-mnist"
    prepare(DATASET)  # only what is on disk: a missing dataset is one line naming `make data`
    print("dataset:", DATASET)

# %% [markdown]
# **Two datasets.** MNIST (handwritten digits) is what the source tutorials train on, and the
# scripts' default: the ConvNet gets about 98% in one epoch, so it is nearly solved and
# differences between methods hide in the last percent. Fashion-MNIST (clothes, same 28x28
# format) is harder: about 88% after one epoch, which leaves room to see a difference. Every
# script takes `--dataset mnist` or `--dataset fashion-mnist`.

# %% [markdown]
# ## Two ways to feed the model
#
# Most tutorials use torchvision's dataset with a `DataLoader`: every sample is a PIL image turned
# into a tensor and normalized, one at a time. Fashion-MNIST is 47 MB as bytes, so the course
# also keeps a *fast path*: the whole split as one normalized tensor, batched by index. Same
# numbers, far less Python per sample. Let us time one pass of 100 batches of each.

# %%
with needs_tasks():
    def time_batches(loader, n=100):
        start = time.perf_counter()
        for i, _ in enumerate(loader):
            if i + 1 == n:
                break
        return time.perf_counter() - start


    classic = make_loader(DATASET, train=True, batch_size=64, fast=False, seed=0)
    fast = make_loader(DATASET, train=True, batch_size=64, fast=True, seed=0)
    t_classic, t_fast = time_batches(classic), time_batches(fast)
    print(f"100 batches: DataLoader {t_classic:.2f}s, tensors {t_fast:.3f}s "
          f"({t_classic / t_fast:.0f}x faster)")

# %% [markdown]
# ## Train
#
# The ConvNet is the one of the tutorial *Distributed data parallel training in PyTorch*: two
# blocks of convolution, batch norm, ReLU and max-pooling, then a linear layer. We train on 400
# batches here to stay quick; the full epoch (`python single_device.py --epochs 1`) took 26 s
# on an idle 2-core CPU (the whole command 35 s), longer on a busy one.

# %%
with needs_tasks("01.1"):
    torch.manual_seed(0)
    model = ConvNet()
    print(f"ConvNet: {count_parameters(model):,} parameters")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = sd.Trainer(model, fast, optimizer, device)
    start = time.perf_counter()
    trainer.train(max_epochs=1, limit_batches=400)
    print(f"400 steps in {time.perf_counter() - start:.1f}s")

# %%
with needs_tasks("01.1"):  # the loss of every step the cell above trained
    window = 20
    smooth = torch.tensor(trainer.history).unfold(0, window, 1).mean(1)
    plt.figure(figsize=(6, 3))
    plt.plot(trainer.history, alpha=0.3, label="loss per step")
    plt.plot(range(window - 1, len(trainer.history)), smooth, label=f"mean of {window}")
    plt.xlabel("step")
    plt.ylabel("cross-entropy")
    plt.legend()
    plt.title(f"ConvNet on {dataset_label(DATASET)}, {len(trainer.history)} steps")
    plt.show()

# %% [markdown]
# ## Evaluate: count, then divide
#
# `evaluate` returns `(correct, total)` rather than a ratio. Averaging per-batch accuracies is
# wrong whenever the last batch is short, and in lesson 03 each rank will hold counts for its
# own shard of the test set: counts add across ranks, ratios do not.

# %%
with needs_tasks("01.2"):
    test = make_loader(DATASET, train=False, batch_size=1000)
    correct, total = sd.evaluate(model, test, device)
    print(f"{dataset_label(DATASET)} test accuracy after {len(trainer.history)} training steps: "
          f"{correct / total:.4f} ({correct}/{total})")

# %% [markdown]
# ## Checkpoint, and load into a fresh model
#
# A checkpoint holds the model, the optimizer (momentum is state too) and the epoch, so that
# training can resume where it stopped. It is written to a temporary file and renamed, so a
# crash mid-save leaves the previous checkpoint intact.
#
# A new model is built on the CPU. `evaluate` sends the test batches to `device`, so the model
# goes there first, as the `Trainer` does with its own: on a GPU, CUDA batches meeting CPU
# weights stop with "Input type (torch.cuda.FloatTensor) and weight type (torch.FloatTensor)
# should be the same".

# %%
with needs_tasks("01.2", "01.3"):  # evaluates, as the cell above
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = sd.save_checkpoint(Path(tmp) / "convnet.pt", model, optimizer, epoch=1)
        fresh = ConvNet().to(device)
        epoch = sd.load_checkpoint(path, fresh, device=device)["epoch"]
        print(f"reloaded epoch {epoch}; accuracy {sd.evaluate(fresh, test, device)[0] / total:.4f}")

# %% [markdown]
# ## What comes next
#
# One step of this loop is: forward, backward, update. Data parallelism runs that step on N
# devices, each on its own slice of the batch, and makes sure the N copies of the model stay
# the same. Lesson 02 does it inside one process with `nn.DataParallel`; lesson 03 with one
# process per device.
