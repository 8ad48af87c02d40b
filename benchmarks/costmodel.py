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
interconnect (:data:`PRESETS`) to project onto hardware this machine is not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Interconnect:
    label: str
    bandwidth_GBps: float  # nominal, per direction, per GPU (or per node for a network)
    latency_us: float  # alpha: the fixed cost of one all-reduce, order of magnitude


# Targets to project onto. Bandwidths are the nominal per-direction figures of the
# specifications, so a projection is optimistic (NCCL reaches roughly 75-90% of them on large
# messages). Sources:
# - PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b encoding = 31.5 GB/s per direction
#   (PCI-SIG, PCIe 4.0 base specification); 25 GB/s is the usable figure GPUs reach over it.
# - PCIe 5.0 x16: 32 GT/s x 16 lanes = 63 GB/s per direction (PCI-SIG, PCIe 5.0); 50 usable.
# - NVLink 3 (A100 SXM4): 600 GB/s total per GPU, 300 GB/s each way (NVIDIA A100 datasheet).
# - NVLink 4 (H100/H200 SXM5): 900 GB/s total per GPU, 450 GB/s each way (NVIDIA H100
#   datasheet); nccl-tests reports 460-480 GB/s bus bandwidth on 8 x H100 with NVSwitch.
# - InfiniBand HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s per port (IBTA; one port a node).
# - Ethernet 100 Gb/s = 12.5 GB/s, 10 Gb/s = 1.25 GB/s.
# Latencies: the time of a small (8-byte) all-reduce as nccl-tests shows it, an order of
# magnitude and not a specification: about 10 us inside an NVLink node, 20 us over PCIe,
# 10-20 us more across InfiniBand, 50-100 us over TCP on Ethernet.
PRESETS: dict[str, Interconnect] = {
    "nvlink4": Interconnect("NVLink 4 (H100/H200 SXM)", 450.0, 10.0),
    "nvlink3": Interconnect("NVLink 3 (A100 SXM)", 300.0, 10.0),
    "pcie5x16": Interconnect("PCIe 5.0 x16", 50.0, 20.0),
    "pcie4x16": Interconnect("PCIe 4.0 x16", 25.0, 20.0),
    "infiniband-ndr": Interconnect("InfiniBand NDR 400 Gb/s", 50.0, 30.0),
    "infiniband-hdr": Interconnect("InfiniBand HDR 200 Gb/s", 25.0, 30.0),
    "ethernet-100g": Interconnect("Ethernet 100 Gb/s", 12.5, 50.0),
    "ethernet-10g": Interconnect("Ethernet 10 Gb/s", 1.25, 100.0),
}

# Nominal per-direction bandwidths, in GB/s, by preset name.
INTERCONNECTS = {name: p.bandwidth_GBps for name, p in PRESETS.items()}


def default_interconnect(gpu_names: list[str]) -> str:
    """The preset a machine with these GPUs most likely has between them: NVLink on an SXM
    H100/H200 or A100, PCIe on a PCIe card or anything else (a guess from the name only)."""
    names = " ".join(gpu_names).upper()
    if "PCIE" in names:
        return "pcie5x16" if any(g in names for g in ("H100", "H200")) else "pcie4x16"
    if any(g in names for g in ("H100", "H200", "H800", "GH200")):
        return "nvlink4"
    if any(g in names for g in ("A100", "A800")):
        return "nvlink3"
    return "pcie4x16"


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
