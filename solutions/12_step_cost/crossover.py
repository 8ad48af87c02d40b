"""Lesson 12: when does data parallelism become communication-bound?

A data-parallel step on N ranks computes its share of the batch and moves the model's
gradients (and, when the model is sharded, its parameters) around a ring. Whether the step
pays for N ranks depends on how much of that communication hides behind the computation.

**What runs when.** What one rank sends per step is task 12.8's answer,
``memory_calc.bytes_per_step``, used here as it is (a ring sends (N-1)/N of a buffer per
reduce-scatter or all-gather, 2(N-1)/N per all-reduce; nccl-tests, doc/PERFORMANCE.md). This
file adds *when* each collective runs, which decides what it can hide behind. With P
parameters of b bytes (b = 2 for bf16), per step (ZeRO paper, Rajbhandari et al. 2020,
section 7):

- DDP: one all-reduce of the gradients, during backward    2(N-1)/N·P·b
- ZeRO-1 and ZeRO-2: a reduce-scatter of the gradients during backward (each rank keeps the
  sum of its shard, updates it), an all-gather of the updated parameters after the optimizer
  step                                                        (N-1)/N·P·b twice = the same
- FSDP (ZeRO-3): an all-gather of the parameters in forward, another in backward (they were
  freed after forward), a reduce-scatter of the gradients in backward
                                                             3(N-1)/N·P·b (1.5x DDP)

``bytes_per_step`` counts FSDP's two gathers together (its ``all_gather``): here each one is
a collective of its own, half of it, one in forward and one in backward.

**How long it takes (the alpha-beta model).** A collective call costs a fixed latency alpha
plus the bytes it sends over the link's bandwidth::

    t = calls · alpha + bytes_sent / bandwidth

A call is one bucket of DDP's gradients (25 MB by default), one FSDP unit (a transformer
block); the bandwidth is per direction. A GPU link is specified in bytes per second (NVLink 4:
450 GB/s each way), a network in *bits* per second (InfiniBand NDR: 400 Gb/s = 50 GB/s).

**What a step computes.** A transformer does about 6 FLOPs per parameter per token (Kaplan
et al. 2020, "Scaling Laws for Neural Language Models"; Chinchilla's C = 6·N·D): 2 in forward
(a multiply-add per weight), 4 in backward (the gradient of the input and of the weight). At a
model FLOPs utilisation MFU of the device's peak (PaLM, Chowdhery et al. 2022, appendix B)::

    compute = 6 · P · tokens_per_rank / (peak · MFU)     forward 1/3 of it, backward 2/3

**What hides behind what.** A collective can only run while there is compute it does not
wait for, and only once its input exists:

- DDP's all-reduce starts as gradients appear, so it overlaps backward, never forward:
  exposed = max(0, t_allreduce - backward);
- ZeRO-1/2's reduce-scatter overlaps backward the same way; its all-gather of the updated
  parameters comes after the optimizer step, so it is exposed, unless it is overlapped with
  the next step's forward (``overlap_next_forward``; DeepSpeed's stage 1/2 do not by default);
- FSDP prefetches the next unit's parameters: its forward all-gathers hide under forward,
  its backward all-gathers and reduce-scatters under backward (ideal prefetch: the first
  unit's gather, which nothing can hide, is ignored).

The compute grows with the tokens per rank; the communication does not. So there is a batch
per rank above which the communication is fully hidden, in closed form: for DDP,
``t_allreduce = 2/3 · c · T``, with c the compute seconds per token. Since both sides grow
with P, that batch hardly depends on the model's size (latency aside): it is set by the ratio
of the device's FLOP/s to the link's bytes/s.

Your tasks:

- 12.9 :func:`link_bytes_per_s` and :func:`collectives`: which collectives a step runs and
  when, each with the bytes 12.8's ``bytes_per_step`` gives it, and the seconds the
  alpha-beta model gives them;
- 12.10 :func:`step_split` and :func:`hiding_tokens`: a step as compute plus exposed
  communication, and the tokens per rank that hide the communication.

Given: the course's models and three real ones (GPT-3 Small 125M, GPT-3 XL 1.3B,
Llama-3.1-8B), the table the CLI prints and the figure it draws (:func:`crossover_rows`,
:func:`plot_crossover`; the benchmark's cost-model figure draws the same)::

    .venv/bin/python solutions/12_step_cost/crossover.py
    .venv/bin/python solutions/12_step_cost/crossover.py --n 64 --mfu 0.3 --tokens 2048
"""

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import memory_calc

from dpt.interconnects import PRESETS, Interconnect

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
ALIASES = {"zero3": "fsdp"}
OPS = ("all_reduce", "reduce_scatter", "all_gather")
WHEN = ("forward", "backward", "after_step")  # when a collective runs in the step
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb=25 (MiB)


def strategy_name(strategy: str) -> str:
    """``strategy`` checked, its alias resolved ("zero3" is "fsdp")."""
    name = ALIASES.get(strategy, strategy)
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from "
                         f"{', '.join(STRATEGIES + tuple(ALIASES))}")
    return name


@dataclass(frozen=True)
class Setup:
    """A training setup: the model's size, the ranks, the link, and how fast they compute.

    ``calls``: collective calls per collective in a step (DDP's buckets, FSDP's units), each
    paying the link's latency once. ``flops_per_token``: None means the transformer's 6·P.
    """

    params: float
    n: int
    link: Interconnect
    peak_flops: float
    mfu: float = 0.4
    bytes_per_elem: int = 2
    calls: int = 1
    flops_per_token: float | None = None

    def __post_init__(self):
        if not self.params > 0:
            raise ValueError(f"params must be positive, got {self.params}")
        if self.n < 1 or self.calls < 1 or self.bytes_per_elem < 1:
            raise ValueError(f"n, calls and bytes_per_elem must be at least 1, got n={self.n}, "
                             f"calls={self.calls}, bytes_per_elem={self.bytes_per_elem}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu is a fraction of the peak, in (0, 1], got {self.mfu}")
        if not self.peak_flops > 0:
            raise ValueError(f"peak_flops must be positive, got {self.peak_flops}")


@dataclass(frozen=True)
class Collective:
    """One collective of a step: its op, when it runs, what one rank sends, how long."""

    op: str  # one of OPS
    when: str  # one of WHEN
    sent_bytes: float  # by one rank
    seconds: float


@dataclass(frozen=True)
class StepSplit:
    """A step's seconds: compute (forward + backward) and the communication left exposed."""

    strategy: str
    tokens_per_rank: float
    forward_s: float
    backward_s: float
    comm_s: float  # all the communication, hidden or not
    exposed_s: float  # the part the step waits for

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s


def ring_bytes(strategy: str, setup: Setup) -> dict[str, int]:
    """What one rank sends per step, by kind of collective: task 12.8's
    ``memory_calc.bytes_per_step`` for this setup (``{"all_reduce", "reduce_scatter",
    "all_gather", "sent", "received"}``, bytes). Its parameter count rounded to a whole number,
    FSDP under its ZeRO name (zero3), every buffer ``setup.bytes_per_elem`` bytes an element."""
    name = strategy_name(strategy)
    name = "zero3" if name == "fsdp" else name  # memory_calc's name for FSDP
    return memory_calc.bytes_per_step(round(setup.params), setup.n, name, setup.bytes_per_elem)


# --- 12.9 when each collective runs, and how long it takes ---------------------------------

def link_bytes_per_s(link: Interconnect) -> float:
    """The link's bandwidth in bytes per second, from the figure its specification states
    (``link.rate`` in ``link.unit``: "GB/s", gigabytes, or "Gb/s", gigabits)."""
    # BEGIN SOLUTION 12.9: a GB/s figure is 1e9 bytes a second; a Gb/s figure is 1e9 bits, and a byte is 8 bits
    if link.unit == "Gb/s":
        return link.rate * 1e9 / 8
    return link.rate * 1e9
    # END SOLUTION


def collectives(strategy: str, setup: Setup) -> list[Collective]:
    """The collectives of one step under ``strategy``, in the order they run, each with the
    bytes one rank sends over a ring and its seconds in the alpha-beta model.

    The bytes are 12.8's, by kind (:func:`ring_bytes`); a kind that runs twice in a step
    (FSDP's all-gathers) shares them equally. ``when``: "forward", "backward" or
    "after_step". Each collective pays ``setup.calls`` latencies (``setup.link.latency_us``
    each). One rank (n = 1): the same list, 0 bytes and 0 s.
    """
    strategy = strategy_name(strategy)
    # BEGIN SOLUTION 12.9: list (op, when) per strategy (DDP: one all-reduce in backward; ZeRO-1/2: reduce-scatter in backward, all-gather after the step; FSDP: all-gather in forward, all-gather and reduce-scatter in backward); each takes ring_bytes' bytes for its op, split among the collectives of that op; seconds = calls * alpha + sent / bandwidth
    plan = {"ddp": [("all_reduce", "backward")],
            "zero1": [("reduce_scatter", "backward"), ("all_gather", "after_step")],
            "zero2": [("reduce_scatter", "backward"), ("all_gather", "after_step")],
            "fsdp": [("all_gather", "forward"), ("all_gather", "backward"),
                     ("reduce_scatter", "backward")]}[strategy]
    by_op = ring_bytes(strategy, setup)
    ops = [op for op, _ in plan]
    bandwidth = link_bytes_per_s(setup.link)
    out = []
    for op, when in plan:
        if setup.n == 1:
            out.append(Collective(op, when, 0.0, 0.0))
            continue
        sent = by_op[op] / ops.count(op)  # FSDP: its two gathers share bytes_per_step's one
        seconds = setup.calls * setup.link.latency_us * 1e-6 + sent / bandwidth
        out.append(Collective(op, when, sent, seconds))
    return out
    # END SOLUTION


def bytes_sent(strategy: str, setup: Setup) -> float:
    """All the bytes one rank sends in a step."""
    return sum(c.sent_bytes for c in collectives(strategy, setup))


def comm_seconds(strategy: str, setup: Setup) -> float:
    """All of a step's communication, in seconds, hidden or not."""
    return sum(c.seconds for c in collectives(strategy, setup))


# --- 12.10 compute against exposed communication ---------------------------------------------

def step_split(strategy: str, setup: Setup, tokens_per_rank: float,
               overlap_next_forward: bool = False) -> StepSplit:
    """One step of ``strategy`` at ``tokens_per_rank``: forward and backward seconds, all the
    communication, and the part of it not hidden behind compute (see the module's text for
    what overlaps what). ``overlap_next_forward``: ZeRO-1/2's all-gather after the step hides
    under the next step's forward (with any forward collectives)."""
    if tokens_per_rank < 0:
        raise ValueError(f"tokens_per_rank must be at least 0, got {tokens_per_rank}")
    strategy = strategy_name(strategy)
    # BEGIN SOLUTION 12.10: compute = flops per token (6·P unless given) · tokens / (peak · MFU), a third forward and two thirds backward; add up the collectives' seconds by when they run; backward ones hide under backward, forward ones under forward; after-step ones are exposed, or join the forward ones when overlap_next_forward
    per_token = setup.flops_per_token or 6 * setup.params
    compute = per_token * tokens_per_rank / (setup.peak_flops * setup.mfu)
    forward, backward = compute / 3, 2 * compute / 3
    by_when = dict.fromkeys(WHEN, 0.0)
    for c in collectives(strategy, setup):
        by_when[c.when] += c.seconds
    after = by_when["after_step"]
    in_forward = by_when["forward"] + (after if overlap_next_forward else 0.0)
    exposed = (max(0.0, by_when["backward"] - backward) + max(0.0, in_forward - forward)
               + (0.0 if overlap_next_forward else after))
    return StepSplit(strategy, tokens_per_rank, forward, backward, sum(by_when.values()),
                     exposed)
    # END SOLUTION


def hiding_tokens(strategy: str, setup: Setup, overlap_next_forward: bool = False) -> float:
    """The fewest tokens per rank (an integer) at which ``step_split`` leaves no communication
    exposed; ``math.inf`` when no batch hides it (ZeRO-1/2's all-gather after the step,
    without ``overlap_next_forward``); 0 when there is nothing to hide. Closed form, no search.
    """
    strategy = strategy_name(strategy)
    # BEGIN SOLUTION 12.10: c = compute seconds per token; backward collectives need 2/3·c·T >= their seconds, forward ones (with the after-step gather when it overlaps the next forward) c/3·T >= theirs; an after-step gather that does not overlap never hides; round the largest T up
    c = (setup.flops_per_token or 6 * setup.params) / (setup.peak_flops * setup.mfu)
    by_when = dict.fromkeys(WHEN, 0.0)
    for coll in collectives(strategy, setup):
        by_when[coll.when] += coll.seconds
    if by_when["after_step"] > 0 and not overlap_next_forward:
        return math.inf
    in_forward = by_when["forward"] + by_when["after_step"]
    need = max(by_when["backward"] / (2 * c / 3), in_forward / (c / 3))
    return math.ceil(need)
    # END SOLUTION


# --- given: real model sizes, the table and the figure --------------------------------------

@dataclass(frozen=True)
class ModelSize:
    name: str
    params: float
    units: int  # FSDP units (transformer blocks); the course's small models: 1
    flops_per_token: float | None  # None: 6·params; the course's models: counted
    source: str


# Parameter counts with where they come from. GPT-3 Small and XL: Brown et al. 2020,
# "Language Models are Few-Shot Learners", table 2.1 (12 layers d=768; 24 layers d=2048).
# Llama-3.1-8B: Meta's model card, 8.03B parameters, 32 layers (Llama 3 Herd of Models,
# Dubey et al. 2024, table 3).
REAL_MODELS = (
    ModelSize("GPT 125M", 125e6, 12, None, "GPT-3 Small, Brown et al. 2020 table 2.1"),
    ModelSize("GPT 1.3B", 1.3e9, 24, None, "GPT-3 XL, Brown et al. 2020 table 2.1"),
    ModelSize("Llama-3.1-8B", 8.03e9, 32, None, "Meta model card; Dubey et al. 2024"),
)
LINKS = ("nvlink4", "pcie4x16", "infiniband-ndr", "ethernet-100g", "ethernet-10g")
GPU = "NVIDIA H100 80GB HBM3"  # the peak: dpt.flops' datasheet entry for H100 SXM, bf16 dense
MFU = 0.4  # an assumption: torchtitan reports 33-39% for Llama-3.1-8B on H100s


def course_models() -> list[ModelSize]:
    """The course's MLP, ConvNet and TinyTransformer: parameters counted, FLOPs per sample
    (a token for the transformer) counted by FlopCounterMode (a ConvNet reuses each weight
    at every position: far more than 6 FLOPs per parameter)."""
    import torch

    from dpt.flops import step_flops
    from dpt.models import MLP, ConvNet, TinyTransformer, count_parameters, token_batch

    image = torch.zeros(2, 1, 28, 28)
    tt = TinyTransformer()
    tokens, targets = token_batch(2, tt.seq_len)
    out = []
    for name, model, x, per, units in (("MLP", MLP(), image, 2, 1),
                                       ("ConvNet", ConvNet(), image, 2, 1),
                                       ("TinyTransformer", tt, tokens, tokens.numel(),
                                        len(tt.blocks))):
        flops = step_flops(model, x)
        out.append(ModelSize(name, count_parameters(model), units, flops / per,
                             "dpt.models, counted"))
    return out


def calls_of(strategy: str, model: ModelSize, bytes_per_elem: int = 2) -> int:
    """Collective calls per collective: DDP and ZeRO-1/2 one per 25 MiB bucket of gradients,
    FSDP one per unit (an assumption: one FSDP unit per transformer block)."""
    if strategy_name(strategy) == "fsdp":
        return model.units
    return max(1, math.ceil(model.params * bytes_per_elem / DDP_BUCKET_BYTES))


def default_peak() -> tuple[float, str]:
    import torch

    from dpt.flops import datasheet_peak

    return datasheet_peak(GPU, torch.bfloat16)


def crossover_rows(models=None, links=LINKS, strategies=("ddp", "zero2", "fsdp"), n=8,
                   tokens_per_rank=4096, mfu=MFU, peak=None, bytes_per_elem=2) -> list[dict]:
    """One row per (model, link, strategy): params, compute, communication and exposed
    milliseconds at ``tokens_per_rank``, and the tokens per rank that hide the communication
    (ZeRO-1/2: with their all-gather overlapping the next forward, and without)."""
    models = REAL_MODELS if models is None else models
    peak_flops, peak_label = peak or default_peak()
    rows = []
    for m in models:
        for link_name in links:
            for s in strategies:
                setup = Setup(m.params, n, PRESETS[link_name], peak_flops, mfu, bytes_per_elem,
                              calls_of(s, m, bytes_per_elem), m.flops_per_token)
                split = step_split(s, setup, tokens_per_rank)
                rows.append({"model": m.name, "params": m.params, "link": link_name,
                             "strategy": s, "n": n, "tokens_per_rank": tokens_per_rank,
                             "mfu": mfu, "peak": peak_label,
                             "compute_ms": 1e3 * split.compute_s,
                             "comm_ms": 1e3 * split.comm_s,
                             "exposed_ms": 1e3 * split.exposed_s,
                             "hiding_tokens": hiding_tokens(s, setup),
                             "hiding_tokens_overlapped": hiding_tokens(s, setup, True)})
    return rows


def _fmt_tokens(t: float) -> str:
    return "never" if math.isinf(t) else f"{t:,.0f}"


def table(rows: list[dict]) -> str:
    head = (f"{'model':<16}{'params':>9} {'link':<15}{'strategy':<9}{'compute ms':>11}"
            f"{'comm ms':>10}{'exposed ms':>11}{'hides at':>12}{'(overlapped)':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<16}{r['params']:>9.3g} {r['link']:<15}{r['strategy']:<9}"
                     f"{r['compute_ms']:>11.2f}{r['comm_ms']:>10.2f}{r['exposed_ms']:>11.2f}"
                     f"{_fmt_tokens(r['hiding_tokens']):>12}"
                     f"{_fmt_tokens(r['hiding_tokens_overlapped']):>13}")
    return "\n".join(lines)


def plot_crossover(rows: list[dict], ax_split, ax_hide, link_for_split: str = "pcie4x16"):
    """Panel 1 (``ax_split``): compute and exposed communication per model and strategy over
    one link, as shares of the step (each bar's label: the step's milliseconds). Panel 2
    (``ax_hide``): the tokens per rank that hide the communication, per model and link (DDP
    solid, FSDP dashed; log scale)."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    links = list(dict.fromkeys(r["link"] for r in rows))
    first = rows[0]
    sel = [r for r in rows if r["link"] == link_for_split]
    width = 0.8 / len(strategies)
    for j, s in enumerate(strategies):
        rs = [next(r for r in sel if r["model"] == m and r["strategy"] == s) for m in models]
        x = [i + (j - (len(strategies) - 1) / 2) * width for i in range(len(models))]
        step = [r["compute_ms"] + r["exposed_ms"] for r in rs]
        comp = [r["compute_ms"] / t for r, t in zip(rs, step)]
        exp = [r["exposed_ms"] / t for r, t in zip(rs, step)]
        ax_split.bar(x, comp, width * 0.9, color="tab:blue", alpha=0.5 + 0.5 * j / len(strategies),
                     label="compute" if j == 0 else None)
        ax_split.bar(x, exp, width * 0.9, bottom=comp, color="tab:orange",
                     label="exposed communication" if j == 0 else None)
        for xi, t in zip(x, step):
            ax_split.annotate(f"{s} {t:,.0f} ms" if t >= 10 else f"{s} {t:.2g} ms", (xi, 0.02), fontsize=6, ha="center",
                              va="bottom", rotation=90)
    ax_split.set_xticks(range(len(models)))
    ax_split.set_xticklabels(models, fontsize=7, rotation=20, ha="right")
    ax_split.set_ylim(0, 1)
    ax_split.set_ylabel("share of the step (label: step ms)")
    ax_split.set_title(f"Step split over {PRESETS[link_for_split].label}, N={first['n']}, "
                       f"{first['tokens_per_rank']} tokens/rank", fontsize=8)
    ax_split.legend(fontsize=7)
    for s, style in (("ddp", "-o"), ("fsdp", "--s")):
        if s not in strategies:
            continue
        for link in links:
            ys = [next(r["hiding_tokens"] for r in rows
                       if r["model"] == m and r["link"] == link and r["strategy"] == s)
                  for m in models]
            ax_hide.plot(range(len(models)), ys, style, ms=4,
                         label=f"{s}, {link}" if s == "ddp" else None,
                         color=f"C{links.index(link)}")
    ax_hide.set_xticks(range(len(models)))
    ax_hide.set_xticklabels(models, fontsize=7, rotation=20, ha="right")
    ax_hide.set_yscale("log")
    ax_hide.set_ylabel("tokens per rank that hide communication")
    ax_hide.set_title(f"Batch that hides communication (DDP solid, FSDP dashed); "
                      f"MFU {first['mfu']:.0%} of {first['peak'].split(',')[0]}", fontsize=8)
    ax_hide.legend(fontsize=6)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compute against exposed communication for real "
                                "model sizes: DDP, ZeRO and FSDP over named interconnects.")
    p.add_argument("--n", type=int, default=8, help="ranks (default 8)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (default 4096)")
    p.add_argument("--mfu", type=float, default=MFU, help="assumed MFU (default 0.4)")
    p.add_argument("--links", nargs="+", default=list(LINKS), metavar="LINK",
                   help=f"interconnects, from: {', '.join(PRESETS)}")
    p.add_argument("--course-models", action="store_true",
                   help="also the course's MLP, ConvNet and TinyTransformer")
    p.add_argument("--plot", type=Path, default=Path(__file__).parent / "runs" / "crossover.svg",
                   help="figure to write (.svg or .png); 'none' for no figure")
    args = p.parse_args(argv)
    try:
        if args.n < 1 or args.tokens < 1:
            raise ValueError(f"--n and --tokens must be at least 1, got {args.n} and "
                             f"{args.tokens}")
        if not 0 < args.mfu <= 1:
            raise ValueError(f"--mfu is a fraction of the peak, in (0, 1], got {args.mfu}")
        unknown = [x for x in args.links if x not in PRESETS]
        if unknown:
            raise ValueError(f"unknown interconnect(s) {', '.join(unknown)}; choose from "
                             f"{', '.join(PRESETS)}")
        models = (course_models() if args.course_models else []) + list(REAL_MODELS)
        rows = crossover_rows(models, args.links, n=args.n, tokens_per_rank=args.tokens,
                              mfu=args.mfu)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"N={args.n}, {args.tokens} tokens per rank, bf16 gradients, MFU {args.mfu:.0%} of "
          f"{rows[0]['peak']}; 'hides at': tokens per rank that hide the communication "
          "('overlapped': ZeRO's all-gather under the next forward)")
    print(table(rows))
    if str(args.plot) != "none":
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
        plot_crossover(rows, a, b, "pcie4x16" if "pcie4x16" in args.links else args.links[0])
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot)
        plt.close(fig)
        print(f"figure: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
