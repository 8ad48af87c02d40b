"""The links between GPUs the course projects onto, as their specifications state them.

One table shared by the benchmark's cost model (``benchmarks/costmodel.py``) and lesson 12's
crossover (``solutions/12_step_cost/crossover.py``). A specification states a GPU link in
bytes per second (NVLink, PCIe: GB/s) and a network in *bits* per second (InfiniBand,
Ethernet: Gb/s, 8 bits to the byte), so each entry keeps the figure and its unit as printed,
and :attr:`Interconnect.bandwidth_GBps` turns it into bytes.

Bandwidths are nominal, per direction, per GPU (or per node for a network), so a projection is
optimistic: NCCL reaches roughly 75-90% of them on large messages. Sources:

- PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b encoding = 31.5 GB/s per direction (PCI-SIG,
  PCIe 4.0 base specification); 25 GB/s is the usable figure GPUs reach over it.
- PCIe 5.0 x16: 32 GT/s x 16 lanes = 63 GB/s per direction (PCI-SIG, PCIe 5.0); 50 usable.
- NVLink 3 (A100 SXM4): 600 GB/s total per GPU, 300 GB/s each way (NVIDIA A100 datasheet).
- NVLink 4 (H100/H200 SXM5): 900 GB/s total per GPU, 450 GB/s each way (NVIDIA H100
  datasheet); nccl-tests reports 460-480 GB/s bus bandwidth on 8 x H100 with NVSwitch.
- InfiniBand HDR 200 Gb/s and NDR 400 Gb/s per port (IBTA; one port a node): 25 and 50 GB/s.
- Ethernet 100 Gb/s and 10 Gb/s: 12.5 and 1.25 GB/s.
- Ethernet 1 Gb/s (1000BASE-T, IEEE 802.3ab): 0.125 GB/s, the office or cloud network between
  machines that lesson 13 (training across a slow network) projects onto.

Latencies (alpha): the time of a small (8-byte) all-reduce as nccl-tests shows it, an order of
magnitude and not a specification: about 10 us inside an NVLink node, 20 us over PCIe,
10-20 us more across InfiniBand, 50-100 us over TCP on Ethernet.
"""

from __future__ import annotations

from dataclasses import dataclass

UNITS = ("GB/s", "Gb/s")  # bytes per second (GPU links), bits per second (networks)


@dataclass(frozen=True)
class Interconnect:
    label: str
    rate: float  # as the specification states it, in ``unit``, per direction
    unit: str  # "GB/s" or "Gb/s"
    latency_us: float  # alpha: the fixed cost of one collective call, order of magnitude

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"unit {self.unit!r} of {self.label}: expected one of {UNITS}")

    @property
    def bandwidth_GBps(self) -> float:
        """Gigabytes per second, per direction."""
        return self.rate / 8 if self.unit == "Gb/s" else self.rate


PRESETS: dict[str, Interconnect] = {
    "nvlink4": Interconnect("NVLink 4 (H100/H200 SXM)", 450.0, "GB/s", 10.0),
    "nvlink3": Interconnect("NVLink 3 (A100 SXM)", 300.0, "GB/s", 10.0),
    "pcie5x16": Interconnect("PCIe 5.0 x16", 50.0, "GB/s", 20.0),
    "pcie4x16": Interconnect("PCIe 4.0 x16", 25.0, "GB/s", 20.0),
    "infiniband-ndr": Interconnect("InfiniBand NDR 400 Gb/s", 400.0, "Gb/s", 30.0),
    "infiniband-hdr": Interconnect("InfiniBand HDR 200 Gb/s", 200.0, "Gb/s", 30.0),
    "ethernet-100g": Interconnect("Ethernet 100 Gb/s", 100.0, "Gb/s", 50.0),
    "ethernet-10g": Interconnect("Ethernet 10 Gb/s", 10.0, "Gb/s", 100.0),
    "ethernet-1g": Interconnect("Ethernet 1 Gb/s", 1.0, "Gb/s", 100.0),
}

# Nominal per-direction bandwidths, in GB/s, by preset name.
INTERCONNECTS = {name: p.bandwidth_GBps for name, p in PRESETS.items()}


def preset(name: str) -> Interconnect:
    """The preset called ``name``; an unknown name: ValueError naming the choices."""
    if name not in PRESETS:
        raise ValueError(f"unknown interconnect {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]


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
