"""Why not N x on N devices: a cost model fitted from this machine's measurements.

A data-parallel step on N ranks costs the compute of one rank's batch plus a ring all-reduce
of the gradients (no overlap assumed, so the prediction is a lower bound on speedup when the
method overlaps)::

    t_step(N) = t_compute + t_allreduce(N, bytes)
    t_allreduce(N, bytes) = alpha + 2 (N - 1) / N * bytes / bandwidth      (0 when N = 1)

Under weak scaling (fixed batch per rank) the speedup in samples per second is
``N * t_step(1) / t_step(N)``. ``alpha`` (latency) and ``bandwidth`` are fitted by least
squares from all-reduce timings on this machine, or given for a target interconnect.
"""

from __future__ import annotations

from dataclasses import dataclass

# Nominal per-direction bandwidths an instructor can project onto, in GB/s.
INTERCONNECTS = {
    "nvlink4": 450.0,
    "pcie4x16": 25.0,
    "infiniband-hdr": 25.0,
    "ethernet-100g": 12.5,
    "ethernet-10g": 1.25,
}


@dataclass
class RingModel:
    alpha_s: float  # fixed cost per all-reduce, seconds
    bandwidth_Bps: float  # bytes per second

    def allreduce_s(self, n: int, nbytes: float) -> float:
        if n <= 1:
            return 0.0
        return self.alpha_s + 2 * (n - 1) / n * nbytes / self.bandwidth_Bps

    def step_s(self, n: int, compute_s: float, grad_bytes: float) -> float:
        return compute_s + self.allreduce_s(n, grad_bytes)

    def speedup(self, n: int, compute_s: float, grad_bytes: float) -> float:
        """Weak scaling: throughput at N over throughput at 1."""
        return n * self.step_s(1, compute_s, grad_bytes) / self.step_s(n, compute_s, grad_bytes)

    def efficiency(self, n: int, compute_s: float, grad_bytes: float) -> float:
        return self.speedup(n, compute_s, grad_bytes) / n


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
