# %% [markdown]
# # Lesson 12: what a step costs
#
# A step is arithmetic and bytes. This notebook counts both by hand and then asks when the
# bytes start to cost time: the FLOPs of a step and the MFU it reaches (12.1-12.4), what the
# four collectives deliver as nccl-tests reports it (12.5, 12.6), the memory a rank holds and
# the bytes it sends under DDP and ZeRO-1/2/3 (12.7, 12.8), and, for models from the course's
# to Llama-3.1-8B, how much of a step's communication hides behind compute (12.9, 12.10).
#
# | task | function | what it does |
# |---|---|---|
# | 12.1 | `flops.linear_flops`, `conv2d_flops`, `attention_flops` | one layer's forward FLOPs |
# | 12.2 | `flops.layer_flops` | a recorded layer's forward and backward FLOPs |
# | 12.3 | `flops.transformer_params`, `transformer_step_flops`, `six_n_flops` | a transformer's step from its config, and 6·N·tokens |
# | 12.4 | `flops.utilization` | achieved FLOP/s and MFU |
# | 12.5 | `bandwidth.bus_factor`, `bandwidths` | algbw and busbw, nccl-tests' way |
# | 12.6 | `bandwidth.time_collective` | one collective timed on every rank |
# | 12.7 | `memory_calc.memory_per_rank` | model state per rank under DDP, ZeRO-1/2/3 |
# | 12.8 | `memory_calc.bytes_per_step` | bytes one rank sends per step over a ring |
# | 12.9 | `crossover.link_bytes_per_s`, `collectives` | when each collective runs, and its seconds |
# | 12.10 | `crossover.step_split`, `hiding_tokens` | exposed communication, and the batch that hides it |

# %%
from dpt.notebook import bench_result, needs_tasks, use_lesson

use_lesson("12_step_cost")

import matplotlib.pyplot as plt

# %% [markdown]
# Each cell below runs inside `with needs_tasks(...)`, which names the tasks it uses. A cell
# that reaches a task you have not done yet prints `skipped: this cell needs Task NN.K` instead
# of a traceback, and the rest of the notebook still runs.
#
# ## FLOPs by hand (12.1-12.4)
#
# A step's arithmetic is almost all matrix multiplication. An (m × k) by (k × n) product is
# m·n dot products of length k: one multiply and one add per term, **2·m·k·n FLOPs**. So a
# Linear layer `in → out` on T tokens costs 2·T·in·out, a Conv2d 2·B·C_out·H_out·W_out·(C_in/g)·k²
# (the *output's* size: stride and padding change it), and attention two matmuls of
# 2·t_q·t_k·d per head, the full t × t square even when causal (the plain MATH path multiplies
# it all, then masks). Bias adds, norms, activations, pooling and embedding lookups cost
# memory traffic, not matmuls, and `torch.utils.flop_counter.FlopCounterMode` counts them 0:
# we count as it does.
#
# Backward does a layer's work twice: the weight's gradient `xᵀ·dy` and the input's `dy·Wᵀ`,
# each the forward's size. The first layer's input is the data, which needs no gradient, so it
# computes only the first: 1× forward there, 2× everywhere else. `count_flops` records each
# layer's shapes with forward hooks (given) and adds up your `layer_flops` (12.2). Below, the
# TinyTransformer's layers, and the three course models against FlopCounterMode:

# %%
from collections import defaultdict

import flops as fl
from dpt.flops import count_step

with needs_tasks("12.1", "12.2"):
    model, x, y, loss_fn, config = fl.course_model("transformer", 8, "cpu")
    count = fl.count_flops(model, x)
    by_kind = defaultdict(lambda: [0, 0, 0])
    for _, kind, fwd, bwd in count.layers:
        by_kind[kind][0] += 1
        by_kind[kind][1] += fwd
        by_kind[kind][2] += bwd
    print("TinyTransformer (dim 64, 4 layers, seq 64), batch 8, by kind of layer:")
    print(f"{'kind':<10}{'calls':>6}{'forward':>14}{'backward':>14}")
    for kind, (calls, fwd, bwd) in by_kind.items():
        print(f"{kind:<10}{calls:>6}{fwd:>14,}{bwd:>14,}")
    print()
    print(f"{'model':<12}{'fwd (hand)':>14}{'fwd (torch)':>14}{'bwd (hand)':>14}"
          f"{'bwd (torch)':>14}{'bwd/fwd':>9}")
    for name in fl.MODEL_NAMES:
        model, x, _, _, _ = fl.course_model(name, 8, "cpu")
        mine, torch_count = fl.count_flops(model, x), count_step(model, x)
        print(f"{name:<12}{mine.forward:>14,}{torch_count['forward']:>14,}"
              f"{mine.backward:>14,}{torch_count['backward']:>14,}"
              f"{mine.backward / mine.forward:>9.3f}")

# %% [markdown]
# The MLP's backward is barely more than its forward: its first layer (784 → 128) holds 99% of
# its FLOPs and computes no input gradient. The ConvNet's is 1.89×, the transformer's exactly
# 2× (its first matmul sees the embeddings, which do need gradients).
#
# ## When does 6N hold? (12.3)
#
# Each weight of a Linear is used once per token, in a multiply-add: 2 FLOPs forward, 4
# backward. With N the Linear weights (not the embedding tables: a lookup multiplies nothing),
# a step on D tokens costs about **6·N·D** (Kaplan et al. 2020). What it leaves out is
# attention, 12·L·B·t²·d per step against 6·N·B·t with N ≈ 12·L·d²: a share of about
# t / (6·d). Your exact count from the configuration against 6N, for model widths from the
# TinyTransformer's 64 to GPT-3's 12288, as the sequence grows:

# %%
with needs_tasks("12.1", "12.3"):
    seqs = [64, 256, 1024, 4096, 16384]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for dim in (64, 768, 4096, 12288):
        errors = []  # % of the exact step that 6N misses
        for t in seqs:
            exact = fl.transformer_step_flops(1, t, layers=12, dim=dim, vocab=50257)
            n = fl.transformer_params(12, dim, 50257)
            errors.append(100 * (exact - fl.six_n_flops(n, t)) / exact)
        ax.plot(seqs, errors, marker="o", label=f"dim {dim}")
    ax.set(xscale="log", xlabel="sequence length t", ylabel="6N misses (% of the step)",
           title="6N·tokens against the exact count (12 layers)")
    ax.axhline(2, color="grey", lw=0.8, ls="--")
    ax.legend()
    plt.show()

# %% [markdown]
# With GPT-2's vocabulary (50257 tokens, whose head is in N) and 12 layers, at t = 1024 6N
# misses 29% of a dim-64 model's step, 13% at dim 768 (GPT-2 small) and 1.3% at dim 12288
# (GPT-3's width): within a few percent only while t is well under 6·d. The TinyTransformer
# itself (dim 64, t = 64, a small vocabulary) misses 13%. A narrow model on long sequences
# spends most of its step in attention, and 6N is no estimate at all there.
#
# ## Achieved FLOP/s and MFU (12.4)
#
# MFU (PaLM, appendix B) = model FLOPs per step / seconds per step / peak FLOP/s. *Model*
# FLOPs: those above, not what the implementation ran (a forward recomputed by activation
# checkpointing is time spent, not model FLOPs). The peak: a GPU's datasheet figure for the
# dtype, or on a CPU a matmul probe (`dpt.flops.peak_flops` says which). The TinyTransformer
# on this machine at a few batch sizes:

# %%
from dpt.flops import peak_flops

with needs_tasks("12.1", "12.2", "12.4"):
    peak, label = peak_flops("cpu")
    print(f"peak {peak / 1e9:.1f} GFLOP/s ({label})")
    print(f"{'batch':>6}{'step ms':>10}{'GFLOP/s':>10}{'MFU':>8}")
    for batch in (1, 4, 16):
        model, x, y, loss_fn, _ = fl.course_model("transformer", batch, "cpu")
        seconds = fl.time_step(model, x, y, loss_fn, steps=3, device="cpu")
        u = fl.utilization(model, x, seconds, peak)
        print(f"{batch:>6}{seconds * 1e3:>10.1f}{u['achieved'] / 1e9:>10.2f}{u['mfu']:>8.1%}")

# %% [markdown]
# A larger batch gives each matmul more rows to share the loads of its weights, so the achieved
# FLOP/s usually climbs towards the probe's. On a busy machine the timings jump, and the
# probe too: an MFU above 100% means the probe ran while the cores were shared; run the cell
# again. At batch 1 the model's matrices are too small to keep the chip busy; on a GPU, with
# a peak a thousand times higher, far more so: that, before any communication, is why a tiny
# per-rank batch wastes a GPU.

# %% [markdown]
# ## Collective bandwidth (12.5, 12.6)
#
# A collective's time says little on its own: an all-reduce of 64 MB takes longer on 8 ranks
# than on 2 over the same links, and an all-gather of the same size moves half as much.
# nccl-tests (NVIDIA/nccl-tests, `doc/PERFORMANCE.md`) reports two numbers instead, and so
# does `bandwidth.py`:
#
# - **algbw** = S / t, with S the size of the *whole* array: the buffer of an all-reduce or a
#   broadcast, the gathered output of an all-gather (N × each rank's chunk), the input of a
#   reduce-scatter (N × each rank's output chunk);
# - **busbw** = algbw × a factor, the bytes one rank's link carried per second: an all-reduce
#   is a reduce-scatter then an all-gather, 2(n−1) transfers per element spread over n links,
#   so its factor is 2(n−1)/n; all-gather and reduce-scatter do one half each, (n−1)/n; a
#   broadcast sends every byte out of the root's one link, 1.
#
# busbw is the number to hold against the hardware (NVLink, PCIe, InfiniBand, a CPU's
# memory), and it stays flat as N grows where algbw falls. The factors, and what they make
# of one measurement, an all-gather of 64 MB on 8 ranks in 10 ms (each rank brings 8 MB):

# %%
import bandwidth as bw

with needs_tasks("12.5"):
    print(f"{'n':>3}" + "".join(f"{op:>16}" for op in bw.OPS))
    for n in (1, 2, 4, 8, 64):
        print(f"{n:>3}" + "".join(f"{bw.bus_factor(op, n):>16.3f}" for op in bw.OPS))
    chunk = 8 * 2**20
    one = bw.bandwidths("all_gather", chunk, 8 * chunk, 0.010, 8)
    print(f"\nall-gather, 8 ranks, 10 ms: S = {one['size'] / 2**20:.0f} MB, "
          f"algbw {one['algbw'] / 1e9:.2f} GB/s, busbw {one['busbw'] / 1e9:.2f} GB/s")

# %% [markdown]
# At one rank nothing crosses a link: the factors are 0 (nccl-tests prints a busbw of 0),
# broadcast's stays 1 by its formula.
#
# Timing a collective (12.6) is lesson 05's recipe, now yours to write: the tensors sized per
# operation on the rank's device, a few untimed calls first (the first sets up the
# connections; NCCL builds its communicator there), then each timed call between a barrier
# (every rank starts together) and two clock reads, each after a device sync (on a GPU the
# call returns once the work is queued), the median of the repeats, and the slowest rank's
# median (an all-reduce with `MAX`): a collective is done when its last rank is. Below, the
# four collectives from 1 KB to 256 KB on 2 ranks, a few seconds:

# %%
with needs_tasks("12.5", "12.6"):
    result = bw.measure(bw.OPS, bw.sizes_between(1024, 256 * 1024), [2], repeats=3, warmup=1)
    print(bw.format_table(result))
    bw.plot(result)
    plt.show()

# %% [markdown]
# Small messages are latency: their time hardly changes with the size, so their bandwidth
# grows with it. Large ones approach the link's speed, and busbw levels off. The line
# `alpha = .. us, bandwidth = .. GB/s` is lesson 05's ring model t = α + 2(n−1)/n · S / B
# fitted to the all-reduce rows, weighting each point by its relative error so that α comes
# from the small messages and B from the large ones: B is the level busbw reaches.
#
# On gloo, the reduce-scatter rows say "emulated": torch's gloo backend has no reduce-scatter
# of its own and runs an all-reduce of the whole input, then keeps this rank's slice. It
# moves twice what a reduce-scatter moves, so its busbw comes out about half of the
# all-reduce's: that row measures an all-reduce, not a reduce-scatter. NCCL's is the real
# one. `benchmarks/bench_l12_collectives.py` runs the whole sweep (1 KB to 64 MB, every N
# the machine allows); on GPUs `make gpu-check` runs it over NVLink or PCIe.

# %% [markdown]
# ## Memory per rank and bytes per step (12.7, 12.8)
#
# Between two steps a data-parallel rank keeps its *model state*: the parameters, their
# gradients, the optimizer's state (Adam: two fp32 tensors per parameter) and, under mixed
# precision, an fp32 master copy of the parameters. ZeRO (Rajbhandari et al. 2020) removes
# the copies stage by stage: ZeRO-1 shards the optimizer state (and the master copy) over the
# N ranks, ZeRO-2 also the gradients, ZeRO-3 (= FSDP) also the parameters. A shard is
# ceil(P/N) elements: the flat vector is padded to a multiple of N, as lesson 09's shards are.
#
# The network pays for it. With ring collectives one rank sends (N-1)/N of a buffer per pass:
# DDP's all-reduce is two passes over the gradients, ZeRO-1/2's reduce-scatter of the
# gradients and all-gather of the parameters are the same two, and ZeRO-3 gathers the
# parameters twice (forward and backward): 1.5 times DDP.
#
# Your `memory_per_rank` (12.7) and `bytes_per_step` (12.8), for a 1.3B-parameter model on
# 8 ranks, fp32 and then mixed precision (bf16 parameters and gradients):

# %%
import memory_calc as mc

with needs_tasks("12.7", "12.8"):
    for dtype in ("fp32", "bf16"):
        print(f"1.3B parameters, N = 8, Adam, {dtype} (GB = 1e9 bytes):")
        print(mc.format_table(mc.table(1_300_000_000, 8, dtype)), end="\n\n")

# %% [markdown]
# The ZeRO paper's Figure 1 is the same table for 7.5B parameters on 64 ranks in mixed
# precision: 120, 31.4, 16.6 and 1.9 GB per rank. Below, the total per rank as N grows, next
# to what one H100 (80 GB) and one H200 (141 GB) hold: DDP's 120 GB would fit an H200 only
# with nothing else on it (no activations, no buffers); ZeRO-1 and -2 level off at the
# parameters (and gradients) they still keep whole; only ZeRO-3 keeps falling. The right
# panel is the price: bytes one rank sends per step, (N-1)/N of 2 Psi x 2 bytes for DDP,
# ZeRO-1 and ZeRO-2 (their lines lie on each other) and of 3 Psi x 2 bytes for ZeRO-3: half
# of that at N = 2, close to all of it from N = 16 on. Adding ranks does not make a rank's
# traffic smaller.

# %%
with needs_tasks("12.7", "12.8"):
    psi, ns = 7_500_000_000, [1, 2, 4, 8, 16, 32, 64, 128]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for s in mc.STRATEGIES:
        left.plot(ns, [mc.memory_per_rank(psi, n, s, "fp16")["total"] / 1e9 for n in ns],
                  marker="o", label=mc.LABELS[s])
        right.plot(ns, [mc.bytes_per_step(psi, n, s, "fp16")["sent"] / 1e9 for n in ns],
                   marker="o", label=mc.LABELS[s])
    for gb, name in ((80, "H100 80 GB"), (141, "H200 141 GB")):
        left.axhline(gb, color="grey", lw=0.8, ls="--")
        left.text(ns[-1], gb, name, ha="right", va="bottom", fontsize=8)
    left.set(xscale="log", yscale="log", xlabel="ranks N", ylabel="GB per rank",
             title="model state, 7.5B params, fp16 + Adam")
    right.set(xscale="log", xlabel="ranks N", ylabel="GB sent per rank and step",
              title="ring traffic per step")
    left.set_xticks(ns, [str(n) for n in ns])
    right.set_xticks(ns, [str(n) for n in ns])
    left.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# The calculator counts model state only. Lesson 09 measured a TinyTransformer's tensors
# byte by byte (`l09_memory.json`); side by side with the calculator, in KiB per rank
# (the fullest rank), and the calculator's whole model state beside the step's measured peak. Parameters, gradients and Adam state agree exactly for DDP and both
# FSDPs; lesson 08's ZeRO-1 and -2 hold a little more than an even share on one rank, because
# they give each rank whole tensors, not flat slices. The step's peak is much higher than the
# resting state: activations, DDP's gradient buckets, the gathered units, the temporaries.

# %%
import json

from dpt.models import TinyTransformer

with needs_tasks("12.7"):
    l09 = json.loads(bench_result("l09_memory.json").read_text())
    config = json.loads(l09["model"].split(" ", 1)[1].replace("'", '"'))
    p = sum(t.numel() for t in TinyTransformer(**config).parameters())
    stage = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "fsdp": "zero3", "fsdp2": "zero3"}
    print(f"TinyTransformer, {p:,} parameters, Adam fp32; KiB per rank, calculator / measured")
    print(f"{'method':<8}{'N':>3}" + "".join(f"{k:>20}" for k in ("params", "grads",
                                                                   "optimizer", "state / peak")))
    for row in l09["table"]:
        want = mc.memory_per_rank(p, row["world_size"], stage[row["method"]])
        got = row["measured"]
        cells = [f"{want[k] / 1024:8.1f} / {got[k] / 1024:8.1f}"
                 for k in ("params", "grads", "optimizer")]
        cells.append(f"{want['total'] / 1024:8.1f} / {got['peak'] / 1024:8.1f}")
        print(f"{row['method']:<8}{row['world_size']:>3}" + "".join(f"{c:>20}" for c in cells))

# %% [markdown]
# The tests check both functions against what lessons 08 and 09's code really does on two
# ranks: they sum the bytes of every parameter, gradient and Adam-state tensor after a step,
# and wrap `torch.distributed`'s collectives to count the bytes of each call. Two findings:
# lesson 08's ZeRO-1 keeps DDP's all-reduce and then broadcasts the parameters, so it sends
# 3(N-1)/N of the model, not the 2(N-1)/N of the paper's ZeRO-1; lesson 09's FSDP gathers
# the root unit once and keeps it through backward, so the root moves half what the table
# says.

# %% [markdown]
# ## The crossover: when does communication stop hiding? (12.9, 12.10)
#
# A step on N ranks computes its share of the batch and moves P·b bytes of gradients (and,
# sharded, of parameters) around a ring: your `bytes_per_step` (12.8) counted them. Per rank:
# DDP sends 2(N-1)/N·P·b (one all-reduce), ZeRO-1/2 the same as a reduce-scatter plus an
# all-gather, FSDP 3(N-1)/N·P·b (a gather in forward, another in backward, a reduce-scatter).
# `crossover.collectives` (12.9) takes those bytes and places each collective in the step.
# Compute is 6·P·tokens / (peak·MFU), a third forward and two thirds backward. DDP's all-reduce can hide only behind backward; FSDP's
# gathers prefetch under forward and backward; ZeRO-1/2's all-gather follows the step.
#
# Below: Llama-3.1-8B on 8 H100s (bf16, an assumed 40% MFU, 4096 tokens per rank) over each
# interconnect, then the table and figure for GPT 125M, 1.3B and 8B.

# %%
import math

import crossover as co
from dpt.interconnects import PRESETS

with needs_tasks("12.8", "12.9", "12.10"):
    peak, peak_label = co.default_peak()
    llama = co.REAL_MODELS[-1]
    print(f"{llama.name}, N=8, 4096 tokens per rank, MFU 40% of {peak_label}")
    for name in co.LINKS:
        setup = co.Setup(llama.params, 8, PRESETS[name], peak, 0.4, 2,
                         co.calls_of("ddp", llama))
        split = co.step_split("ddp", setup, 4096)
        print(f"  DDP over {PRESETS[name].label:<26} compute {split.compute_s * 1e3:7.0f} ms, "
              f"all-reduce {split.comm_s * 1e3:8.0f} ms, exposed {split.exposed_s * 1e3:8.0f} ms;"
              f" hidden from {co.hiding_tokens('ddp', setup):>8,} tokens/rank")

# %% [markdown]
# The batch that hides DDP's all-reduce hardly depends on the model: compute and traffic both
# grow with P, so it is the device's FLOP/s over the link's bytes per second (latency aside).
# The table has every strategy; "never" is ZeRO-1/2 with its all-gather after the step, and
# the last column overlaps it with the next forward.

# %%
with needs_tasks("12.8", "12.9", "12.10"):
    rows = co.crossover_rows()
    print(co.table([r for r in rows if r["link"] in ("nvlink4", "pcie4x16", "ethernet-100g")]))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    co.plot_crossover(rows, a, b)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## What to take away
#
# - A step's FLOPs are counted, not guessed: 2 per multiply-add, the backward about twice the
#   forward, 6·N·tokens for a transformer whose sequence is short next to its width.
# - MFU needs a stated peak: a datasheet's for the dtype on a GPU, a matmul probe on a CPU.
#   `make benchmark` prints it for every method (lesson 14 reads it).
# - busbw, not the time, is what compares across N and against the link.
# - ZeRO trades memory for traffic: stages 1 and 2 send what DDP sends, stage 3 half as much
#   again; a rank's traffic does not shrink as N grows.
# - Whether that traffic costs time depends on the tokens per rank, not on the model's size:
#   the device's FLOP/s over the link's bytes per second sets the batch that hides it.
