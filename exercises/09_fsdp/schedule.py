"""Lesson 09: one FSDP step, as it happened: gathers, compute, frees and reduce-scatters.

:func:`record` watches one :class:`fsdp_by_hand.FSDP` from outside: it wraps the methods of
that object and of its units (fsdp_by_hand.py knows nothing of this module) and logs each
all-gather and reduce-scatter from the moment it was issued to the moment it completed, each
unit's forward and backward compute, the time the rank sat blocked in ``wait()``, and each
``free``. This module keeps that log (:class:`Timeline`), runs a few recorded steps on N ranks
(:func:`record_step`) and draws the last one (:func:`draw`): per rank a compute lane, a
gather lane and a reduce-scatter lane on one time axis.

What to look for: with prefetch, block i+1's gather starts before block i's compute (forward)
and block i-1's before block i's backward, so the compute lane has (almost) no grey waits;
without it, every unit waits for its own gather. Each reduce-scatter starts right after its
unit's backward, and overlaps the next unit's backward.

    .venv/bin/python exercises/09_fsdp/schedule.py                  # 2 ranks: runs/l09_schedule.png
    .venv/bin/python exercises/09_fsdp/schedule.py --nproc 4 --out schedule4.svg

Times are seconds of the host's clock (``time.perf_counter``, shared by the processes of one
machine), read where the work runs (``dpt.timing``): on the CPU the host's own stamps; on a GPU,
CUDA events recorded on the compute stream, turned into host seconds after the step, so that
the lanes show when the device ran the work, not when the host queued it. With NCCL a
collective's end is when its kernels finished (NCCL's handles complete when the work is
queued, and their ``wait()`` returns at once), and a grey wait is the time the compute stream
sat waiting for it. With gloo on CUDA tensors (ranks sharing a GPU, ``DPT_SHARE_GPU=1``) the
collectives run on gloo's CPU threads: their ends are the host's stamps.
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import contextlib
import functools
import sys
from pathlib import Path

RUNS = Path(__file__).resolve().parent / "runs"  # the lesson's own (git ignores it)
KINDS = ("gather", "wait", "compute", "free", "reduce_scatter")


class Timeline:
    """The events of one rank: dicts with ``unit``, ``kind`` (one of :data:`KINDS`), ``phase``
    (forward or backward), ``start`` and ``end`` in ``time.perf_counter()`` seconds, and
    ``clock``, the clock that stamped them (``"host"`` or ``"cuda"``, see ``dpt.timing``).

    Nothing is kept while ``on`` is False. The stamps come from ``clock`` (default:
    ``dpt.timing.clock_for()``, chosen at the first one: CUDA events recorded on the compute
    stream where the rank computes on a GPU, the host's ``time.perf_counter`` otherwise); they
    become seconds when :attr:`events` is read (on a GPU, once the device is done).

    A collective's ``end``: on a GPU with NCCL, when its kernels finished on the device. On
    gloo, when its handle's future completes, else when it is first seen completed, else when
    it is waited on (then the event also has ``end_at_wait``: it ended by then at the latest;
    gloo's reduce-scatter handles say nothing before their wait). A ``wait`` lasts from the
    moment the compute reached ``wait()`` (the host, or on a GPU the compute stream) to the
    moment it went on: the time the compute was held up by that collective."""

    def __init__(self, clock=None):
        self.on = False
        self.clock = clock
        self._events: list[dict] = []
        self.phase = "forward"
        self._open: dict[tuple[str, str], object] = {}
        self._polled: list[tuple[dict, object]] = []  # collectives whose handle has no future

    @property
    def events(self) -> list[dict]:
        """The events so far, their stamps turned into seconds (the list itself: clearing it
        forgets them)."""
        stamps = [(e, key) for e in self._events for key in ("start", "end")
                  if e[key] is not None and not isinstance(e[key], (int, float))]
        if stamps:
            self.clock.settle()
            for event, key in stamps:
                event[key] = self.clock.seconds(event[key])
        return self._events

    def _clock(self):
        if self.clock is None:
            from dpt.timing import clock_for

            self.clock = clock_for()
        return self.clock

    def now(self):
        """A stamp of now on this timeline's clock (None while not recording)."""
        return self._clock().now() if self.on else None

    def _poll(self) -> None:
        """Stamp the collectives found completed since the last event."""
        if self._polled:
            now = self._clock().host_now()
            for event, work in self._polled:
                if event["end"] is None and work.is_completed():
                    event["end"] = now
            self._polled = [(e, w) for e, w in self._polled if e["end"] is None]

    def span(self, unit: str, kind: str, start, end, phase: str | None = None) -> None:
        if not self.on:
            return
        self._poll()
        if kind == "wait":  # whatever this waited for is done now, if not seen done before
            for event in reversed(self._events):
                if event["unit"] == unit and event["end"] is None:
                    event["end"], event["end_at_wait"] = end, True
                    break
        self._events.append({"unit": unit, "kind": kind, "phase": phase or self.phase,
                             "start": start, "end": end, "clock": self._clock().name})

    def mark(self, unit: str, kind: str) -> None:
        now = self.now()
        self.span(unit, kind, now, now)

    @contextlib.contextmanager
    def waiting(self, unit: str):
        """Around a handle's ``wait()``: log the time the compute sat in it as a ``wait``."""
        if not self.on:
            yield
            return
        start = self.now()
        yield
        self.span(unit, "wait", start, self.now())

    def issued(self, unit: str, kind: str, start, work) -> None:
        """A collective issued at stamp ``start``; ``work`` is its handle (None if it ran at
        once)."""
        if not self.on:
            return
        self._poll()
        clock = self._clock()
        event = {"unit": unit, "kind": kind, "phase": self.phase, "start": start, "end": None,
                 "clock": clock.name}
        self._events.append(event)
        if work is None:
            event["end"] = clock.now()
            return

        def done(stamp, event=event):
            if event["end"] is None:
                event["end"] = stamp

        if not clock.on_end(work, done):  # a handle without a future: look at each event
            self._polled.append((event, work))

    def open(self, unit: str, phase: str) -> None:
        self._poll()
        self._open[(unit, phase)] = self.now()

    def close(self, unit: str, phase: str) -> None:
        start = self._open.pop((unit, phase), None)
        if start is not None:
            self.span(unit, "compute", start, self.now(), phase)


# Recording from outside: fsdp_by_hand.py does not import this module. record() puts a logging
# wrapper around each method of one FSDP object and of its units, on the object itself (an
# instance attribute in front of the class's method): the class, and the code you wrote in it,
# stay as they are, and a method put on the class in place of yours is recorded the same way.

def _collective(timeline: Timeline, unit, kind: str, method):
    """A unit's method that issues a collective and returns its handle: log it as ``kind``."""
    @functools.wraps(method)
    def logged(*args, **kwargs):
        start = timeline.now()
        work = method(*args, **kwargs)
        timeline.issued(unit.name, kind, start, work)
        return work
    return logged


def _instant(timeline: Timeline, unit, kind: str, method):
    """A unit's method that happens at once (``free``): log the moment it returned."""
    @functools.wraps(method)
    def logged(*args, **kwargs):
        result = method(*args, **kwargs)
        timeline.mark(unit.name, kind)
        return result
    return logged


def _waited(timeline: Timeline, unit, method):
    """A unit's ``wait`` or ``wait_grad``: log the time the compute sat in it."""
    @functools.wraps(method)
    def logged(*args, **kwargs):
        with timeline.waiting(unit.name):
            return method(*args, **kwargs)
    return logged


def _computes(timeline: Timeline, phase: str, edge: str, method):
    """An FSDP hook method ``(unit, ...)``: the unit's ``phase`` compute starts when it returns
    (``edge="start"``), or ended when it was called (``edge="end"``)."""
    @functools.wraps(method)
    def logged(unit, *args, **kwargs):
        if edge == "end":
            timeline.close(unit.name, phase)
        else:
            timeline.phase = phase
        result = method(unit, *args, **kwargs)
        if edge == "start":
            timeline.open(unit.name, phase)
        return result
    return logged


def _forward(timeline: Timeline, method):
    """FSDP's ``forward``: the forward phase begins (the root's gather is logged in it)."""
    @functools.wraps(method)
    def logged(*args, **kwargs):
        timeline.phase = "forward"
        return method(*args, **kwargs)
    return logged


UNIT_METHODS = ("gather", "reduce_scatter", "free", "wait", "wait_grad")
HOOKS = {"_pre_forward": ("forward", "start"), "_post_forward": ("forward", "end"),
         "_pre_backward": ("backward", "start"), "_post_backward": ("backward", "end")}


def watch_unit(unit, timeline: Timeline) -> None:
    """Log one unit's collectives, frees and waits in ``timeline``: wraps its ``gather`` and
    ``reduce_scatter`` (collectives issued), ``free`` and ``wait``/``wait_grad``, on the unit
    object (anything with a ``name`` and these methods)."""
    missing = [name for name in UNIT_METHODS if not callable(getattr(unit, name, None))]
    if missing:
        raise TypeError(f"unit {getattr(unit, 'name', unit)!r} has no {', '.join(missing)}: "
                        "record() watches fsdp_by_hand.Unit objects")
    unit.gather = _collective(timeline, unit, "gather", unit.gather)
    unit.reduce_scatter = _collective(timeline, unit, "reduce_scatter", unit.reduce_scatter)
    unit.free = _instant(timeline, unit, "free", unit.free)
    unit.wait = _waited(timeline, unit, unit.wait)
    unit.wait_grad = _waited(timeline, unit, unit.wait_grad)


def record(fsdp, clock=None) -> Timeline:
    """Log what ``fsdp`` (an :class:`fsdp_by_hand.FSDP`) does from now on; return the
    :class:`Timeline` that keeps it, recording (set its ``on`` to False to pause; its
    ``events`` are the log).

    On this object only, it wraps each unit's methods (:func:`watch_unit`), ``forward`` (the
    forward phase begins) and the four hooks ``_pre_forward``, ``_post_forward``,
    ``_pre_backward`` and ``_post_backward``, whose calls open and close each unit's compute.
    The hooks that ``_register_hooks`` put on the modules call them through the object
    (``self._pre_forward(unit)``), and so reach the wrapped ones."""
    if "_pre_forward" in vars(fsdp):  # an instance attribute: our wrapper
        raise ValueError("this FSDP is already recorded: call record() once per object")
    missing = [name for name in ("all_units", "forward", *HOOKS) if not hasattr(fsdp, name)]
    if missing:
        raise TypeError(f"{type(fsdp).__name__} has no {', '.join(missing)}: record() watches "
                        "fsdp_by_hand.FSDP objects")
    timeline = Timeline(clock)
    timeline.on = True
    for unit in fsdp.all_units:
        watch_unit(unit, timeline)
    fsdp.forward = _forward(timeline, fsdp.forward)
    for name, (phase, edge) in HOOKS.items():
        setattr(fsdp, name, _computes(timeline, phase, edge, getattr(fsdp, name)))
    return timeline


def record_worker(rank: int, world_size: int, steps: int = 3, batch_size: int = 8,
                  prefetch: bool = True, model_kwargs: dict | None = None,
                  compute_dtype=None, lr: float = 1e-3, seed: int = 0) -> list[dict]:
    """Train ``steps`` AdamW steps of the hand-written FSDP on this rank, as its
    ``train_worker`` does, recording the last one; return that step's events."""
    import torch
    from fsdp_by_hand import FSDP, loss_fn, rank_batch

    from dpt.dist import rank_device
    from dpt.models import TinyTransformer

    device = rank_device()
    torch.manual_seed(seed)
    model = TinyTransformer(**(model_kwargs or {})).to(device)
    fsdp = FSDP(model, compute_dtype=compute_dtype, prefetch=prefetch)
    timeline = record(fsdp)
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=lr)
    for step in range(steps):
        timeline.on = step == steps - 1
        inputs, targets = (t.to(device) for t in rank_batch(step, rank, world_size, batch_size,
                                                            model, seed))
        optimizer.zero_grad(set_to_none=True)
        loss_fn(fsdp(inputs), targets).backward()
        fsdp.finish_grad_sync()
        optimizer.step()
    return list(timeline.events)


def record_step(world_size: int = 2, prefetch: bool = True, steps: int = 3,
                batch_size: int = 8, model_kwargs: dict | None = None, compute_dtype=None,
                timeout: float = 300) -> list[list[dict]]:
    """Train ``steps`` steps of the hand-written FSDP on ``world_size`` ranks; return the last
    step's events, one list per rank (the first steps warm up)."""
    import schedule  # this module by name (also when run as a script): the ranks import it

    from dpt.dist import threads_per_rank
    from dpt.ranks import run_distributed

    model_kwargs = {"dim": 128, "heads": 4, "layers": 4, **(model_kwargs or {})}
    return run_distributed(
        schedule.record_worker, world_size=world_size, timeout=timeout,
        threads=threads_per_rank(world_size), echo=False,
        kwargs={"steps": steps, "batch_size": batch_size, "prefetch": prefetch,
                "model_kwargs": model_kwargs, "compute_dtype": compute_dtype})


def summary(events: list[dict]) -> dict[str, float]:
    """Seconds of one rank's step: ``step`` (first event to last), ``compute``, ``waiting``
    (blocked on a collective: communication that compute did not hide) and ``gathering``
    (all-gathers in flight, overlapping or not)."""
    done = [e for e in events if e["end"] is not None]
    if not done:
        return {"step": 0.0, "compute": 0.0, "waiting": 0.0, "gathering": 0.0}

    def total(kind):
        return sum(e["end"] - e["start"] for e in done if e["kind"] == kind)

    return {"step": max(e["end"] for e in done) - min(e["start"] for e in done),
            "compute": total("compute"), "waiting": total("wait"), "gathering": total("gather")}


CLOCKS = {"host": "the host's clock", "cuda": "the GPU's clock (CUDA events)"}


def clock_of(events: list[dict]) -> str:
    """Which clock stamped one rank's events, in words (for labels)."""
    names = sorted({e.get("clock", "host") for e in events})
    return " and ".join(CLOCKS.get(n, n) for n in names) or CLOCKS["host"]


COLORS = {("compute", "forward"): "tab:blue", ("compute", "backward"): "tab:orange",
          "wait": "lightgrey", "gather": "tab:green", "reduce_scatter": "tab:purple",
          "free": "tab:red"}


def _short(unit: str) -> str:
    return unit.replace("blocks.", "b")


def _number(unit: str) -> int:
    """The block number at the end of a unit's name (blocks.3: 3); -1 for the root."""
    tail = unit.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def draw(events_by_rank, ax=None, title: str | None = None):
    """Draw one step: per rank a compute lane (forward blue, backward orange, waits grey,
    frees as red ticks), a gather lane and a reduce-scatter lane, on one time axis in ms. A
    collective whose end was only known at its wait is hatched: it ended by then, maybe before.

    ``events_by_rank``: one rank's events, or a list of them (:func:`record_step`). Returns the
    matplotlib Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if events_by_rank and isinstance(events_by_rank[0], dict):
        events_by_rank = [events_by_rank]
    starts = [e["start"] for events in events_by_rank for e in events]
    if not starts:
        raise ValueError("no events to draw: record a step first (record(fsdp), record_step)")
    t0 = min(starts)
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 1.2 + 1.3 * len(events_by_rank)))
    ticks, labels = [], []
    for rank, events in enumerate(events_by_rank):
        base = (len(events_by_rank) - 1 - rank) * 4
        lanes = {"compute": base + 2, "wait": base + 2, "free": base + 2, "gather": base + 1,
                 "reduce_scatter": base}
        for name, y in (("compute", base + 2), ("gather", base + 1), ("reduce-scatter", base)):
            ticks.append(y)
            labels.append(f"rank {rank} {name}")
        for e in events:
            start = (e["start"] - t0) * 1e3
            end = ((e["end"] if e["end"] is not None else e["start"]) - t0) * 1e3
            y = lanes[e["kind"]]
            if e["kind"] == "free":
                ax.plot([start, start], [y - 0.45, y + 0.45], color=COLORS["free"], lw=1)
                continue
            color = COLORS.get((e["kind"], e["phase"]), COLORS.get(e["kind"]))
            # two collectives in flight at once (the prefetch) sit on alternate halves of a lane
            half = 0.0 if e["kind"] in ("compute", "wait") else (
                0.2 if _number(e["unit"]) % 2 else -0.2)
            height = 0.8 if half == 0.0 else 0.4
            ax.barh(y + half, max(end - start, 1e-3), left=start, height=height, color=color,
                    edgecolor="black", linewidth=0.3, hatch="///" if e.get("end_at_wait") else None,
                    alpha=0.5 if e.get("end_at_wait") else 1.0)
            if e["kind"] != "wait":
                ax.text((start + end) / 2, y + half, _short(e["unit"]), ha="center",
                        va="center", fontsize=6, clip_on=True)
    ax.set_yticks(ticks, labels)
    ax.set_xlabel(f"ms since the step began ({clock_of(events_by_rank[0])})")
    ax.set_title(title or "one FSDP step")
    handles = [Patch(color=COLORS[("compute", "forward")], label="forward"),
               Patch(color=COLORS[("compute", "backward")], label="backward"),
               Patch(color=COLORS["wait"], label="waiting"),
               Patch(color=COLORS["gather"], label="all-gather"),
               Patch(color=COLORS["reduce_scatter"], label="reduce-scatter"),
               Patch(color=COLORS["free"], label="free"),
               Patch(facecolor="white", edgecolor="black", hatch="///",
                     label="ended by then (seen at its wait)")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=7,
              fontsize=8, frameon=False)
    return ax


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128, help="model width (bigger: longer gathers)")
    ap.add_argument("--out", default=str(RUNS / "l09_schedule.png"),
                    help="image to write (.png or .svg; default: the lesson's runs/, git-ignored)")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args(argv)
    try:
        if args.nproc < 1 or args.dim < 4 or args.dim % 4:
            raise ValueError("--nproc must be at least 1 and --dim a multiple of 4")
        runs = {prefetch: record_step(args.nproc, prefetch=prefetch,
                                      model_kwargs={"dim": args.dim}, timeout=args.timeout)
                for prefetch in (True, False)}
    except (ValueError, RuntimeError, OSError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one time axis for both panels: the steps compare at a glance
    fig, axes = plt.subplots(2, 1, figsize=(12, 2.6 * (1 + args.nproc)), sharex=True)
    for ax, prefetch in zip(axes, (True, False)):
        draw(runs[prefetch], ax=ax, title=f"prefetch {'on' if prefetch else 'off'}")
        for rank, events in enumerate(runs[prefetch]):
            s = summary(events)
            print(f"prefetch {'on ' if prefetch else 'off'} rank {rank}: step "
                  f"{s['step'] * 1e3:.1f} ms, compute {s['compute'] * 1e3:.1f} ms, blocked "
                  f"waiting {s['waiting'] * 1e3:.1f} ms")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
