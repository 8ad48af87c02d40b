# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 10, part 1: what one training step looks like from the inside, read from a trace.

Lesson 05 timed its steps with hand-placed stamps. Here PyTorch's profiler records everything
that ran: every operator, every collective, on every thread (and, on a GPU, every kernel on
every stream). :func:`trace_rank` traces one step of each data-parallel method of the course:

- ``torch_ddp``: ``torch.nn.parallel.DistributedDataParallel``;
- ``naive``, ``overlap``, ``bucketed``: your DDPs of lesson 05;
- ``fsdp``: your hand-written FSDP of lesson 09; ``fsdp2``: ``fully_shard`` (lesson 09).

Each step is labelled with ``record_function("forward" | "backward" | "sync" | "optimizer")``
and saved as ``<out>/<method>.rank<r>.json``, a Chrome trace: open it in
https://ui.perfetto.dev (drag and drop the file) or chrome://tracing. What you write reads
those files back and answers one question per method: **how much of the communication ran
while the backward was computing**, hidden behind it, and how much the step had to wait for.

What a trace holds (``traceEvents``; the profiler's ``"ph": "X"`` events have a start ``ts``
and a duration ``dur``, both in microseconds, a process ``pid`` and a thread ``tid``):

- on the CPU with gloo, a collective shows twice: its *launch*, ``c10d::allreduce_`` (a
  ``cpu_op``, short, on the thread that called it), and its *execution*, ``gloo:all_reduce``
  (a ``user_annotation`` on one of gloo's own worker threads), which runs while the main
  thread goes on computing the backward;
- on a GPU with NCCL, the execution is a kernel (``"cat": "kernel"``) whose name contains
  ``nccl``, on its own stream; every kernel has an ``args["correlation"]`` that matches the
  ``cuda_runtime`` (or ``cuda_driver``) event of the CPU thread that launched it;
- on a GPU shared by the ranks (gloo with CUDA tensors, ``DPT_SHARE_GPU=1``), both: the
  backward's kernels, and ``gloo:...`` spans that start when the collective is issued and
  first wait for its input's copy to the host, which waits for the kernels queued before it.
  The table (:func:`summary`) counts such a span from the moment its input reached the host
  (:func:`as_run`): the wait for the backward is not communication.

Tasks: 10.1 :func:`read_trace`, 10.2 :func:`comm_intervals` and :func:`compute_intervals`,
10.3 :func:`merge` and :func:`overlap`, 10.4 :func:`hidden_fraction`.

    .venv/bin/python exercises/10_inside_a_step/traces.py                 # 2 CPU ranks, all
    .venv/bin/python exercises/10_inside_a_step/traces.py --methods naive bucketed
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # before torch: keeps the profiler's log quiet

import torch  # noqa: E402

from dpt.data import REPO_ROOT  # noqa: E402
from dpt.lessons import load  # noqa: E402 (the methods traced come from lessons 05 and 09)
from dpt.notebook import task_message  # noqa: E402

# the lesson's own runs/ (git ignores it): two copies of the lesson tracing at once do not
# overwrite each other's traces
OUT = Path(__file__).resolve().parent / "runs" / "l10_traces"
FIGURE = Path(__file__).resolve().parent / "runs" / "l10_timeline.png"
REFERENCE_FIGURE = REPO_ROOT / "benchmarks" / "reference" / "lessons" / "l10_timeline.png"
METHODS = ("torch_ddp", "naive", "overlap", "bucketed", "fsdp", "fsdp2")
LABELS = {"torch_ddp": "torch DDP", "naive": "naive (05)", "overlap": "overlapped (05)",
          "bucketed": "bucketed (05)", "fsdp": "FSDP by hand (09)", "fsdp2": "FSDP2"}
PHASES = ("forward", "backward", "sync", "optimizer")
# A TinyTransformer whose gradients (about 3 MB a block) take a 2-core CPU about as long to
# all-reduce as its backward takes to compute: there is something to hide.
MODEL = {"vocab": 256, "dim": 256, "heads": 4, "layers": 4, "seq_len": 64}
BATCH = 4  # sequences per rank
BUCKET_MB = 4.0  # for bucketed and torch DDP alike
# The profiler's own log (Kineto) in the ranks: "USDT ... profiler_start" lines and, on a
# machine without a GPU, "ERROR ... gpuGetDeviceCount failed" are noise, not failures.
QUIET = {"KINETO_LOG_LEVEL": "6"}


# --- 10.1: a trace file as plain events --------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """One complete event of a trace, times in milliseconds since the trace's first event."""

    name: str
    cat: str  # "cpu_op", "user_annotation", "kernel", "cuda_runtime", ...
    pid: int | str  # the process (on a GPU's lanes: the device)
    tid: int | str  # the thread (on a GPU's lanes: the stream)
    start: float
    end: float
    args: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def dur(self) -> float:
        return self.end - self.start


def read_trace(path: str | Path) -> list[Event]:
    """The complete events (``"ph": "X"``) of the Chrome trace at ``path``, sorted by start.

    ``start`` and ``end`` are in ms, measured from the earliest complete event's ``ts``
    (the trace's own ``ts`` and ``dur`` are in microseconds). A trace is either a dict with
    a ``traceEvents`` list (what ``export_chrome_trace`` writes) or that list itself. Every
    other phase (metadata ``"M"``, instants ``"i"``, flows ``"s"``/``"f"``) is left out.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"error: {path} is not a readable JSON trace ({exc})") from None
    raise NotImplementedError("Task 10.1: keep the \"X\" events; µs -> ms from the earliest start; sorted by start")


# --- 10.2: which events are communication, which are the backward's compute ---------------------

def on_gpu(events: list[Event]) -> bool:
    """Whether the trace recorded GPU kernels (a CUDA run) or only the CPU."""
    return any(e.cat == "kernel" for e in events)


def phase_spans(events: list[Event], phase: str) -> list[tuple[float, float]]:
    """The ``record_function(phase)`` spans the rank function put around each part of a step."""
    return [(e.start, e.end) for e in events if e.cat == "user_annotation" and e.name == phase]


def comm_intervals(events: list[Event]) -> list[tuple[float, float]]:
    """``(start, end)`` of every collective's *execution*, not of its launch.

    On the CPU (gloo): the ``gloo:...`` events, which gloo's worker threads record while they
    move the data. On a GPU (NCCL): the kernels whose name contains ``nccl`` (any case). The
    launches (``c10d::allreduce_``, ``nccl:all_reduce`` on the CPU, ``cudaLaunchKernel``)
    only queue the work: they are not communication time.
    """
    raise NotImplementedError("Task 10.2: gloo's worker events and NCCL's kernels, never the launches")


def compute_intervals(events: list[Event], phase: str = "backward") -> list[tuple[float, float]]:
    """``(start, end)`` of the compute of one phase of the step (``"backward"`` by default).

    On the CPU: the operators (``cpu_op``) that the phase's thread ran inside the phase's
    span. The autograd engine computes a CPU backward on the thread that called
    ``loss.backward()``; the gaps between its operators are waits (torch DDP waits for its
    last buckets at the end of backward), which hide nothing. On a GPU the CPU only launches
    kernels: the compute is each kernel that is not communication and whose launch (the
    ``cuda_runtime`` or ``cuda_driver`` event with the same ``args["correlation"]``) started
    inside one of the phase's spans, however late the kernel itself ran.
    """
    spans = [e for e in events if e.cat == "user_annotation" and e.name == phase]
    raise NotImplementedError("Task 10.2: the CPU: operators of the phase's thread in its span; a GPU: kernels it launched")


# --- 10.3: intervals: their union, and how much two sets share --------------------------------

def merge(intervals) -> list[tuple[float, float]]:
    """The union of ``intervals`` as disjoint ``(start, end)`` pairs, sorted.

    The input may be in any order, nested, overlapping or touching (``(0, 1)`` and
    ``(1, 2)`` make ``(0, 2)``); empty intervals (``end <= start``) add nothing.
    """
    raise NotImplementedError("Task 10.3: sort by start; extend the last pair while the next one touches it")


def length(intervals) -> float:
    """The time covered by ``intervals``, each moment counted once."""
    return sum(end - start for start, end in merge(intervals))


def overlap(a, b) -> float:
    """The time covered by both ``a`` and ``b`` (each set may overlap itself)."""
    raise NotImplementedError("Task 10.3: the union of each set, then add up the pairwise intersections")


# --- 10.4: the fraction of communication hidden behind the backward ---------------------------

def hidden_fraction(events: list[Event], phase: str = "backward") -> dict:
    """How much of a step's communication ran while ``phase`` computed.

    ``{"comm_ms": time with at least one collective running, "hidden_ms": the part of it
    during ``phase``'s compute, "fraction": hidden_ms / comm_ms}``. ``fraction`` is of the
    communication, not of the step: 1.0 means nothing of it was left to wait for after the
    backward. A trace without communication (one rank) has ``fraction`` None: nothing to hide.
    """
    raise NotImplementedError("Task 10.4: comm time counted once; its overlap with the phase's compute; ratio")


# --- given: the communication as it ran, in each mode the course runs ---------------------------

MODES = {"cpu": "gloo on the CPU: gloo's spans",
         "nccl": "NCCL on GPUs: the kernels' times",
         "shared": "gloo on a GPU shared by the ranks (DPT_SHARE_GPU=1): gloo's spans from "
                   "the moment their input reached the host"}


def comm_mode(events: list[Event]) -> str:
    """How the trace's collectives ran: ``"cpu"`` (gloo, CPU tensors), ``"nccl"`` (kernels on
    a GPU) or ``"shared"`` (gloo with CUDA tensors: ranks sharing a GPU, ``DPT_SHARE_GPU=1``,
    the only multi-rank mode a one-GPU machine or Colab runs)."""
    if not on_gpu(events):
        return "cpu"
    return "shared" if any(e.name.startswith("gloo:") for e in events) else "nccl"


def _launches(events: list[Event]) -> list[Event]:
    """The collectives' launches (``c10d::...`` operators), outermost only, by start."""
    calls = [e for e in events if e.cat == "cpu_op" and e.name.startswith("c10d::")]
    return sorted((e for e in calls if not any(
        o is not e and o.tid == e.tid and o.start <= e.start and e.end <= o.end
        and (o.start, -o.end) < (e.start, -e.end) for o in calls)), key=lambda e: e.start)


def as_run(events: list[Event]) -> list[Event] | None:
    """The events with each collective's span covering its communication only.

    On the CPU (gloo) and with NCCL (kernels on the device) that is what the trace holds. With
    gloo on CUDA tensors (``"shared"``) a ``gloo:...`` span starts on gloo's CPU thread as soon
    as the collective is issued, and first waits for the device-to-host copy of its input,
    which waits for every kernel queued before the collective, the backward still running on
    the GPU: that wait is not communication. Here each such span starts no earlier than the
    end of the device work (kernels, device-to-host copies) launched before its collective's
    launch (``c10d::...``) returned; gloo runs the collectives in the order they were issued,
    so the k-th span is the k-th launch's. None where spans and launches do not pair up: the
    trace cannot say when the communication began.
    """
    if comm_mode(events) != "shared":
        return events
    spans = sorted((e for e in events if e.name.startswith("gloo:")), key=lambda e: e.start)
    launches = _launches(events)
    if len(spans) != len(launches) or any(c.start > s.start for c, s in zip(launches, spans)):
        return None
    launched = {e.args["correlation"]: e.start for e in events
                if e.cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.args}
    device = [(launched[e.args["correlation"]], e.end) for e in events
              if e.cat in ("kernel", "gpu_memcpy", "gpu_memset")
              and "nccl" not in e.name.lower() and "HtoD" not in e.name
              and e.args.get("correlation") in launched]
    starts = {}
    for call, span in zip(launches, spans):
        ready = max((end for t, end in device if t <= call.end), default=span.start)
        starts[id(span)] = min(max(span.start, ready), span.end)
    return [dataclasses.replace(e, start=starts[id(e)]) if id(e) in starts else e
            for e in events]


# --- given: one traced step per method, on every rank -----------------------------------------

def build(method: str, model: torch.nn.Module):
    """``(wrapped model, the call that ends gradient sync after backward)`` for ``method``."""
    if method == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel

        dev = next(model.parameters()).device
        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB,
                                      device_ids=[dev] if dev.type == "cuda" else None)
        return ddp, lambda: None
    if method in ("naive", "overlap", "bucketed"):  # lesson 05's, from this lesson tree
        NaiveDDP = load("05_ddp_from_scratch", "naive_ddp", __file__).NaiveDDP
        OverlapDDP = load("05_ddp_from_scratch", "overlap_ddp", __file__).OverlapDDP
        BucketedDDP = load("05_ddp_from_scratch", "bucketed_ddp", __file__).BucketedDDP
        wrapped = {"naive": NaiveDDP, "overlap": OverlapDDP,
                   "bucketed": lambda m: BucketedDDP(m, bucket_cap_mb=BUCKET_MB)}[method](model)
        return wrapped, wrapped.finish_gradient_synchronization
    if method == "fsdp":  # lesson 09's
        wrapped = load("09_fsdp", "fsdp_by_hand", __file__).FSDP(model)
        return wrapped, wrapped.finish_grad_sync
    if method == "fsdp2":
        return load("09_fsdp", "fsdp2_practice", __file__).shard_transformer(model), lambda: None
    raise ValueError(f"error: unknown method {method!r}; choose from {', '.join(METHODS)}")


def _one_step(model, sync, opt, inputs, targets, label: bool) -> None:
    import contextlib

    import torch.nn.functional as F
    from torch.profiler import record_function

    def part(name):
        return record_function(name) if label else contextlib.nullcontext()

    with part("forward"):
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    with part("backward"):
        loss.backward()
    with part("sync"):
        sync()
    with part("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)


def trace_method(method: str, rank: int, out: Path, warmup: int = 2, timed: int = 3,
                 model_config: dict | None = None, batch: int = BATCH) -> dict:
    """Train ``method`` for ``warmup + timed`` steps, then trace one more; save the trace.

    Returns ``{"path": the trace file, "step_ms": the median of the timed steps}``: the
    traced step is slower (the profiler records every operator), so it is not the one timed.
    """
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from dpt.device import synchronize
    from dpt.dist import rank_device
    from dpt.models import TinyTransformer, token_batch

    dev = rank_device()
    config = {**MODEL, **(model_config or {})}
    torch.manual_seed(0)
    model, sync = build(method, TinyTransformer(**config).to(dev))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = token_batch(batch, config["seq_len"], config["vocab"], seed=1000 + rank)
    inputs, targets = inputs.to(dev), targets.to(dev)

    times = []
    for i in range(warmup + timed):
        synchronize(dev)
        t0 = time.perf_counter()
        _one_step(model, sync, opt, inputs, targets, label=False)
        synchronize(dev)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    dist.barrier()  # the ranks enter the traced step together
    synchronize(dev)
    with profile(activities=activities, record_shapes=True) as prof:
        _one_step(model, sync, opt, inputs, targets, label=True)
        synchronize(dev)
    path = Path(out) / f"{method}.rank{rank}.json"
    prof.export_chrome_trace(str(path))
    return {"path": str(path), "step_ms": statistics.median(times)}


def trace_rank(rank: int, world_size: int, methods=METHODS, out: str | Path = OUT,
               **kwargs) -> dict:
    """Rank function: :func:`trace_method` for each of ``methods``, in turn.

    ``{method: result}``; a method whose code reaches a task not done yet (of lesson 05 or
    09) gets that task's message instead. Every rank stops that method at the same call, so
    the ranks still agree on every collective of the next one.
    """
    Path(out).mkdir(parents=True, exist_ok=True)
    results = {}
    for method in methods:
        try:
            results[method] = trace_method(method, rank, Path(out), **kwargs)
        except NotImplementedError as exc:
            results[method] = task_message(exc)
    return results


def run_traces(methods=METHODS, nproc: int = 2, out: str | Path = OUT, timeout: float = 300,
               **kwargs) -> list[dict]:
    """Trace ``methods`` on ``nproc`` ranks (NCCL with a GPU each, else gloo on the CPU)."""
    from dpt.ranks import run_distributed

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"error: unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    return run_distributed(trace_rank, world_size=nproc, timeout=timeout, env=QUIET, echo=False,
                           kwargs={"methods": tuple(methods), "out": str(out), **kwargs})


def result_of(ranks: list[dict], method: str) -> list[dict]:
    """Every rank's result for ``method``; raises the NotImplementedError of the task its code
    reached and found not done (``needs_tasks`` turns it into one ``skipped:`` line)."""
    found = [r[method] for r in ranks]
    for result in found:
        if isinstance(result, str):
            raise NotImplementedError(result)
    return found


def summary(ranks: list[dict], rank: int = 0) -> list[dict]:
    """One row per traced method, from rank ``rank``'s trace: step time, communication, the
    fraction hidden behind the backward (of the communication as it ran, :func:`as_run`),
    ``mode`` (:func:`comm_mode`) and ``comparable``: False where the trace cannot say when the
    communication began (``hidden_ms`` and ``fraction`` are then None); a method not traced
    has its task message."""
    rows = []
    for method in ranks[rank]:
        result = ranks[rank][method]
        if isinstance(result, str):
            rows.append({"method": method, "skipped": result})
            continue
        events = read_trace(result["path"])
        step = phase_spans(events, "forward")[:1] + phase_spans(events, "optimizer")[-1:]
        ran = as_run(events)
        measured = hidden_fraction(events if ran is None else ran)
        if ran is None:
            measured.update(hidden_ms=None, fraction=None)
        rows.append({"method": method, "step_ms": result["step_ms"],
                     "traced_ms": step[-1][1] - step[0][0] if len(step) == 2 else None,
                     **measured, "mode": comm_mode(events), "comparable": ran is not None,
                     "path": result["path"]})
    return rows


def format_summary(rows: list[dict]) -> str:
    lines = [f"{'method':<19} {'step ms':>8} {'comm ms':>8} {'hidden':>7}  "
             "(hidden: share of the communication that ran during backward)"]
    for r in rows:
        label = LABELS.get(r["method"], r["method"])
        if "skipped" in r:
            lines.append(f"{label:<19} skipped: {r['skipped']}")
            continue
        frac = ("n/c" if not r.get("comparable", True)
                else "-" if r["fraction"] is None else f"{r['fraction']:.0%}")
        lines.append(f"{label:<19} {r['step_ms']:>8.1f} {r['comm_ms']:>8.1f} {frac:>7}")
    modes = sorted({r["mode"] for r in rows if "mode" in r})
    if modes:
        lines.append("communication: " + "; ".join(MODES[m] for m in modes))
    if any(not r.get("comparable", True) for r in rows if "skipped" not in r):
        lines.append("n/c: not comparable: gloo's spans on a shared GPU could not be matched "
                     "to their launches, so the time they waited for the GPU is not known")
    return "\n".join(lines)


# --- given: a timeline drawn from the trace's events -------------------------------------------

PHASE_COLORS = {"forward": "C0", "backward": "C2", "sync": "C3", "optimizer": "C4"}


def lanes(events: list[Event]) -> dict[str, list[tuple[float, float, str]]]:
    """What :func:`draw_timeline` draws: lane name -> ``[(start, end, color)]``.

    The phases of the step (the main thread's labels), the backward's compute (the main
    thread's operators on the CPU, the kernels on a GPU), and one lane per thread or stream
    that ran a collective."""
    phases = [(e.start, e.end, PHASE_COLORS[e.name]) for e in events
              if e.cat == "user_annotation" and e.name in PHASE_COLORS]
    out = {"step (main thread)": phases,
           "backward computing": [(s, e, "C2") for s, e in merge(compute_intervals(events))]}
    comm = set(comm_intervals(events))
    threads: dict[str, list] = {}
    for e in events:
        if (e.start, e.end) in comm:
            lane = f"comm {'stream' if e.cat == 'kernel' else 'thread'} {e.tid}"
            threads.setdefault(lane, []).append((e.start, e.end, "C1"))
    out.update(sorted(threads.items()))
    return out


def draw_timeline(events: list[Event], ax, title: str = "", rows: dict | None = None) -> None:
    """Draw one traced step on ``ax``: the phases, compute and communication, one lane each
    (``rows``: what :func:`lanes` made of ``events``), in ms from the start of the forward."""
    rows = lanes(events) if rows is None else rows
    forward = phase_spans(events, "forward")
    t0 = forward[0][0] if forward else 0.0
    for y, bars in enumerate(rows.values()):
        for start, end, color in bars:
            ax.broken_barh([(start - t0, end - start)], (y - 0.35, 0.7), color=color)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's forward began")
    if title:
        ax.set_title(title, fontsize=9, loc="left")


def figure(ranks: list[dict], methods=("naive", "bucketed"), path: str | Path | None = FIGURE,
           rank: int = 0):
    """The timelines of ``methods`` one above the other, from rank ``rank``'s traces; saved to
    ``path`` (None: not saved). Returns the figure."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    # everything that may stop at a task not done yet, before a figure exists
    read = [read_trace(result_of(ranks, method)[rank]["path"]) for method in methods]
    ran = [as_run(events) for events in read]  # communication as it ran (shared GPU: trimmed)
    traced = [events if timed is None else timed for events, timed in zip(read, ran)]
    shares = [hidden_fraction(events)["fraction"] for events in traced]
    drawn = [lanes(events) for events in traced]
    fig, axes = plt.subplots(len(methods), 1, figsize=(10, 1.9 * len(methods) + 0.6),
                             sharex=True, squeeze=False)
    for ax, method, events, share, rows, timed in zip(axes[:, 0], methods, traced, shares,
                                                      drawn, ran):
        hidden = ("share hidden not comparable (gloo on a shared GPU)" if timed is None
                  else "no communication" if share is None
                  else f"{share:.0%} of comm hidden behind backward")
        draw_timeline(events, ax, f"{LABELS.get(method, method)}: {hidden}", rows)
        ax.set_xlabel("")
    axes[-1, 0].set_xlabel("ms since the step's forward began (the traced step, rank "
                           f"{rank}; orange: a collective running)")
    fig.legend(handles=[Patch(color=c, label=n) for n, c in PHASE_COLORS.items()]
               + [Patch(color="C1", label="communication")],
               loc="upper right", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"trace folder (default {OUT})")
    parser.add_argument("--figure", type=Path, default=FIGURE,
                        help="timeline of naive and bucketed (default %(default)s)")
    args = parser.parse_args(argv)
    if args.nproc < 2:
        parser.error("--nproc must be at least 2: one rank has nothing to communicate")
    print(f"tracing {len(args.methods)} methods on {args.nproc} ranks, one step each after "
          f"warm-up ...", flush=True)
    try:
        ranks = run_traces(args.methods, nproc=args.nproc, out=args.out)
    except RuntimeError as exc:  # a rank failed (dpt.ranks.RankFailure)
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    try:
        rows = summary(ranks)
    except NotImplementedError as exc:
        print(f"traces written to {args.out}; the table needs your code: {exc}")
        return 1
    print(format_summary(rows))
    drawn = [m for m in ("naive", "bucketed") if not isinstance(ranks[0].get(m, ""), str)]
    if drawn:
        figure(ranks, drawn, args.figure)
        print(f"timeline: {args.figure}")
    left = [m for m in ("naive", "bucketed") if isinstance(ranks[0].get(m), str)]
    if left:  # their lesson 05 code reached a task not done yet
        print(f"no timeline of {' and '.join(left)}: {ranks[0][left[0]]} (lesson 05's code; "
              f"the course's reference: {REFERENCE_FIGURE.relative_to(REPO_ROOT)})")
    print(f"traces: {args.out}/<method>.rank<r>.json; open one in https://ui.perfetto.dev "
          "(drag and drop)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
