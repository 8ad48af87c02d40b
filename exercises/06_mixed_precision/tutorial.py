# %% [markdown]
# # Lesson 06: mixed precision, from Apex's amp to `torch.amp`
#
# The 'Distributed data parallel training in PyTorch' tutorial ends with "a bonus": mixed-precision DDP with NVIDIA Apex,
# `amp.initialize(model, optimizer, opt_level='O2')` and `with amp.scale_loss(...)`. Apex's
# amp now lives inside PyTorch as `torch.amp`. This lesson explains why mixed precision works,
# writes the step you should write today, puts it under DDP, and maps the Apex calls to it.
#
# | task | where | what you write |
# |---|---|---|
# | 06.1 | `amp_train.amp_train_step` | autocast around forward+loss only; scaled backward; `unscale_` before clipping; `step`; `update` |
# | 06.2 | `amp_train.save_checkpoint` / `load_checkpoint` | the scaler's state goes in the checkpoint and comes back |
# | 06.3 | `ddp_amp.recording_allreduce_hook` | a DDP comm hook that records the dtype it all-reduces, then all-reduces |
# | 06.4 | `apex_amp.check_opt_level` | catch `'01'` (digit zero) for `'O1'` (letter O) |

# %%
from dpt.notebook import needs_tasks, use_lesson

use_lesson("06_mixed_precision")

import json
import time

import matplotlib.pyplot as plt
import torch

import amp_train
import apex_amp
import ddp_amp
import precision_demo
from dpt.data import load_tensors, prepare
from dpt.models import MLP, ConvNet

torch.set_num_threads(1)  # the timings below compare like with like, and leave a core free

# %% [markdown]
# Each cell below runs inside `with needs_tasks():`. A cell that reaches a task you have not
# done yet prints `skipped: this cell needs Task NN.K` instead of a traceback, and the rest of
# the notebook still runs. Edits to your lesson files are picked up when you re-run a cell.

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
# `choose_precision(device, "auto")`: CUDA gives bf16 where the GPU supports it (Ampere and
# newer) and fp16 + scaler otherwise; a CPU gets bf16 only if it has bf16 instructions (AMX or
# AVX512-BF16), because without them bf16 is emulated and slower than fp32. `--precision`
# overrides it; fp16 on a CPU is refused with a clear error.

# %%
with needs_tasks():
    cpu = torch.device("cpu")
    print("CPU flags that matter:", amp_train.cpu_flags())
    print("auto on this CPU ->", amp_train.choose_precision(cpu, "auto"))
    try:
        amp_train.choose_precision(cpu, "fp16")
    except amp_train.PrecisionError as exc:
        print("fp16 on CPU ->", exc)

# %% [markdown]
# ## 3. Where the casts happen
#
# Autocast does not convert the model. The weights stay fp32 (the "master weights" Apex's O2
# kept separately). Inside each listed op, a conv or a matmul, autocast casts a *copy* of the
# weight and the input to bf16 and computes in bf16. Ops that need range or accuracy
# (softmax, cross-entropy, sums) run in fp32. Here is one forward of the ConvNet under bf16:

# %%
with needs_tasks():
    torch.manual_seed(0)
    for row in ddp_amp.cast_map(ConvNet(), torch.randn(2, 1, 28, 28), cpu, torch.bfloat16):
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
# The order is the whole task. Under autocast: the forward and the loss, nothing else.
# Outside it: backward on the **scaled** loss, then the gradients are **unscaled** (back to
# their true size) before they are clipped, then the optimizer steps **through the scaler**
# (which skips the step when a gradient is inf or NaN), and finally the scaler **updates** its
# scale. Without a scaler (fp32, bf16) the same step is a plain backward, clip and step.
# `HINTS.md` in the lesson folder gives the API names if you are stuck.
#
# Five ways to get it wrong, and what each does (each is a test in `tests/l06_mixed_precision`):
# `loss.backward()` instead of `scaler.scale(loss).backward()` divides true gradients by `S`
# (a 65536x smaller step); clipping before `unscale_` clips the scaled norm, so after unscaling
# the gradient is `S` times too small; without `scaler.update()` the scale never backs off
# (every step after one overflow is skipped) nor grows; autocast around `backward()`/`step()`
# is not what autocast is for (backward already follows the forward's dtypes, and the
# optimizer must work in fp32); and a checkpoint without the scaler's state restarts the scale
# at 65536, so a resumed fp16 run skips steps until it has backed off again.
#
# torch 2.x has a CPU GradScaler, so we can watch the fp16 *logic* here: fp32 compute, a
# scaler starting at 2^10 that grows every 5 good steps, and an inf injected at step 12.

# %%
with needs_tasks():
    prepare("fashion-mnist", quiet=True)
    x_train, y_train = load_tensors("fashion-mnist", train=True)
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=5)
    scales, skipped = [], []
    for step in range(25):
        batch = (x_train[step * 32:(step + 1) * 32], y_train[step * 32:(step + 1) * 32])
        if step == 12:
            batch = amp_train.inject_inf(batch)
        out = amp_train.amp_train_step(model, batch, optimizer, cpu, None, scaler, max_norm=1.0)
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

# %%
with needs_tasks():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = amp_train.save_checkpoint(Path(tmp) / "amp.pt", model, optimizer, scaler, step=25,
                                         precision="fp16")
        fresh_model = MLP()
        fresh_opt = torch.optim.SGD(fresh_model.parameters(), lr=0.05, momentum=0.9)
        fresh_scaler = torch.amp.GradScaler("cpu")
        print("fresh scaler:", fresh_scaler.get_scale())
        step = amp_train.load_checkpoint(path, fresh_model, fresh_opt, fresh_scaler)
        print(f"resumed at step {step}: scale {fresh_scaler.get_scale()}, "
              f"state {fresh_scaler.state_dict()}")

# %% [markdown]
# ## 6. bf16 on this CPU: does the loss follow fp32?
#
# Same seed, same batches, 100 steps of the MLP each way. The curves separate after a few
# steps (any rounding difference is amplified by SGD), but the averaged losses agree. The test
# suite checks the property on a held-out set, over three data orders: bf16's loss may not be
# worse than fp32's by more than 0.05 nats (a CPU with native bf16 and one without take
# different paths, so only a one-sided, averaged bound holds on both).

# %%
with needs_tasks():
    def run(dtype, steps=100, batch=16):
        torch.manual_seed(0)
        m = MLP()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(0)
        losses, t0 = [], time.perf_counter()
        for _ in range(steps):
            idx = torch.randint(0, len(x_train), (batch,), generator=g)
            losses.append(amp_train.amp_train_step(m, (x_train[idx], y_train[idx]), opt, cpu,
                                                   dtype)["loss"])
        return losses, time.perf_counter() - t0


    fp32_losses, fp32_s = run(None)
    bf16_losses, bf16_s = run(torch.bfloat16)
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
# `ddp_amp.py` is lesson 03's DDP script plus `--precision {32,bf16,fp16}`. Nothing in DDP
# changes: it wraps the fp32 model, autocast casts inside the ops, and the gradients DDP
# all-reduces are the parameters' gradients, fp32. A communication hook (task 06.3) records
# the dtype of every bucket before doing DDP's default all-reduce. (To all-reduce in 16 bits
# you would have to ask for it: `fp16_compress_hook` / `bf16_compress_hook`.)
#
# The ranks are separate processes. A notebook's own functions cannot be pickled for them, so
# we launch `ddp_amp.train_ddp`, a function that lives in a lesson file, with
# `dpt.testing.run_distributed` (two CPU processes, gloo, one thread each).

# %%
with needs_tasks():
    from dpt.testing import run_distributed

    results = run_distributed(ddp_amp.train_ddp, world_size=2,
                              kwargs={"precision": "bf16", "steps": 4, "batch_size": 16})
    for r in results:
        print(f"rank {r['rank']}: all-reduced {r['allreduce_dtypes']}, params {r['param_dtypes']}, "
              f"last loss {r['losses'][-1]:.3f}")
    print("ranks hold identical weights:", torch.equal(results[0]["params"], results[1]["params"]))

# %% [markdown]
# From a terminal, at the repository root: `.venv/bin/python
# exercises/06_mixed_precision/ddp_amp.py --precision bf16 --nprocs 2 --steps 50`, or under
# torchrun: `.venv/bin/torchrun --standalone --nproc-per-node 2
# exercises/06_mixed_precision/ddp_amp.py --precision 32`.
#
# ## 8. Apex, the historical path (task 06.4)
#
# | Apex | what it did | today |
# |---|---|---|
# | `opt_level="O0"` | fp32, amp off | no autocast, no scaler |
# | `opt_level="O1"` | patch torch functions: matmul/conv in fp16, softmax/loss in fp32; dynamic loss scale | `torch.autocast(..., dtype=float16)` + `GradScaler` (or bf16, no scaler) |
# | `opt_level="O2"` | fp16 model (batch norm in fp32) + fp32 master weights in the optimizer; loss scale | autocast + GradScaler covers it; an fp16 model with fp32 masters is FSDP's `MixedPrecisionPolicy` |
# | `opt_level="O3"` | pure fp16, no master weights | `model.half()`: a speed baseline, rarely trainable |
# | `amp.initialize(model, opt, ...)` | patch model and optimizer | nothing to initialize: create a `GradScaler` |
# | `with amp.scale_loss(loss, opt) as s: s.backward()` | scaled backward | `scaler.scale(loss).backward(); scaler.step(opt); scaler.update()` |
# | `apex.parallel.DistributedDataParallel` | Apex's DDP | `torch.nn.parallel.DistributedDataParallel` |
#
# That tutorial warns that `opt_level` starts with the capital **letter O**. `'01'` with a zero is
# the classic typo; `check_opt_level` turns it into an error that says so.

# %%
with needs_tasks():
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
    from dpt.data import REPO_ROOT

    result_file = REPO_ROOT / "benchmarks" / "results" / "l06_precision.json"
    if result_file.exists():
        res = json.loads(result_file.read_text())
        print("CPU:", res["cpu"]["model"], "| flags:", res["cpu"]["relevant_flags"])
        for k, v in res["ratios"].items():
            print(f"  {k}: {v}")
    else:
        print("run `python benchmarks/bench_l06_precision.py` to measure this machine")

# %% [markdown]
# On this CPU (no AMX, no AVX512-BF16) bf16 is *slower* than fp32: the bf16 kernels convert
# to fp32 and back around every op, and the bf16 memory savings on this model are a few
# hundred kilobytes of activations. On a CPU with AMX (Sapphire Rapids and newer), oneDNN runs
# bf16 convs and matmuls on the tile units and bf16 helps.
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
