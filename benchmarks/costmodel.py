"""Why not N x on N devices: a cost model fitted from this machine's measurements.

A data-parallel step on N ranks costs the compute of one rank's batch plus a ring all-reduce
of the gradients (no overlap assumed, so the prediction is a lower bound on speedup when the
method overlaps)::

    t_step(N) = t_compute(N) + t_allreduce(N, bytes)
    t_allreduce(N, bytes) = alpha + 2 (N - 1) / N * bytes / bandwidth      (0 when N = 1)

Under weak scaling (fixed batch per rank) each rank computes what one rank computed alone,
``t_compute(N) = t_compute(1)``, and the speedup in samples per second is
``N * t_step(1) / t_step(N)``. Under strong scaling (fixed global batch) each rank computes
1/N of it, ``t_compute(N) = t_compute(1) / N`` (assuming compute proportional to the batch),
and the speedup is ``t_step(1) / t_step(N)``. ``alpha`` (latency) and ``bandwidth`` are
fitted by least squares from all-reduce timings on this machine, or taken from a named
interconnect (:data:`PRESETS`, kept in ``dpt.interconnects`` with their sources) to project
onto hardware this machine is not.

What the near-ideal line of a small model hides, the crossover for real model sizes (DDP,
ZeRO and FSDP, compute against exposed communication), is lesson 12's ``crossover.py``;
:func:`crossover_rows` draws it from that file of a lesson tree for the benchmark's figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The interconnects live in dpt (lesson 12's crossover projects onto the same table); they
# are re-exported here, where the benchmark and its notebook have always found them.
from dpt.interconnects import (  # noqa: F401
    INTERCONNECTS,
    PRESETS,
    Interconnect,
    default_interconnect,
)


@dataclass
class RingModel:
    alpha_s: float  # fixed cost per all-reduce, seconds
    bandwidth_Bps: float  # bytes per second

    @classmethod
    def preset(cls, name: str) -> RingModel:
        p = PRESETS[name]
        return cls(p.latency_us * 1e-6, p.bandwidth_GBps * 1e9)

    def allreduce_s(self, n: int, nbytes: float) -> float:
        if n <= 1:
            return 0.0
        return self.alpha_s + 2 * (n - 1) / n * nbytes / self.bandwidth_Bps

    def step_s(self, n: int, compute_s: float, grad_bytes: float, strong: bool = False) -> float:
        """``compute_s`` is one rank's compute at N = 1 (its batch is the global batch under
        strong scaling, which N ranks then split)."""
        return (compute_s / n if strong else compute_s) + self.allreduce_s(n, grad_bytes)

    def speedup(self, n: int, compute_s: float, grad_bytes: float, strong: bool = False) -> float:
        """Throughput at N over throughput at 1: N times the samples per step under weak
        scaling, the same samples per step under strong scaling."""
        work = 1 if strong else n
        return work * (self.step_s(1, compute_s, grad_bytes, strong)
                       / self.step_s(n, compute_s, grad_bytes, strong))

    def efficiency(self, n: int, compute_s: float, grad_bytes: float,
                   strong: bool = False) -> float:
        return self.speedup(n, compute_s, grad_bytes, strong) / n


def fit_ring(sizes_bytes: list[float], times_s: list[float], n: int) -> RingModel:
    """Least-squares fit of ``t = alpha + 2 (n-1)/n * bytes / bandwidth`` to measurements."""
    if n < 2:
        raise ValueError("an all-reduce fit needs measurements with at least 2 ranks")
    if len(sizes_bytes) != len(times_s) or len(sizes_bytes) < 2:
        raise ValueError("need at least two (size, time) points")
    k = 2 * (n - 1) / n
    xs = [k * s for s in sizes_bytes]
    mx, my = sum(xs) / len(xs), sum(times_s) / len(times_s)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, times_s)) / sxx
    alpha = max(0.0, my - slope * mx)
    if slope <= 0:
        raise ValueError("all-reduce time does not grow with size; cannot fit a bandwidth")
    return RingModel(alpha, 1.0 / slope)


CROSSOVER_LESSON = ("12_step_cost", "crossover")


def crossover_from_lesson(tree=None, course_models: bool = True, **kwargs):
    """Lesson 12's crossover for real model sizes, drawn by the lesson tree's own code.

    Returns ``(module, rows, note)``: the lesson's ``crossover.py`` (``dpt.lessons.load``,
    ``tree`` as it reads it: ``$DPT_TARGET``, else ``solutions/``), its ``crossover_rows``
    (the course's models, their FLOPs counted, then the lesson's real ones; ``kwargs`` passed
    on) and None; or ``(module or None, [], note)``, the note one line
    saying why there are no rows: the lesson is missing, or its tasks 12.8-12.10 are stubs.
    """
    from dpt.lessons import load

    try:
        module = load(*CROSSOVER_LESSON, tree)
    except (FileNotFoundError, ImportError) as e:
        return None, [], f"no crossover for real models: {e}"
    try:
        models = list(module.REAL_MODELS)
        if course_models:
            models = module.course_models() + models
        return module, module.crossover_rows(models, **kwargs), None
    except NotImplementedError as e:
        return module, [], (f"crossover for real models not drawn: {e.args[0] if e.args else e} "
                            f"(do lesson 12's tasks 12.8-12.10 in {Path(module.__file__).parent})")
