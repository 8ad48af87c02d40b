# %% [markdown]
# # Lesson 05: DDP from scratch
#
# PyTorch's DDP notes say what `DistributedDataParallel` does: every process runs its own
# forward and backward, and the gradients are all-reduced across processes while backward is
# still running. This lesson builds that, one small diff at a time, and checks every step
# against a single process trained on the whole batch and against torch's own DDP.
#
# The three wrappers share one base, `ddp_base.DDPBase` (broadcast of the initial weights,
# `forward`, `no_sync`); each variant adds only how and when it talks. Stuck on a task? The
# lesson folder's `HINTS.md` has hints in increasing detail.
#
# | task | where | what it does |
# |---|---|---|
# | 05.1 | `collectives.ring_all_reduce` | all-reduce from sends and receives around a ring |
# | 05.2 | `ddp_base.broadcast_state` | start every rank from rank 0's parameters and buffers |
# | 05.3 | `NaiveDDP.finish_gradient_synchronization` | all-reduce every gradient, divide by N |
# | 05.4 | `OverlapDDP._register_hooks` | launch an async all-reduce as each gradient is ready |
# | 05.5 | `OverlapDDP.finish_gradient_synchronization` | wait for the handles, then divide |
# | 05.6 | `bucketed_ddp.assign_buckets` | group parameters into buckets, last layer first |
# | 05.7 | `BucketedDDP._register_hooks` | put ready gradients in their bucket; all-reduce a full bucket |
# | 05.8 | `BucketedDDP.finish_gradient_synchronization` | wait, divide, give the gradients their values |
# | 05.9 | `DDPBase.no_sync` | skip the sync for gradient accumulation |
#
# Several processes cannot run functions defined in a notebook (each rank is a fresh process
# that imports the function by name), so every rank runs code from the lesson files, launched
# with `dpt.ranks.run_distributed`: free port, one thread per rank, hard timeout; gloo on the
# CPU, or NCCL when the machine has a GPU per rank. Every rank function puts its tensors on
# `dpt.dist.rank_device()`, so the same code runs in both places.

# %%
from dpt.notebook import bench_result, needs_tasks, use_lesson

use_lesson("05_ddp_from_scratch")

import json

import matplotlib.pyplot as plt

import bucketed_ddp
import collectives
import scratch_demo
from dpt.data import load_tensors, prepare
from dpt.models import ConvNet
from dpt.ranks import run_distributed

# %% [markdown]
# Each cell below runs inside `with needs_tasks(...)`, which names the tasks it uses. A cell
# that reaches a task you have not done yet prints `skipped: this cell needs Task NN.K` instead
# of a traceback, and the rest of the notebook still runs. Cells that compare the wrappers
# have one such block per wrapper: naive and overlapped DDP show up as soon as their tasks are
# done, bucketed DDP joins when yours is. Edits to your lesson files are picked up when you
# re-run a cell.

# %% [markdown]
# ## 1. Collectives by hand
#
# `check_collectives` calls `broadcast`, `all_reduce`, `all_gather` and `reduce_scatter` on
# tiny tensors and asserts the answer on every rank. Read it next to the printout: rank r
# contributes `r + 1` to the all-reduce, `[r, 10 r]` to the all-gather, and receives chunk r of
# the reduce-scatter.

# %%
with needs_tasks():  # torch's own collectives: no task of yours
    for rank, out in enumerate(run_distributed(collectives.check_collectives, world_size=3,
                                               echo=False)):
        print(f"rank {rank}: {out}")

# %% [markdown]
# ## The ring all-reduce (task 05.1)
#
# Cut the tensor into N chunks. For N-1 steps every rank sends one chunk to its right
# neighbour and adds the chunk arriving from its left one (reduce-scatter); after that, rank r
# holds the finished sum of chunk r+1. N-1 more steps pass the finished chunks around
# (all-gather). Each rank sends 2(N-1)/N of the tensor, whatever N is: this is why the ring
# model is `t = a + 2(N-1)/N * bytes / bandwidth`. Here is every step for N = 4 (the same
# figure is `figures/ring_allreduce.svg` in the lesson folder; `figures/ring_diagram.py`
# draws it). A cell is one chunk on one rank, coloured by how many ranks' data it has summed;
# the arrows are the sends of that step, and the red cells what arrived.

# %%
with needs_tasks():
    from figures import ring_diagram

    ring_diagram.draw(n=4)
    plt.show()

# %% [markdown]
# Your `ring_all_reduce` takes these same steps. We time it against `dist.all_reduce` from
# 1 KB to 4 MB here (the script goes to 64 MB) and fit `a` and the bandwidth: dashed, in the
# colour of the points it was fitted to.

# %%
with needs_tasks("05.1"):
    sizes = [2**k for k in range(10, 23, 2)]
    timing = run_distributed(collectives.time_all_reduce, world_size=2, args=(sizes, 3),
                             timeout=300, echo=False)[0]
    for row in timing["rows"]:
        print(f"{row['bytes']:>9d} B  ring {row['ring_s'] * 1e3:7.3f} ms  "
              f"dist.all_reduce {row['torch_s'] * 1e3:7.3f} ms")
    collectives.plot_timings(timing)
    plt.show()

# %% [markdown]
# ## 2-4. Three DDPs, checked against one process
#
# * **naive** (`naive_ddp.py`): broadcast at construction, then one call after `backward()`
#   that all-reduces every gradient and divides by N.
# * **overlap** (`overlap_ddp.py`): a `register_post_accumulate_grad_hook` per parameter
#   launches `dist.all_reduce(grad, async_op=True)` while backward goes on;
#   `finish_gradient_synchronization()` waits.
# * **bucketed** (`bucketed_ddp.py`): the same, but per bucket of gradients. Each bucket owns
#   one flat buffer, allocated once; a gradient is copied into its slice when ready (torch
#   DDP's default), or *is* its slice (`gradient_as_bucket_view=True`), and one all-reduce per
#   bucket sums the buffer in place.
#
# Each rank starts from *different* random weights (seeded by rank), trains on its half of a
# batch of 64 Fashion-MNIST images, and at the end every wrapper must hold the weights of one
# process trained on all 64 from rank 0's start. Every wrapper starts with rank 0's weights
# (task 05.2); a wrapper that reaches a task you have not done yet is skipped alone, and torch
# DDP, which needs none of yours, is always there for comparison.

# %%
with needs_tasks():
    prepare("fashion-mnist", quiet=True)
    x, y = load_tensors("fashion-mnist", train=True, limit=64)
    states = run_distributed(scratch_demo.compare_rank, world_size=2, args=(x, y, 5),
                             timeout=180, echo=False)
    single = scratch_demo.train(scratch_demo.make_model(seed=0), x, y, steps=5).state_dict()


def compare(name):
    """The largest difference between a wrapper's weights, on either rank, and one process's."""
    ranks = scratch_demo.result_of(states, name)  # a task not done yet: skipped
    diff = max((s[k] - v).abs().max().item() for s in ranks for k, v in single.items())
    print(f"{name:24s} max |w - w_single| over both ranks: {diff:.2e}")


with needs_tasks("05.2", "05.3"):
    compare("naive")
with needs_tasks("05.2", "05.4", "05.5"):
    compare("overlap")
with needs_tasks("05.2", "05.6", "05.7", "05.8"):
    compare("bucketed")
    compare("bucketed, grads as views")
with needs_tasks():
    compare("torch DDP")

# %% [markdown]
# ## Buckets (task 05.6)
#
# Backward produces the last layer's gradients first, so buckets are filled from the last
# registered parameter to the first. Here is ConvNet's gradient in buckets of 0.05 MB, of
# 1e-9 MB (smaller than any parameter: one bucket each) and of 25 MB (torch DDP's default:
# the whole model in one bucket):

# %%
with needs_tasks("05.6"):
    convnet = ConvNet()
    named = [(n, p) for n, p in convnet.named_parameters() if p.requires_grad]
    for cap in (0.05, 1e-9, 25):
        buckets = bucketed_ddp.assign_buckets([p for _, p in named], cap)
        print(f"cap {cap} MB -> {len(buckets)} bucket(s), in the order backward fills them:")
        for k, b in enumerate(buckets):
            mb = sum(named[i][1].numel() * named[i][1].element_size() for i in b) / 2**20
            print(f"  bucket {k}: {mb:.3f} MB  {', '.join(named[i][0] for i in b)}")

# %% [markdown]
# ## Backward against the all-reduces: a timeline
#
# What overlap buys, drawn from real steps. `scratch_demo.timeline_rank` trains an MLP with
# big layers (6 x `Linear(1024, 1024)`, 4 MB of gradient each) on 2 CPU ranks with your
# `NaiveDDP`, your `OverlapDDP` and your `BucketedDDP` (9 MB buckets: two or three layers
# each), and records on each rank when each layer's gradients are ready, when each
# all-reduce starts and finishes, and the optimizer step. The three take turns, one step each,
# 7 times, and the picture shows each one's step of median length: one step alone can land
# on a moment when the machine is busy with something else.
#
# Backward computes the layers last to first. Naive starts talking only once backward is
# over. Overlap launches each gradient's all-reduce the moment the gradient is ready;
# bucketed launches one all-reduce per bucket, the moment the bucket's last gradient is in,
# while backward computes the layers below; the step waits only for what is still running,
# so both should be done sooner than naive. (On a 2-core CPU both ranks' compute and gloo's
# threads share the cores, so the overlap is partial, and a busy machine can reverse the
# order: the cell says so when it does. On GPUs, NCCL runs on its own stream.) The lesson's
# README shows the same figure, measured once (`figures/backward_timeline.svg`).

# %%
with needs_tasks():
    from figures import backward_timeline

    measured = backward_timeline.measure(steps=7)


def show(name):
    """One wrapper's measured step, in numbers, on rank 0."""
    run = scratch_demo.result_of(measured["ranks"], name)[0]  # a task not done yet: skipped
    print(f"{name:9s} backward {run['backward'][1]:5.0f} ms, then waits "
          f"{run['sync'][1] - run['sync'][0]:4.0f} ms; step done at {run['step'][1]:4.0f} ms "
          f"(median of {len(run['step_ms'])} steps: {min(run['step_ms']):.0f} to "
          f"{max(run['step_ms']):.0f} ms)")


with needs_tasks("05.2", "05.3"):
    show("naive")
with needs_tasks("05.2", "05.4", "05.5"):
    show("overlap")
with needs_tasks("05.2", "05.6", "05.7", "05.8"):
    show("bucketed")
with needs_tasks("05.2", "05.3"):  # the wrappers measured so far, naive's at least
    backward_timeline.draw(measured)
    plt.show()
    for line in backward_timeline.contradictions(measured):
        print(line)

# %% [markdown]
# ## Bucket buffers: allocated once
#
# A first version of `BucketedDDP` built each bucket with `torch.cat` on every step: a new
# bucket-sized tensor per bucket per step, a copy in, and a copy back out. Keeping one buffer
# per bucket removes the allocation; making `.grad` a view into it
# (`gradient_as_bucket_view=True`) removes both copies, and one copy of the gradients' memory.
# `benchmarks/bench_l05_bucket_buffers.py` counts what each does per step and times them side
# by side; the cell below reads its result (the committed one until you run the script).

# %%
with needs_tasks():
    bb = json.loads(bench_result("l05_bucket_buffers.json").read_text())
    print(f"{bb['config']['grad_bytes'] / 2**20:.1f} MB of gradients, {bb['config']['buckets']} bucket(s); "
          f"time vs cat: the median [lowest, highest] of {bb['config']['repeats']} repeats")
    for name, r in bb["summary"].items():
        print(f"{name:10s} sync allocations {r['sync_alloc_bytes'] / 2**20:5.2f} MB, "
              f"copies {r['sync_copy_bytes'] / 2**20:5.2f} MB per step; time vs cat "
              f"{r['time_vs_cat_median']:.3f} [{r['time_vs_cat_min']:.3f}, {r['time_vs_cat_max']:.3f}]")

# %% [markdown]
# ## 5. `no_sync()`
#
# With gradient accumulation, k micro-batches make one step. Only the last backward needs to
# talk: inside `with model.no_sync():` the gradients just add up locally, and the sync after
# the last micro-batch reduces the sum. Right means: 2 micro-batches with `no_sync` on the
# first give the same weights as one batch twice the size, and no collective is issued
# inside `no_sync()` (the numbers alone cannot show that one, since averaging twice gives the
# same mean).
#
# ## Speed
#
# `benchmarks/bench_l05_scratch_vs_torch.py` times the four wrappers interleaved in one run
# (2 ranks, 1 thread each, ConvNet without batch norm), and splits each step into compute (the
# same step under `no_sync()`) and communication. On the course's idle 2-core CPU, at 512
# images per rank, it measured throughput against torch DDP of **0.96 for naive, 0.99 for
# overlap and 1.02 for bucketed** (medians of 7 repeats; targets: naive >= 0.85, bucketed >=
# 0.95). Repeat by repeat they spread over 0.88-1.07, 0.91-1.04 and 0.92-1.08: naive met its
# target every time, bucketed missed it in 1 of 7, and the order changed from repeat to repeat.
# The split is the lesson in one picture: in the medians, naive waits about 36 ms per step for
# its all-reduce after backward, as long as torch DDP; overlap and bucketed hide all but 3-4 ms
# of it behind backward. With 0.1 MB of gradients against 0.65 s of compute per step, the
# differences are a few percent, within the run-to-run noise: a single repeat's step minus its
# compute-only step ranged from -104 to +126 ms. The cell below draws the committed result file
# (or yours, once you rerun the script): on one axis the communication is a sliver on top of
# the compute, so the right panel shows it alone, on its own scale.

# %%
with needs_tasks():
    speed = json.loads(bench_result("l05_scratch_vs_torch.json").read_text())
    for name, r in speed["summary"].items():
        print(f"{name:9s} compute {r['compute_s'] * 1e3:6.1f} ms, communication + waiting "
              f"{r['comm_s'] * 1e3:5.1f} ms: compute is {r['compute_s'] / max(r['comm_s'], 1e-9):4.0f}x "
              "as long")
    scratch_demo.plot_step_split(speed)
    plt.show()
