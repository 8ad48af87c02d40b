# %% [markdown]
# # Lesson 10: inside a step
#
# Lessons 03-09 built data parallelism and timed it from outside. Here you open one training
# step up, the way practitioners do when a job is slow or stuck:
#
# | part | tasks | file |
# |---|---|---|
# | profiler traces: where the communication goes, how much backward hides | 10.1-10.4 | `traces.py` |
# | `torch.compile` with DDP: one graph per bucket | 10.5-10.7 | `compile_ddp.py` |
# | communication hooks: bf16 by hand, PowerSGD, bytes per step | 10.8-10.10 | `comm_hooks.py` |
# | a hang clinic: reproduce, diagnose, fix | 10.11-10.15 | `hang_clinic.py` |
#
# The parts do not need each other: do them in any order. Part 1 also runs your code of
# lessons 05 and 09: it traces your DDPs (Tasks 05.2-05.9) and your FSDP (09.1-09.12, 09.17).
# A method whose task is not done there is left out of the table, and the timeline shows the
# course's reference run instead, saying so. Each cell runs inside `with needs_tasks(...)`
# where it uses your code; a cell that reaches a task you have not done yet prints
# `skipped: this cell needs Task 10.K` and the rest of the notebook still runs. Edits to your
# lesson files are picked up when you re-run a cell. The ranks run functions from the lesson's
# files: a notebook cannot hand functions defined in a cell to fresh processes.

# %%
from dpt.notebook import use_lesson

use_lesson("10_inside_a_step")

# %% [markdown]
# ## Part 1: profiler traces (10.1-10.4, `traces.py`)
#
# ### 1. One step, traced: where does the communication go?
#
# Lesson 05 timed its DDPs with stamps it placed by hand. PyTorch's profiler records far more:
# every operator, every collective, on every thread of every rank (and on a GPU, every kernel on
# every stream). `traces.trace_rank` trains each data-parallel method of the course for a few
# steps on 2 ranks, then traces one more step, with its parts labelled `forward`, `backward`,
# `sync` (`finish_gradient_synchronization()` and friends) and `optimizer`:
#
# | method | what it is |
# |---|---|
# | `torch_ddp` | `DistributedDataParallel`, 4 MB buckets |
# | `naive`, `overlap`, `bucketed` | your DDPs of lesson 05 (4 MB buckets) |
# | `fsdp` | your hand-written FSDP of lesson 09 |
# | `fsdp2` | `fully_shard` per block (lesson 09) |
#
# All train the same TinyTransformer (4 blocks of width 256, about 13 MB of gradients), so
# the steps compare. A method whose lesson 05 or 09 task is not done yet is left out, with the
# task's name. Each rank writes one Chrome trace per method, `<method>.rank<r>.json`, in the
# folder `tr.OUT` (the cell prints each file's path). About 15 s on a 2-core CPU.
#
# The ranks start the profiler quietly (`KINETO_LOG_LEVEL=6`). If you run the profiler
# yourself and see `USDT ... profiler_start` or `ERROR ... gpuGetDeviceCount failed with code
# 35` on a machine without a GPU: that is the profiler's own log, not a failure.

# %%
import collections

import matplotlib.pyplot as plt

import traces as tr
from dpt.notebook import needs_tasks

ranks = tr.run_traces(tr.METHODS, nproc=2)
for method in tr.METHODS:
    result = ranks[0][method]
    shown = result if isinstance(result, str) else f"{result['path']} (+ rank 1's)"
    print(f"{tr.LABELS[method]:<19} {shown}")

# %% [markdown]
# **Open one in Perfetto**: go to https://ui.perfetto.dev, drag `torch_ddp.rank0.json` onto the
# page (or "Open trace file"). Each thread is a row: the main thread with the four labels and
# every operator nested under them, and gloo's worker threads (`pt_gloo_runloop`) with the
# `gloo:all_reduce` slices. Press `W`/`S` to zoom, `A`/`D` to pan; click a slice for its
# arguments (the tensor sizes: the traces are recorded with `record_shapes=True`).
# `chrome://tracing` opens the same files.
#
# ### 2. Reading a trace (10.1) and picking the events that matter (10.2)
#
# A trace is JSON: `traceEvents` is a list of events, and the ones with `"ph": "X"` have a
# start `ts` and a duration `dur`, in microseconds, a process `pid` and a thread `tid`. Your
# `read_trace` turns them into `Event`s in ms from the trace's first event.
#
# A collective shows twice. Its **launch**, `c10d::allreduce_`, is a short `cpu_op` on the
# thread that called it: it only hands the work over. Its **execution**, `gloo:all_reduce`,
# runs on one of gloo's threads while the main thread goes on with the backward. On a GPU
# with NCCL the execution is a kernel named `ncclDevKernel_...` on its own stream, and a
# kernel's launch is found through `args["correlation"]`. `comm_intervals` keeps the
# executions.
#
# `compute_intervals` keeps the backward's compute. On the CPU the autograd engine runs the
# backward on the thread that called `loss.backward()`: its compute is the operators that
# thread ran inside the `backward` span. The gaps between them are waits: torch DDP, for one,
# waits inside `backward` for its last buckets. On a GPU the CPU only launches kernels; the
# compute is the kernels launched during `backward`, whenever the GPU ran them.

# %%
with needs_tasks("10.1"):
    events = tr.read_trace(tr.result_of(ranks, "torch_ddp")[0]["path"])
    kinds = collections.Counter(e.cat for e in events)
    print(f"torch DDP, rank 0: {len(events)} complete events, {dict(kinds)}")
    for e in events:
        if e.name.startswith(("c10d::", "gloo:")):
            print(f"  {e.start:8.2f} - {e.end:8.2f} ms  thread {e.tid:<8} {e.name}")

# %%
with needs_tasks("10.1", "10.2"):
    comm, backward = tr.comm_intervals(events), tr.compute_intervals(events)
    print(f"{len(comm)} collectives ran:", [(round(s, 1), round(e, 1)) for s, e in comm])
    print(f"{len(backward)} operators of the backward (nested ones too), from "
          f"{min(s for s, _ in backward):.1f} to {max(e for _, e in backward):.1f} ms")

# %% [markdown]
# ### 3. How much of the communication hid behind the backward (10.3, 10.4)
#
# Two gloo threads can run collectives at once, so time is counted on the union of the
# intervals (`merge`, 10.3), and the hidden part is the overlap of the communication with the
# backward's compute (`overlap`). `hidden_fraction` (10.4) divides it by the communication
# time, not by the step: 100% means the step never waited for a collective after backward.
#
# The step time is the median of 3 steps without the profiler (it slows the traced step).
# The communication time is what gloo's threads spent in collectives, waiting for the other
# rank included.
#
# What counts as communication depends on where the ranks ran (the table's last lines say
# which): on the CPU, gloo's spans; on GPUs with NCCL, the NCCL kernels' own times on the
# device. On one GPU shared by the ranks (`DPT_SHARE_GPU=1`, what a one-GPU machine or Colab
# runs) gloo works on CUDA tensors: its span starts on the CPU as soon as the collective is
# issued, then waits for the copy of the gradient to the host, which waits for the backward's
# kernels still running. Counted from the span's start, even the naive DDP would look hidden
# behind its backward. The table (`tr.as_run`) counts each span from the moment its input
# reached the host, and prints `n/c` (not comparable) where it cannot tell that moment.

# %%
with needs_tasks("10.1", "10.2", "10.3", "10.4",
                 earlier=("05.2", "05.3", "05.4", "05.5", "05.6", "05.7", "05.8", "05.9"),
                 reference="l10_summary.txt"):
    rows = tr.summary(ranks)
    print(tr.format_summary(rows))
    not_traced = [r["skipped"] for r in rows if "skipped" in r]
    if not_traced:  # a lesson 05 DDP not written yet: the reference run's rows follow
        raise NotImplementedError(not_traced[0])

# %% [markdown]
# What to look for: the naive DDP hides nothing (its all-reduces start after `backward`
# returns, one per parameter) and waits for all of them in `sync`. The overlapped DDP starts
# each gradient's all-reduce as soon as it is ready, the bucketed one and torch DDP one per
# 4 MB bucket: fewer, larger messages. The FSDPs communicate in the forward too (the
# all-gathers), which no backward can hide: their fraction is of all their communication.
#
# The timelines below are drawn from the trace events themselves, rank 0's: the labels of the
# main thread on top, the backward's compute (your `compute_intervals`, merged), then one lane
# per gloo thread that ran a collective. On a 2-core machine the ranks and gloo's threads share
# the cores, so a busy machine shows gaps in the compute where a thread waited for a core.

# %%
with needs_tasks("10.1", "10.2", "10.3", "10.4",
                 earlier=("05.2", "05.3", "05.4", "05.5", "05.6", "05.7", "05.8", "05.9"),
                 reference="l10_timeline.png"):
    fig = tr.figure(ranks, ("naive", "bucketed"), path=None)
    plt.show()

# %% [markdown]
# ## Part 2: `torch.compile` with DDP (10.5-10.7, `compile_ddp.py`)
#
# DDP hides communication behind backward: a bucket's all-reduce starts as soon as its last
# gradient is ready. A compiled graph's backward is one step, so all its gradients are ready
# together, at its end. Compile the whole model as one graph and DDP has nothing left to
# overlap. Dynamo's **DDPOptimizer** avoids that: when it compiles a model that DDP wraps, it
# cuts the graph where DDP's buckets end and compiles each piece on its own.
#
# You watch both sides of that cut. A dynamo backend of your own records each graph it is
# given (10.5). A DDP comm hook records each bucket (10.6). A builder compiles the model and
# then wraps it in DDP, as nanoGPT does (10.7). The model is `LayerStack`: six Linear+ReLU
# layers of width 512, so each layer's parameters are just over 1 MiB.

# %%
import compile_ddp as cdp
from dpt.notebook import needs_tasks
from dpt.ranks import placement, run_distributed

device = placement(2).device  # a GPU each, the GPUs shared, or the CPU
problem = cdp.compiler_problem(device)
print(f"2 ranks: {placement(2).label}; inductor here: {problem or 'available'}")
# inductor compiles C++ on a CPU (tens of seconds on 2 cores): the CPU run uses aot_eager
BACKEND = "inductor" if device == "cuda" and problem is None else "aot_eager"

# %% [markdown]
# A backend is a function `backend(gm, example_inputs)` that returns what runs in the graph's
# place. Compiled alone, without DDP, the model is one graph that holds every parameter:

# %%
with needs_tasks("10.5"):
    import torch

    torch._dynamo.reset()
    model = cdp.LayerStack(64, 3)
    recorder = cdp.GraphRecorder(model)
    torch.compile(model, backend=recorder)(torch.randn(4, 64)).sum().backward()
    for i, g in enumerate(recorder.graphs):
        print(f"graph {i}: {g['ops']} ops, parameters {sorted(g['params'])}")

# %% [markdown]
# Next, on 2 ranks, the model is compiled and then wrapped in DDP at three bucket caps:
# DDP's default (`None`, 25 MiB after a 1 MiB first bucket), 1 MiB and 2 MiB. For each cap
# you see the graphs the backend received and DDP's buckets after it rebuilt them. Then the
# losses of eager DDP and compiled DDP, and what the other order, `torch.compile(DDP(model))`,
# does on this torch. The graphs run as captured ("count"), so the gradients arrive layer by
# layer, as in eager mode.

# %%
with needs_tasks("10.5", "10.6", "10.7"):
    out = run_distributed(cdp.worker, world_size=2, timeout=240, echo=False,
                          args=("count", [None, 1, 2], 0))[0]
    cdp.report(out, "count")

# %% [markdown]
# At the default cap and at 1 MiB there is one graph per bucket. At 2 MiB there is not. DDP
# uses its 1 MiB first bucket only when you leave `bucket_cap_mb` unset. Pass a cap, and its
# first bucket is the whole cap. The DDPOptimizer still cuts a 1 MiB first piece, so every
# later boundary is off by a layer. Each bucket then waits for two graphs' backwards before
# its all-reduce can start.
#
# With a real compiler the picture changes a little. A compiled graph's backward hands all its
# gradients to autograd at once, in the order of its outputs: a layer's weight before its
# bias. DDP rebuilds its buckets in that order and cuts them by size alone, so a bucket can
# end between a weight and its bias. The split is then off by one parameter. The losses,
# though, are those of eager DDP, from the same weights on the same batches.

# %%
with needs_tasks("10.5", "10.6", "10.7"):
    splits = run_distributed(cdp.split_worker, world_size=2, timeout=300, echo=False,
                             args=(BACKEND, [None]))[0]
    cdp.print_splits(splits)
    r = run_distributed(cdp.compare_losses_worker, world_size=2, timeout=300, echo=False,
                        args=(BACKEND,))[0]
    gap = max(abs(a - b) for a, b in zip(r["eager"], r["compiled"]))
    print(f"{BACKEND}: {r['graphs']} graphs; losses eager {[round(v, 6) for v in r['eager']]}")
    print(f"{' ' * len(BACKEND)}  compiled {[round(v, 6) for v in r['compiled']]}; "
          f"largest gap {gap:.2g}")

# %% [markdown]
# ## Part 3: communication hooks (10.8-10.10, `comm_hooks.py`)
#
# DDP all-reduces each bucket of fp32 gradients as it fills during backward. A
# **communication hook** (`ddp.register_comm_hook(state, hook)`) replaces that all-reduce:
# DDP hands the hook each bucket (`bucket.buffer()`, the flat gradients) and waits on the
# Future it returns, whose value must be the **averaged** bucket. What goes on the wire in
# between is up to the hook: torch ships fp16 and bf16 compression (half the bytes) and
# PowerSGD (each gradient matrix sent as two thin rank-r factors; biases whole).
#
# | task | file | you write |
# |---|---|---|
# | 10.8 | `comm_hooks.py` | `bf16_hook_by_hand`: compress, pre-divide, async all-reduce, decompress into the bucket |
# | 10.9 | `comm_hooks.py` | `attach_hook`: one name, one registered hook (PowerSGD with its state) |
# | 10.10 | `comm_hooks.py` | `AllReduceCounter`: the bytes every `dist.all_reduce` sends |
#
# All three hooks run on gloo (CPU) as well as NCCL; one catch: DDP refuses to register
# torch's own `bf16_compress_hook` on a torch built without CUDA (the CPU-only wheels),
# though gloo reduces bf16 fine. Your hand-written hook has no such check.

# %%
import json

import comm_hooks as ch

from dpt.models import MLP, TinyTransformer
from dpt.notebook import bench_result, needs_tasks
from dpt.ranks import run_distributed

# %% [markdown]
# ### Predicted bytes per step (given code, no task)
#
# fp32 sends 4 bytes per gradient, fp16 and bf16 send 2. PowerSGD views each gradient as an
# n x m matrix and sends P (n x r) and Q (m x r) when that is at least twice smaller;
# biases, and matrices too small to gain, go whole. The saving depends on the shapes: large
# square matrices gain most.

# %%
for label, model in (("MLP (Fashion-MNIST)", MLP()),
                     ("TinyTransformer (lesson 09)", TinyTransformer())):
    full = ch.predicted_bytes(model, "none")
    print(f"{label}: fp32 {full / 1024:.1f} KiB/step")
    for name, opts in (("bf16", {}), ("powersgd", {"rank": 1}), ("powersgd", {"rank": 4})):
        b = ch.predicted_bytes(model, name, **opts)
        print(f"  {name} {opts or ''}: {b / 1024:.1f} KiB ({full / b:.1f}x less)")

# %% [markdown]
# ### Your hooks in a short DDP run
#
# Two ranks train the MLP for 16 steps on 2,048 Fashion-MNIST images under each hook, counting
# the bytes of every all-reduce (your `AllReduceCounter`). PowerSGD runs plain all-reduce for
# its first 10 steps (`start_iter`), then compresses: watch its first and last step. The
# hand-written bf16 hook should end on exactly the weights torch's bf16 hook ends on.

# %%
with needs_tasks("10.8", "10.9", "10.10"):
    hooks = ["none", "bf16_by_hand", "powersgd"] + (["bf16"] if ch.torch_bf16_registers() else [])
    short = {}
    for hook in hooks:
        short[hook] = run_distributed(ch.train_worker, world_size=2, timeout=120, echo=False,
                                      kwargs={"hook": hook, "train_limit": 2048,
                                              "test_limit": 2000})[0]
        r = short[hook]
        print(f"{hook:<13} bytes first step {r['bytes_first_step']:>7}, last step "
              f"{r['bytes_per_step']:>7} (predicted {r['predicted_bytes']:>7}), loss "
              f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")
    if "bf16" in short:
        same = all(a.equal(b) for a, b in zip(short["bf16"]["params"],
                                              short["bf16_by_hand"]["params"]))
        print("hand-written bf16 hook == torch's bf16 hook, bit for bit:", same)

# %% [markdown]
# ### Measured: bytes, step time, accuracy over seeds
#
# `benchmarks/bench_l10_comm_hooks.py` trains one epoch per hook and seed (`--seeds`, 3 by
# default; the run below prints how many it used, and so does its figure's title) and reports
# each measure with its 95% interval over seeds (the step time's a geometric mean, its interval
# on log times, so it never goes below zero). On one machine, gloo's all-reduce
# is a memory copy: compression saves bytes, not time, and the step time shows what the
# compression itself costs. The saving pays where the network is the bottleneck.

# %%
result = json.loads(bench_result("l10_comm_hooks.json").read_text())
print(f"{result['seeds']} seeds, {result['epochs']:g} epoch(s) each, {result['nproc']} ranks")
print(ch.format_rows(result["rows"]))
from IPython.display import Image, display  # noqa: E402

display(Image(filename=str(bench_result("l10_comm_hooks.png"))))

# %% [markdown]
# ## Part 4: a hang clinic (10.11-10.15, `hang_clinic.py`)
#
# A collective completes only when **every rank calls it, in the same order, with matching
# tensors**. Each rank counts its collectives, and its n-th call meets the n-th call of every
# other rank. When one rank calls something else, or nothing, the others wait: on gloo until
# the process group's timeout, on NCCL until the watchdog aborts, without a timeout forever.
#
# `hang_clinic.py` holds five such bugs, each as a small broken function you would write
# yourself: `order` (two helpers called in a rank-dependent order), `rank0` (an `all_reduce`
# inside `if rank == 0`), `shapes` (an `all_gather` of predictions of different lengths),
# `uneven` (DDP on data that does not split evenly) and `nonfinite` (a rank that skips its step
# when its own loss is NaN). For each you run the broken code under a tool, read the report,
# write a diagnosis (the cause, the tool, a line of the report), and then the fix.
#
# `hc.run_case` hands a case to `hang_runner.py`, which makes every hang safe to run: a 3 s
# process-group timeout, a hard deadline that kills the ranks, and one tool per run:
# `timeout`, `detail` (`TORCH_DISTRIBUTED_DEBUG=DETAIL`), `flight` (the Flight Recorder) and
# `stacks` (`faulthandler` dumps). The clinic runs on gloo on every machine, GPU or not.

# %%
import hang_clinic as hc
from dpt.notebook import needs_tasks

# %% [markdown]
# ### The plain timeout
#
# The first tool is the one you get without asking: the collective gives up after the group's
# timeout. It tells you *that* the ranks waited, and *where*, but not *why*:

# %%
print(hc.run_case("order", tool="timeout").text)

# %% [markdown]
# ### `TORCH_DISTRIBUTED_DEBUG=DETAIL`
#
# With this variable set before the process group is made, every collective first compares a
# fingerprint across the ranks: sequence number, op, shapes, dtypes. A mismatch raises at
# once, on every rank, naming both sides. The check costs a small all-gather per collective:
# a debugging tool, not for training runs. (DDP crashes under it on gloo in torch 2.14, so the
# `uneven` case refuses it.)

# %%
print(hc.run_case("order", tool="detail").text)

# %% [markdown]
# ### The Flight Recorder
#
# With `TORCH_FR_BUFFER_SIZE` set, each rank keeps its last collectives in a ring buffer. Line
# the ranks up by collective number: where they part, the bug is. Here rank 0 all-reduces its
# mean loss while rank 1 has already gone on to the barrier:

# %%
print(hc.run_case("rank0", tool="flight").text)

# %% [markdown]
# ### Stack dumps
#
# `faulthandler` dumps each rank's Python stack every half second, and the report shows the
# last dump, taken while the rank waited: the line every rank waits on. In the uneven case one rank waits in the barrier after its last batch, the
# other in `backward` (DDP's gradient all-reduce) of a batch the first rank does not have:

# %%
print(hc.run_case("uneven", tool="stacks").text)

# %% [markdown]
# Not every mismatch waits. Two calls of different sizes can kill a process from inside gloo,
# as here, or (an `all_reduce` of 4 numbers meeting one of 3) "succeed" with garbage:

# %%
print(hc.run_case("shapes", tool="timeout").text)

# %% [markdown]
# ### Your diagnoses and fixes
#
# For each case write `diagnose_<case>()` (10.11-10.15): a `Cause`, the tool you read, and a
# line copied from its report (paths, line numbers and times do not matter). Then the fixed
# function. `check_case` grades one as the tests do: the evidence must be in the tool's report
# on the broken code, and the fixed code must finish. `uneven` is fixed with `Join`, the
# others by making every rank call the same collectives.

# %%
with needs_tasks("10.11"):
    print("\n".join(hc.check_case("order")))
with needs_tasks("10.12"):
    print("\n".join(hc.check_case("rank0")))
with needs_tasks("10.13"):
    print("\n".join(hc.check_case("shapes")))
with needs_tasks("10.14"):
    print("\n".join(hc.check_case("uneven")))
with needs_tasks("10.15"):
    print("\n".join(hc.check_case("nonfinite")))

# %% [markdown]
# ## What you have seen
#
# - A trace shows what a step's clock cannot: which collective ran when, on which thread or
#   stream, and how much of it the backward hid. Open yours in Perfetto when a job is slow.
# - The compiler cuts its graph where DDP's buckets end, so that DDP can still overlap; compile,
#   then wrap.
# - A communication hook decides what goes on the wire: half the bytes in bf16, a sketch with
#   PowerSGD, each with its cost in accuracy, measured.
# - A hang is a disagreement between ranks about the next collective. A short timeout stops
#   it, `TORCH_DISTRIBUTED_DEBUG=DETAIL`, stack dumps and the Flight Recorder name it, and the
#   fix makes every rank call the same collectives (or lets `Join` shadow the missing ones).
#
# `make benchmark` times `ddp_compiled`, `ddp_bf16_hook` and `ddp_powersgd` beside `ddp_spawn`
# (lesson 14 reads the results).
