# %% [markdown]
# # Lesson 09: FSDP by hand, FSDP2 in practice, and sharded checkpoints
#
# Lesson 08 left the parameters whole on every rank, or let `fully_shard` shard them for you.
# Here you shard them yourself. Each rank keeps 1/N of every parameter, as fp32 "master"
# weights, and a transformer block's whole weights exist only while that block computes. This
# is the design of PyTorch's FSDP and of the ZeRO-3 stage in Rajbhandari et al. It is also the
# FSDP that Stanford's CS336 systems assignment asks students to write.
#
# Then you measure what it buys: the peak memory of one step, predicted and measured. You cut
# the activations with checkpointing, and you use FSDP2 and `torch.distributed.checkpoint` as
# a real training job does.
#
# | part | tasks | file |
# |---|---|---|
# | FSDP by hand: shard, gather with prefetch, free, reduce-scatter | 09.1-09.12 | `fsdp_by_hand.py` |
# | the peak of one step, predicted and measured | 09.13 | `memory_table.py` |
# | activation checkpointing | 09.14-09.16 | `activation_checkpointing.py` |
# | FSDP2 as practitioners use it | 09.17-09.20 | `fsdp2_practice.py` |
# | sharded checkpoints with DCP, resumed at another N | 09.21-09.23 | `dcp_checkpoint.py` |

# %%
from dpt.notebook import bench_result, needs_tasks, use_lesson

use_lesson("09_fsdp")

import json
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import activation_checkpointing as ac
import dcp_checkpoint as dc
import fsdp2_practice as fp
import memory_table as mt
import schedule
from dpt.checkpoint import CheckpointError, check_dcp_checkpoint
from dpt.models import TinyTransformer
from dpt.precision import DTYPES, low_precision_for
from dpt.ranks import placement, run_distributed
from fsdp_by_hand import train_worker

MiB = 2**20

# %% [markdown]
# Each cell below runs inside `with needs_tasks(...)`, which names the tasks it uses. A cell
# that reaches a task you have not done yet prints `skipped: this cell needs Task NN.K` instead
# of a traceback, and the rest of the notebook still runs. Edits to your lesson files are
# picked up when you re-run a cell. The ranks run functions from the lesson's files, started
# by `run_distributed`: a notebook cannot hand functions defined in a cell to fresh processes.
#
# ## 1. FSDP by hand
#
# The model is lesson 09's `TinyTransformer`: token and position embeddings, 4 equal blocks
# (causal attention and an MLP), a norm and a head, on synthetic tokens whose next token
# follows a rule, so the loss can fall. Each block is one *unit*, and the rest of the model is
# the *root* unit. A unit keeps its parameters as one flat fp32 vector, zero-padded to a
# multiple of N, and this rank holds one chunk of it (09.1). Per step and unit:
#
# - **forward**: the all-gather is issued (09.2), the modules compute on views of the gathered
#   vector (09.3), and then it is freed (09.4). With prefetch, the next unit's gather is issued
#   before this one computes (09.7).
# - **backward**: the unit is gathered again (09.8, 09.9). Once its whole gradient is in (09.6),
#   the gradient is averaged and reduce-scattered into this rank's shard (09.5, 09.10).
# - after `loss.backward()`, `finish_grad_sync()` waits for the last reduce-scatters (09.11),
#   and AdamW steps the shards.
#
# Your FSDP on 2 ranks, in fp32 and with the blocks computing in 16 bits: bf16, or fp16 on a
# GPU older than compute capability 8 (a T4), where bf16 is emulated
# (`dpt.precision.low_precision_for`). The shards stay fp32; only the gathered copies are cast.

# %%
with needs_tasks("09.1", "09.2", "09.3", "09.4", "09.5", "09.6", "09.7", "09.8", "09.9",
                 "09.10", "09.11"):
    where = placement(2)
    low = low_precision_for(where.device)  # "bf16", or "fp16" where bf16 is emulated
    runs = {}
    for name in ("fp32", low):
        runs[name] = run_distributed(train_worker, world_size=2, timeout=240, echo=False,
                                     kwargs={"steps": 10, "compute_dtype": DTYPES[name]})
    print(f"2 ranks: {where.label}")
    print(f"step  fp32 loss  {low} loss")
    for i, (a, b) in enumerate(zip(runs["fp32"][0]["losses"], runs[low][0]["losses"])):
        print(f"{i:4d}  {a:9.4f}  {b:9.4f}")
    for r in runs["fp32"]:
        print(f"rank {r['rank']} holds {r['memory']['shards'] / 1024:.0f} KiB of fp32 shards "
              f"(the model: {sum(p.numel() for p in TinyTransformer().parameters()) * 4 / 1024:.0f}"
              f" KiB), {r['memory']['gathered'] / 1024:.0f} KiB gathered between steps")

# %% [markdown]
# Does it compute what one process would? `gather_full_params()` (09.12) puts the shards back
# together by name. After the same steps on the same data, the weights of your FSDP on 2
# ranks and those of one process differ only by the order of float additions.

# %%
with needs_tasks("09.1", "09.2", "09.3", "09.4", "09.5", "09.6", "09.7", "09.8", "09.9",
                 "09.10", "09.11", "09.12"):
    from fsdp_by_hand import compare_with_one_process

    gap = compare_with_one_process(world_size=2, steps=3)
    print(f"largest |w_fsdp - w_one_process| over every parameter after 3 AdamW steps: {gap:.1e}")

# %% [markdown]
# ## 2. The schedule, measured
#
# `schedule.record_step` runs a few steps and records when each gather, compute, free and
# reduce-scatter happened on each rank. Green bars are all-gathers in flight, grey is compute
# waiting on one, and red ticks are frees. With prefetch, the next block's gather runs while
# this one computes, so the grey shrinks: in 5 runs of `schedule.py` on an idle 2-core VM, to
# 0.21-0.48 times as long as without it (one step each, so the figure varies; the order held
# in all 5). The times below are from this machine as it is now (the median of 3 runs in the
# printout, with the fastest and slowest). On the CPU they are the host's clock; on a GPU they
# are read from the device (CUDA events on the compute stream), so a gather ends when its
# kernels finished, not when it was queued, and grey is the time the compute stream sat
# waiting. gloo reports some collectives' end only when someone waits on them, so a hatched
# bar ends where it was seen, not where it ended. Both panels share one time axis.

# %%
with needs_tasks("09.1", "09.2", "09.3", "09.4", "09.5", "09.6", "09.7", "09.8", "09.9",
                 "09.10", "09.11"):
    waits = {}
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for ax, prefetch in zip(axes, (True, False)):
        per_step = [schedule.record_step(2, prefetch=prefetch, steps=3) for _ in range(3)]
        waits[prefetch] = sorted(schedule.summary(ev[0])["waiting"] for ev in per_step)
        schedule.draw(per_step[-1], ax=ax, title=f"prefetch {'on' if prefetch else 'off'}")
    plt.tight_layout()
    plt.show()
    on, off = waits[True], waits[False]

    def ms(w):
        return f"{w[1] * 1e3:.1f} ms ({w[0] * 1e3:.1f} to {w[-1] * 1e3:.1f})"

    print(f"rank 0 blocked on all-gathers ({schedule.clock_of(per_step[-1][0])}), median "
          f"(fastest to slowest) of 3 runs: prefetch on {ms(on)}, off {ms(off)}")
    if on[1] >= off[1] and on[0] <= off[-1]:
        print("the runs overlap: with this much spread between runs the difference is noise "
              "(a busy machine shifts these times); re-run the cell")
    elif on[1] >= off[1]:
        print("this measurement contradicts the text: in every run prefetch waited at least "
              "as long; look at the picture for gathers longer than the compute they should "
              "hide behind")

# %% [markdown]
# ## 3. The peak of one step, predicted and measured
#
# Lesson 08 counted what a rank keeps between steps. During a step it holds more for a
# moment: the activations, DDP's gradient buckets, or, under FSDP, the units it has gathered
# and their full gradients. `memory_table.predict_peak` adds them up for each method (09.13,
# with the activations of 09.14-09.15). `dpt.memory.MemoryTracker` counts the bytes of every
# live tensor as the step runs, because torch keeps no allocator statistics on the CPU.
#
# The prediction starts from what a rank keeps between steps, your `predict_bytes` of lesson
# 08 (Task 08.1), so these two cells run it: `earlier=("08.1",)` says so. Until it is done in
# your tree, they show the course's reference run of the same table, and say so in one line.

# %%
def reference_rows(methods, sizes):
    """What shows the rows of ``methods`` at ``sizes`` from the course's run of this table."""
    return lambda path: print(mt.format_rows([
        r for r in json.loads(path.read_text())["table"]
        if r["method"] in methods and r["world_size"] in sizes]))


with needs_tasks("09.13", "09.14", "09.15", earlier=("08.1",), reference="l09_memory.json",
                 show=reference_rows(("ddp", "fsdp2"), (2,))):
    units = mt.units_of(TinyTransformer(**mt.CONFIG))  # the root unit first, then each block
    acts = mt.predicted_activations(batch=1)  # one sequence of 64 tokens per rank
    print(f"{sum(units):,} parameters; root unit {units[0]:,}, blocks {units[1]:,} each; "
          f"activations {acts / MiB:.2f} MiB per rank")
    measured = {(m, 2): run_distributed(mt.measure_worker, world_size=2, timeout=120,
                                        kwargs={"method": m, "batch": 1}, echo=False)
                for m in ("ddp", "fsdp2")}
    print(mt.format_rows(mt.table_rows(measured, batch=1)))

# %%
with needs_tasks("09.1", "09.2", "09.3", "09.4", "09.5", "09.6", "09.7", "09.8", "09.9",
                 "09.10", "09.11", "09.13", "09.14", "09.15", earlier=("08.1",),
                 reference="l09_memory.json", show=reference_rows(("fsdp",), (2, 4))):
    measured = {("fsdp", n): run_distributed(mt.measure_worker, world_size=n, timeout=120,
                                             kwargs={"method": "fsdp", "batch": 1}, echo=False)
                for n in (2, 4)}
    print("your FSDP:")
    print(mt.format_rows(mt.table_rows(measured, batch=1)))
    for n in (2, 4):  # with fewer GPUs than ranks, the ranks share them (gloo)
        print(f"N={n}: {placement(n).label}")

# %% [markdown]
# Every method at N = 2 and N = 4, from `benchmarks/bench_l09_memory.py`. This is your latest
# run once you have made one, and the committed reference until then.

# %%
with needs_tasks():
    result = json.loads(bench_result("l09_memory.json").read_text())
    for row in result["table"]:
        p, m = row["predicted"], row["measured"]
        print(f"N={row['world_size']} {row['label']:<22} peak predicted {p['peak'] / MiB:5.2f} MiB,"
              f" measured {m['peak'] / MiB:5.2f} MiB")
    from IPython.display import Image, display

    display(Image(filename=str(bench_result("l09_memory.png"))))

# %% [markdown]
# ## 4. Activation checkpointing
#
# The model here has 8 blocks and 4 sequences of 256 tokens, so the activations outweigh the
# model many times over. Checkpointed (09.16), each block keeps only its input and runs its
# forward again in backward: memory for compute. The bytes are the same on every run; the time
# is not. In the README's run (8 sequences per rank, 2 ranks, 5 launches on an idle 2-core
# CPU) a checkpointed step took 1.09-1.55 times as long (median 1.23); this cell's one launch
# varies more, most of all on a busy machine.

# %%
with needs_tasks("09.14", "09.15", "09.16"):
    size = {"batch": 4, "seq_len": 256, "layers": 8}
    r = run_distributed(ac.compare_worker, world_size=1, timeout=120,
                        kwargs={**size, "steps": 3}, echo=False)[0]
    for key in ("plain", "checkpointed"):
        predicted = ac.model_activation_bytes(size["batch"], size["seq_len"], layers=size["layers"],
                                              checkpointed=key == "checkpointed")
        print(f"{key:>12}: activations predicted {predicted / MiB:5.1f} MiB, peak measured "
              f"{r[key]['peak'] / MiB:5.1f} MiB, {r[key]['step_s'] * 1e3:4.0f} ms a step")

# %% [markdown]
# ## 5. FSDP2 as practitioners use it
#
# A real job builds the model on the meta device, which gives it shapes but no memory. It
# shards each block and then the root (09.17), lists what each block prefetches (09.18), and
# only then gives each rank memory for its own shards and initialises them (09.19). No rank
# ever holds the whole model. Every rank trains on its slice of one global batch (09.20).
#
# FSDP2 and your FSDP train the same model on the same batches. The fp32 rows have the same
# losses, and bf16 stays close: the "gap" column, 1.3e-3 on the course's CPU (a CPU with native
# bf16 rounds differently; the test allows 2e-2). "held" is what a rank holds whole between
# forward and backward, and "peak" is the first step's peak of tensor bytes.

# %%
with needs_tasks("09.1", "09.2", "09.3", "09.4", "09.5", "09.6", "09.7", "09.8", "09.9",
                 "09.10", "09.11", "09.17", "09.18", "09.19", "09.20"):
    rows = fp.compare(world_size=2, steps=5)
    print(fp.format_rows(rows))

# %% [markdown]
# `reshard_after_forward=False` keeps each block's gathered weights from its forward to its
# backward. That saves one all-gather per block and costs their memory:

# %%
with needs_tasks("09.1", "09.2", "09.3", "09.4", "09.5", "09.6", "09.7", "09.8", "09.9",
                 "09.10", "09.11", "09.17", "09.18", "09.19", "09.20"):
    pick = {r["run"]: r for r in rows}
    on, off = pick["FSDP2 fp32"], pick["FSDP2 fp32, no reshard"]
    fig, ax = plt.subplots(figsize=(5, 3))
    for r, c in ((on, "C0"), (off, "C1")):
        ax.scatter(r["step_ms"], r["held_after_forward"] / 1024, color=c, label=r["run"])
    ax.set(xlabel=f"ms per step (rank 0; 2 ranks, {placement(2).label})",
           ylabel="KiB held whole after forward", title="reshard_after_forward: memory against time")
    ax.legend(fontsize=8)
    plt.show()
    print(f"resharding frees {(off['held_after_forward'] - on['held_after_forward']) / 1024:.0f} "
          f"KiB between forward and backward; peak {on['peak'] / 1024:.0f} vs "
          f"{off['peak'] / 1024:.0f} KiB (one step's time is noise on a busy machine)")

# %% [markdown]
# ## 6. Sharded checkpoints with DCP
#
# Every rank writes its own shards of the model and of Adam's state into one folder, at the
# same time (09.21). The folder's `.metadata` records which piece of which tensor lies where,
# so any number of ranks can load it (09.22). Here one checkpoint is saved at 2 ranks after
# step 3 and resumed at 1, 2 and 4 ranks. The last column says where each run's ranks
# computed: on a machine with fewer GPUs than ranks, they share the GPUs with gloo.

# %%
with needs_tasks("09.17", "09.18", "09.19", "09.20", "09.21", "09.22"):
    for row in dc.resume_demo(world_sizes=(1, 2, 4), steps=6, save_at=3):
        print(f"{row['run']:<28} {' '.join(f'{v:.6f}' for v in row['losses'])}   "
              f"largest gap {row['max_gap']:.1e}   {row['ranks']}")

# %% [markdown]
# A save cut short leaves no `.metadata`. The check fails in one line on every rank, instead
# of a long traceback from deep inside DCP. For inference, `export_full` (09.23) gathers one
# whole state dict to the CPU, which loads into a plain `TinyTransformer`.

# %%
with needs_tasks("09.17", "09.18", "09.19", "09.20", "09.21", "09.23"):
    tmp = Path(tempfile.mkdtemp())
    run_distributed(dc.train_worker, world_size=2, timeout=240, echo=False,
                    kwargs={"steps": 60, "save_at": 2, "folder": str(tmp / "step2"),
                            "export": str(tmp / "full.pt")})
    (tmp / "step2" / ".metadata").unlink()  # as if the save had been cut short
    try:
        check_dcp_checkpoint(tmp / "step2")
    except CheckpointError as exc:
        print("CheckpointError:", exc)
    model = dc.load_for_inference(tmp / "full.pt")  # a plain TinyTransformer
    x, y = fp.global_batch(100)
    print(f"next-token accuracy of the exported model: "
          f"{(model(x).argmax(-1) == y).float().mean():.2f}")

# %% [markdown]
# ## What you built
#
# - FSDP by hand: each rank keeps 1/N of every parameter, gathers just in time with prefetch,
#   reduce-scatters gradients into fp32 shards, and equals one process step by step.
# - The peak of a step, predicted to within 9% for every sharding method (the reference run,
#   N = 2 and 4: measured from 8.4% below the prediction to 4.5% above it).
# - Activation checkpointing: the activations cut to one block plus the inputs, for one more
#   forward per block.
# - FSDP2 with meta-device initialisation, mixed precision and prefetch, and DCP checkpoints
#   that resume at any world size.
#
# `make benchmark` times `fsdp_by_hand_bf16` and `fsdp2_bf16` from 1 to N ranks (lesson 14
# reads the results).
