# %% [markdown]
# # Lesson 06: mixed precision, from Apex's amp to `torch.amp`
#
# The 'Distributed data parallel training in PyTorch' tutorial ends with "a bonus": mixed-precision DDP with NVIDIA Apex,
# `amp.initialize(model, optimizer, opt_level='O2')` and `with amp.scale_loss(...)`. Apex's
# amp now lives inside PyTorch as `torch.amp`. This lesson explains why mixed precision works,
# adds it to lesson 03's DDP script (`ddp_amp.py` is `ddp_spawn.py` plus precision, and
# `CHANGES.diff` in the lesson folder shows exactly what it adds), and maps Apex onto it.
#
# | task | where | what you write |
# |---|---|---|
# | 06.1 | `ddp_amp.Trainer._run_batch` | lesson 01's step in mixed precision: autocast for the forward and the loss only; backward, clipping and the step through the scaler |
# | 06.2 | `ddp_amp.Trainer._save_checkpoint`, and the resume in `__init__` | the scaler's state goes into lesson 03's checkpoint and comes back |
# | 06.3 | `amp_inspect.recording_allreduce_hook` | a DDP comm hook that records the dtype it all-reduces, then all-reduces |
# | 06.4 | `apex_amp.check_opt_level` | catch `'01'` (digit zero) for `'O1'` (letter O) |
#
# The rest of `ddp_amp.py` is lesson 03's, marked `from lesson 03_ddp_spawn` (or 01): the rank,
# `join_group`, the data loader, `evaluate`, `launch`. Run `make carry` at the course's root to
# copy your answers there.

# %%
from dpt.notebook import BENCH_REFERENCE, bench_result, needs_tasks, use_lesson

use_lesson("06_mixed_precision")

import json
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from dpt.data import REPO_ROOT
import amp_inspect
import amp_train
import apex_amp
import ddp_amp
import precision_demo
from dpt import precision
from dpt.data import load_tensors, prepare
from dpt.dist import group_of_one
from dpt.models import MLP, ConvNet

torch.set_num_threads(1)  # the timings below compare like with like, and leave a core free

# %% [markdown]
# Each cell below runs inside `with needs_tasks(...)`, which names the tasks it uses. A cell
# that reaches a task you have not done yet prints `skipped: this cell needs Task NN.K` instead
# of a traceback, and the rest of the notebook still runs. Edits to your lesson files are
# picked up when you re-run a cell.

# %% [markdown]
# ## 1. Three formats
#
# fp32 has 8 exponent bits and 23 mantissa bits. fp16 keeps 10 mantissa bits but only 5
# exponent bits: nothing above 65504, nothing below 6e-8. bf16 ("brain float") keeps fp32's 8
# exponent bits and only 7 mantissa bits: the same range as fp32, coarser steps.

# %%
with needs_tasks():
    precision_demo.print_table()

# %% [markdown]
# Gradients are often tiny. Below: every magnitude from 1e-12 to 1, stored in fp16 and in
# bf16 and read back. fp16 flushes everything under about 6e-8 to zero (and loses precision
# from 6e-5 down, in the subnormals). Multiplying by a scale `S = 2**16` before the cast moves
# those values into fp16's range; dividing by `S` again, in fp32, gives them back.

# %%
with needs_tasks():
    values = torch.logspace(-12, 0, 400)
    scale = 2.0 ** 16
    rel = lambda approx: ((approx - values).abs() / values).clamp(max=1.0)  # noqa: E731
    plt.figure(figsize=(7, 3))
    plt.semilogx(values, rel(precision_demo.round_trip(values, torch.float16)), label="fp16")
    plt.semilogx(values, rel(precision_demo.round_trip(values * scale, torch.float16) / scale),
                 label="fp16, scaled by 2^16 then unscaled")
    plt.semilogx(values, rel(precision_demo.round_trip(values, torch.bfloat16)), label="bf16")
    plt.xlabel("true value")
    plt.ylabel("relative error (1 = lost)")
    plt.legend()
    plt.title("what survives a round trip through 16 bits")
    plt.show()

    demo = precision_demo.underflow_demo()
    print(f"d(w*x)/dw with x=1e-8: fp32 {demo['fp32']:.3g}, fp16 {demo['fp16']:.3g}, "
          f"fp16 with loss scaling {demo['fp16_scaled_unscaled']:.3g}")
    print(f"through 4 layers of x0.01: fp16 {precision_demo.chain_underflow():.3g}, "
          f"fp16 scaled {precision_demo.chain_underflow(scale=2.0 ** 15):.3g}, "
          f"bf16 {precision_demo.chain_underflow(dtype=torch.bfloat16):.3g}")

# %% [markdown]
# That is the whole argument for **loss scaling**: multiply the loss by `S`, so by the chain
# rule every gradient is `S` times bigger while it flows backwards through fp16 activations,
# then divide the gradients by `S` in fp32 before the optimizer sees them. If `S` is too big,
# something overflows to inf: then the step is skipped and `S` is halved. If nothing
# overflowed for `growth_interval` steps, `S` doubles. That is `GradScaler`. bf16 has fp32's
# range, so it needs no scaler.
#
# ## 2. The device and dtype come from the machine
#
# `--precision {fp32,bf16,fp16,auto}` is parsed and checked in one place for every script of
# the lesson, `dpt.precision`, and each rank turns it into a dtype for *its own* device with
# `choose_precision(device, "auto")`: a GPU of compute capability 8 or more (Ampere and newer)
# gets bf16, an older one fp16 with a scaler (`torch.cuda.is_bf16_supported()` would say yes
# there too, but its bf16 is emulated and slower than fp16); a CPU gets bf16 only if it has
# bf16 instructions (AMX or AVX512-BF16), because without them bf16 is emulated and slower
# than fp32. fp16 on a CPU is refused with a clear error.

# %%
with needs_tasks():
    cpu = torch.device("cpu")
    print("CPU flags that matter:", precision.cpu_flags())
    print("auto on this CPU ->", precision.choose_precision(cpu, "auto"))
    try:
        precision.choose_precision(cpu, "fp16")
    except precision.PrecisionError as exc:
        print("fp16 on CPU ->", exc)

# %% [markdown]
# ## 3. Where the casts happen
#
# Autocast does not convert the model. The weights stay fp32 (the "master weights" Apex's O2
# kept separately). Inside each listed op, a conv or a matmul, autocast casts a *copy* of the
# weight and the input to bf16 and computes in bf16. Ops that need range or accuracy
# (softmax, cross-entropy, sums) run in fp32. Here is one training step of the ConvNet under
# bf16, through `ddp_amp.Trainer._run_batch`, so this cell waits for task 06.1 (section 4).
# The `Trainer` wraps its model in DDP, so it runs in a job of one process
# (`dpt.dist.group_of_one`):

# %%
with needs_tasks("06.1"):
    torch.manual_seed(0)
    convnet = ConvNet()
    with group_of_one(cpu):
        t = ddp_amp.Trainer(convnet, None, torch.optim.SGD(convnet.parameters(), lr=0.01), cpu,
                            precision="bf16")
        rows = amp_inspect.cast_map(t, torch.randn(2, 1, 28, 28), torch.tensor([0, 1]))
    for row in rows:
        print(f"{row['module']:10} {row['type']:12} weights {row['param']:8} "
              f"in {row['input']:9} out {row['output']}")

# %% [markdown]
# Backward mirrors it: each op's gradient is computed in the dtype its forward used, and the
# gradient reaching a parameter is cast back to the parameter's dtype, fp32. So `p.grad` is
# fp32, the optimizer updates fp32 weights, and small updates are not rounded away (an update
# of 1e-4 to a weight of 1.0 vanishes in bf16, whose step near 1.0 is 0.0078).
#
# ## 4. The step (task 06.1)
#
# `ddp_amp.py` is lesson 03's `ddp_spawn.py` with three changes to its `Trainer`. `__init__`
# turns `--precision` into `self.dtype` and makes `self.scaler`, a `GradScaler` that is
# enabled for fp16 and passes everything through unchanged otherwise, so one step serves every
# precision. `_run_batch`, your task, is lesson 01's step in mixed precision. And the
# checkpoint carries the scaler (section 5). Here is the step's part of `CHANGES.diff`:

# %%
with needs_tasks():
    # the exercises' CHANGES.diff, whichever tree runs this notebook: it shows the task as
    # you get it (the solutions' diff would show the answer)
    diff = (REPO_ROOT / "exercises" / "06_mixed_precision" / "CHANGES.diff").read_text()
    start = diff.index("     def _run_batch")
    print(diff[start:diff.index("@@", start)])

# %% [markdown]
# The order is the whole task. Under autocast: the forward and the loss, nothing else.
# Outside it: backward on the **scaled** loss, then the gradients are **unscaled** (back to
# their true size) before they are clipped, then the optimizer steps **through the scaler**
# (which skips the step when a gradient is inf or NaN), and finally the scaler **updates** its
# scale. `HINTS.md` in the lesson folder gives the API names if you are stuck.
#
# Five ways to get it wrong, and what each does:
# backward on the unscaled loss divides true gradients by `S` (a 65536x smaller step);
# clipping before unscaling clips the scaled norm, so after unscaling the gradient is `S`
# times too small; without the scaler's update the scale never backs off (every step after
# one overflow is skipped) nor grows; stepping the optimizer yourself instead of through the
# scaler applies inf gradients; and autocast around backward or the step is not what autocast
# is for (backward already follows the forward's dtypes, and the optimizer must work in fp32).
#
# torch has a GradScaler for the CPU too, so we can watch the fp16 *logic* here: fp32 compute, a
# scaler starting at 2^10 that grows every 5 good steps, and an inf injected at step 12, in a
# job of one process as above (`amp_train.py` runs it the same way); `amp_train.watched_step`
# reads the scale around each `_run_batch`.

# %%
with needs_tasks("06.1"):
    prepare("fashion-mnist", quiet=True)
    x_train, y_train = load_tensors("fashion-mnist", train=True)
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=5)
    scales, skipped = [], []
    with group_of_one(cpu):
        trainer = ddp_amp.Trainer(model, None, optimizer, cpu, max_norm=1.0, scaler=scaler)
        for step in range(25):
            batch = (x_train[step * 32:(step + 1) * 32], y_train[step * 32:(step + 1) * 32])
            if step == 12:
                batch = amp_train.inject_inf(batch)
            out = amp_train.watched_step(trainer, batch)
            scales.append(out["scale"])
            if out["skipped"]:
                skipped.append(step)
    print("skipped steps:", skipped, "| scale now", scaler.get_scale())
    plt.figure(figsize=(6, 2.5))
    plt.step(range(len(scales)), scales, where="post")
    plt.scatter(skipped, [scales[s] for s in skipped], color="red", zorder=3, label="inf: skipped")
    plt.yscale("log", base=2)
    plt.xlabel("step")
    plt.ylabel("loss scale")
    plt.legend()
    plt.title("GradScaler: grows every 5 finite steps, halves on inf")
    plt.show()

# %% [markdown]
# ## 5. The scaler goes into the checkpoint (task 06.2)
#
# A resumed fp16 run needs the scale it had reached: a fresh scaler starts at 65536 and skips
# steps until it has backed off again. Lesson 03's `_save_checkpoint` (rank 0 writes, everyone
# waits) saves the scaler's state too, and `__init__` puts it back on resume.

# %%
with needs_tasks("01.3", "06.1", "06.2"):  # checkpoints the trainer of the cell above
    with tempfile.TemporaryDirectory() as tmp, group_of_one(cpu):
        trainer.checkpoint_path = Path(tmp) / "amp.pt"
        trainer._save_checkpoint(25)
        fresh_model = MLP()
        fresh_opt = torch.optim.SGD(fresh_model.parameters(), lr=0.05, momentum=0.9)
        fresh_scaler = torch.amp.GradScaler("cpu")
        print("fresh scaler:", fresh_scaler.get_scale())
        resumed = ddp_amp.Trainer(fresh_model, None, fresh_opt, cpu, scaler=fresh_scaler,
                                  resume_from=trainer.checkpoint_path)
        print(f"resumed at step {resumed.epochs_run}: scale {fresh_scaler.get_scale()}, "
              f"state {fresh_scaler.state_dict()}")

# %% [markdown]
# ## 6. bf16 on this CPU: does the loss follow fp32?
#
# Same seed, same batches, 100 steps of the MLP each way. The curves separate after a few
# steps (any rounding difference is amplified by SGD), so the two last-50 means the cell prints
# differ a little, by an amount that changes with the CPU. What holds on every CPU is averaged:
# the lesson's test scores both on a held-out set over three data orders, and bf16's loss is
# not worse than fp32's by more than 0.05 nats (a CPU with native bf16 and one without take
# different paths, so only a one-sided, averaged bound holds on both). The time is one run's.

# %%
with needs_tasks("06.1"):
    def run(prec, steps=100, batch=16):
        torch.manual_seed(0)
        m = MLP()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(0)
        losses, t0 = [], time.perf_counter()
        with group_of_one(cpu):
            t = ddp_amp.Trainer(m, None, opt, cpu, precision=prec)
            for _ in range(steps):
                idx = torch.randint(0, len(x_train), (batch,), generator=g)
                losses.append(t._run_batch(x_train[idx], y_train[idx]))
        return losses, time.perf_counter() - t0


    fp32_losses, fp32_s = run("fp32")
    bf16_losses, bf16_s = run("bf16")
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    print(f"last-50 mean loss: fp32 {mean(fp32_losses[-50:]):.3f}, "
          f"bf16 {mean(bf16_losses[-50:]):.3f}")
    print(f"time: fp32 {fp32_s:.1f}s, bf16 {bf16_s:.1f}s (bf16/fp32 throughput "
          f"{fp32_s / bf16_s:.2f}x)")
    smooth = lambda v, k=15: torch.tensor(v).unfold(0, k, 1).mean(1)  # noqa: E731
    plt.figure(figsize=(6, 3))
    plt.plot(smooth(fp32_losses), label="fp32")
    plt.plot(smooth(bf16_losses), label="bf16 autocast")
    plt.xlabel("step")
    plt.ylabel("loss (mean of 15)")
    plt.legend()
    plt.show()

# %% [markdown]
# ## 7. With DDP (task 06.3)
#
# Nothing in DDP changes: it wraps the fp32 model, autocast casts inside the ops, and the
# gradients DDP all-reduces are the parameters' gradients, fp32. `amp_inspect.py` shows it: a
# communication hook (task 06.3) records the dtype of every bucket before doing DDP's default
# all-reduce. (To all-reduce in 16 bits you would have to ask for it: `fp16_compress_hook` /
# `bf16_compress_hook`.)
#
# The ranks are separate processes. A notebook's own functions cannot be pickled for them, so
# we launch `amp_inspect.ddp_dtypes`, a function that lives in a lesson file and trains a few
# steps of `ddp_amp.Trainer` with the hook, with `dpt.ranks.run_distributed` (two processes,
# gloo, one thread each; on the CPU, or on a shared GPU with `DPT_SHARE_GPU=1`).

# %%
with needs_tasks("06.1", "06.3"):
    from dpt.ranks import run_distributed

    results = run_distributed(amp_inspect.ddp_dtypes, world_size=2, backend="gloo",
                              kwargs={"precision": "bf16", "steps": 4, "batch_size": 16},
                              timeout=300)
    for r in results:
        print(f"rank {r['rank']}: all-reduced {r['allreduce_dtypes']}, params {r['param_dtypes']}, "
              f"last loss {r['losses'][-1]:.3f}")
    print("ranks hold identical weights:", torch.equal(results[0]["params"], results[1]["params"]))

# %% [markdown]
# From a terminal, at the repository root: `.venv/bin/python
# exercises/06_mixed_precision/ddp_amp.py -g 2 --precision bf16 --limit-batches 50`, the
# whole lesson-03 script in bf16 (`--precision auto` picks for the machine; `--clip 1.0`
# clips), or `.venv/bin/python exercises/06_mixed_precision/amp_inspect.py` for the cast
# map and the all-reduced dtypes.
#
# ## 8. Apex, the historical path (task 06.4)
#
# | Apex | what it did | what does its job in `torch.amp` |
# |---|---|---|
# | `opt_level="O0"` | fp32, amp off | no autocast, no loss scaling: `--precision fp32` |
# | `opt_level="O1"` | patch torch functions: matmul/conv in fp16, softmax/loss in fp32; dynamic loss scale | the same idea without patching: autocast picks each op's dtype inside a region you open; a `GradScaler` object scales the loss (bf16 needs none) |
# | `opt_level="O2"` | fp16 model (batch norm in fp32) + fp32 master weights in the optimizer; loss scale | not needed: under autocast the model's own fp32 weights *are* the master weights; a 16-bit model with fp32 masters is FSDP's `MixedPrecisionPolicy` (lesson 08) |
# | `opt_level="O3"` | pure fp16, no master weights | casting the model itself: a speed baseline, rarely trainable |
# | `amp.initialize(model, opt, ...)` | patch model and optimizer | nothing to initialize or patch: create the scaler once, open autocast where the forward runs |
# | `with amp.scale_loss(loss, opt) as s: s.backward()` | scaled backward | the scaler's own calls around backward and the optimizer's step, and one to adapt the scale: task 06.1 |
# | `amp.master_params(opt)`, to clip | the fp32 copies | the model's parameters; clip only once the scaler has unscaled their gradients |
# | `amp.state_dict()` in a checkpoint | the loss scale | the scaler's own state, saved and restored with the model: task 06.2 |
# | `apex.parallel.DistributedDataParallel` | Apex's DDP | `torch.nn.parallel.DistributedDataParallel`, unchanged from lesson 03 |
#
# The calls themselves are in PyTorch's documentation: the `torch.amp` reference
# (https://pytorch.org/docs/stable/amp.html), its examples
# (https://pytorch.org/docs/stable/notes/amp_examples.html: typical training, gradient
# clipping) and the AMP recipe (https://pytorch.org/tutorials/recipes/recipes/amp_recipe.html:
# saving and resuming). `apex_amp.py` prints the same mapping.
#
# That tutorial warns that `opt_level` starts with the capital **letter O**. `'01'` with a zero is
# the classic typo; `check_opt_level` turns it into an error that says so.

# %%
with needs_tasks("06.4"):
    for level in ["O2", "01"]:
        try:
            print(level, "->", apex_amp.check_opt_level(level))
        except apex_amp.OptLevelError as exc:
            print(level, "->", exc)
    print("Apex here?", apex_amp.apex_status())

# %% [markdown]
# `apex_amp.py` runs that tutorial's Apex loop only where NVIDIA Apex really is installed and a GPU
# exists. `pip install apex` installs an unrelated PyPI package; NVIDIA Apex is built from
# source against your CUDA toolkit. On this machine the script prints the table and why it
# did not run.
#
# ## 9. Speed: what to expect, and why a tiny CNN gets little
#
# `benchmarks/bench_l06_precision.py` measures fp32 against bf16 (and fp16 on a GPU) in one
# run, for one process and for DDP with 2 ranks, and records the CPU's flags.

# %%
with needs_tasks():
    def show(res: dict) -> None:
        print("CPU:", res["cpu"]["model"], "| flags:", res["cpu"]["relevant_flags"])
        for k, v in res["ratios"].items():
            print(f"  {k}: {v}")

    show(json.loads(bench_result("l06_precision.json").read_text()))
    print("\nthe same script on a CPU with AMX (committed):")
    show(json.loads((BENCH_REFERENCE / "l06_precision_amx.json").read_text()))

# %% [markdown]
# On a CPU without AMX or AVX512-BF16 (look at the flags above), such as the one the reference
# was measured on, bf16 is several times *slower* than fp32 (0.18x alone and 0.19x with DDP at
# the median of 5 repeats, slower in every one): the bf16 kernels convert to fp32 and back
# around every op, and the bf16 memory savings on this model are a few hundred kilobytes of
# activations. On a CPU with AMX (Sapphire Rapids and newer), oneDNN runs bf16 convs and
# matmuls on the tile units and bf16 mostly helps: the second result, 1.23x at the median
# alone and with DDP, though repeat by repeat DDP's ratio went from 0.94x to 1.39x (one repeat
# of five slower). Memory stays about the same on both: what the process holds is mostly the
# kernel libraries.
#
# On GPUs the AMP recipe promises 2-3x from tensor cores, for *large* models. A tiny CNN like
# ours sees far less, because that 2-3x applies only to the time spent inside big matmuls and
# convs:
#
# - **It is not compute-bound.** ConvNet has 29k parameters and a few MFLOPs per sample. Its
#   kernels are tiny, so a GPU step is dominated by kernel-launch overhead and Python
#   (dozens of launches of microseconds each), which precision does not change.
# - **Autocast adds work.** Every listed op casts its fp32 weight to 16 bits on every forward:
#   extra kernels and memory traffic that a large matmul amortizes and a small one does not.
# - **Tensor cores want big, aligned shapes.** Channel counts of 1, 16 and 32 and a 10-way
#   head leave most of the tile unused (dimensions should be multiples of 8).
# - **The rest stays fp32.** Optimizer step, loss, batch norm statistics and, under DDP, the
#   all-reduce of fp32 gradients are not sped up at all (Amdahl's law).
# - **Memory.** The saving is in activations; with a tiny model and batch, peak memory is
#   dominated by the CUDA context and the fp32 weights, gradients and optimizer state.
#
# Mixed precision pays when big matmuls dominate: transformers, wide CNNs, large batches.
