"""``dpt.flops``: the peaks MFU is measured against, the matmul probe, and a step's FLOPs.

The datasheet table is checked through the names ``torch.cuda.get_device_name`` gives on real
machines; a GPU without an entry falls back to the probe, labelled. GPUs are faked on the CPU
(the probe runs on the CPU in their place). The FLOP counts are FlopCounterMode's, measured
here and derived by hand in the assertions (2 FLOPs per multiply-add).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import dpt.flops as flops
from dpt.models import MLP, TinyTransformer, token_batch

# (device name as torch reports it, table key)
REAL_NAMES = [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA L4", "L4"),
    ("Tesla T4", "T4"),
]
# Other GPUs whose names contain a known one: they must not borrow its figures.
LOOKALIKES = ["NVIDIA L40S", "NVIDIA L40", "NVIDIA A10", "NVIDIA GH200 480GB",
              "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA GeForce RTX 4090"]


@pytest.mark.parametrize("name, key", REAL_NAMES)
def test_datasheet_peak_picks_the_entry_of_a_real_device_name(name, key):
    for dtype, column in [(torch.bfloat16, "bf16"), (torch.float16, "fp16")]:
        if column not in flops.PEAK_TFLOPS[key]:
            continue
        peak, label = flops.datasheet_peak(name, dtype)
        assert peak == flops.PEAK_TFLOPS[key][column] * 1e12, (name, dtype)
        assert key in label and "datasheet" in label and column in label
    peak, label = flops.datasheet_peak(name, torch.float32, tf32=False)
    assert peak == flops.PEAK_TFLOPS[key]["fp32"] * 1e12 and "fp32" in label


def test_the_table_holds_the_dense_peaks_and_tf32_follows_the_flag():
    table = flops.PEAK_TFLOPS
    # one H100 SXM and H200 share their compute; tensor cores are far above plain fp32
    assert table["H200"] == table["H100 SXM"]
    for key, row in table.items():
        assert row["fp16"] > row["fp32"], key
        if "bf16" in row:
            assert row["bf16"] == row["fp16"], key   # same tensor-core rate on these parts
    # the TF32 peak applies to fp32 only when matmuls may use TF32; Turing has none
    assert flops.datasheet_peak("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True)[0] == 156e12
    assert flops.datasheet_peak("NVIDIA A100-SXM4-80GB", torch.float32, tf32=False)[0] == 19.5e12
    assert flops.datasheet_peak("Tesla T4", torch.float32, tf32=True)[0] == 8.1e12
    assert flops.datasheet_peak("Tesla T4", torch.bfloat16) is None   # no bf16 tensor cores
    # by default, PyTorch's own flag decides
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        peak, label = flops.datasheet_peak("NVIDIA H100 80GB HBM3", torch.float32)
        torch.backends.cuda.matmul.allow_tf32 = False
        assert flops.datasheet_peak("NVIDIA H100 80GB HBM3", torch.float32)[0] == 67e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert peak == 494.7e12 and "dense tf32" in label


@pytest.mark.parametrize("name", LOOKALIKES)
def test_a_gpu_without_an_entry_has_no_datasheet_peak(name):
    assert flops.gpu_key(name) is None
    assert flops.datasheet_peak(name, torch.bfloat16) is None


def _fake_gpu(monkeypatch, name: str) -> list:
    """A CUDA device named ``name``; the probe runs on the CPU and records what it was asked."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    def probe(device, dtype=torch.float32, seconds=0.3):
        asked.append((torch.device(device).type, dtype))
        return 1.5e12
    monkeypatch.setattr(flops, "measure_peak", probe)
    return asked


def test_peak_flops_uses_the_datasheet_on_a_known_gpu_and_the_probe_elsewhere(monkeypatch):
    asked = _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    assert flops.peak_flops("cuda", torch.bfloat16) == (
        989.4e12, "H100 SXM datasheet, dense bf16 (989.4 TFLOP/s)")
    assert asked == []

    asked = _fake_gpu(monkeypatch, "NVIDIA L40S")
    peak, label = flops.peak_flops("cuda", torch.bfloat16)
    assert (peak, asked) == (1.5e12, [("cuda", torch.bfloat16)])
    assert label.startswith(flops.PROBE_LABEL) and "no datasheet entry for 'NVIDIA L40S'" in label

    asked = _fake_gpu(monkeypatch, "Tesla T4")
    peak, label = flops.peak_flops("cuda", torch.bfloat16)
    assert peak == 1.5e12 and "T4 datasheet has no bf16 peak" in label


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match="no peak for dtype torch.int64"):
        flops.datasheet_peak("NVIDIA H200", torch.int64)
    with pytest.raises(ValueError, match="seconds must be positive"):
        flops.measure_peak("cpu", seconds=0)
    with pytest.raises(ValueError, match="step seconds and peak must be positive"):
        flops.mfu(1e9, 0.0, 1e12)


def test_the_probe_measures_a_plausible_cpu_matmul_rate():
    torch.manual_seed(0)
    peak = flops.measure_peak("cpu", seconds=0.1)
    # one 512x512 product timed here, best of 5: the probe's best of many may not be far below
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    assert peak > 0.3 * 2 * 512 ** 3 / best, (peak, best)
    assert peak < 1e13, "a CPU above 10 TFLOP/s in fp32: the probe is not timing its work"


def test_step_flops_counts_forward_and_backward_without_touching_the_model():
    torch.manual_seed(0)
    model = MLP()                      # 784 -> 128 -> 10
    x = torch.randn(8, 1, 28, 28)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    counts = flops.count_step(model, x)
    linear = [m for m in model.modules() if isinstance(m, nn.Linear)]
    fwd = sum(2 * 8 * m.in_features * m.out_features for m in linear)
    # FlopCounterMode counts addmm's bias add as nothing: fwd is exactly the matmuls
    assert counts["forward"] == fwd == 1_626_112
    # backward: a weight gradient for each layer, an input gradient for all but the first
    first = linear[0]
    assert counts["backward"] == 2 * fwd - 2 * 8 * first.in_features * first.out_features
    assert flops.step_flops(model, x) == counts["forward"] + counts["backward"]
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_step_flops_counts_attention_as_the_math_path_computes_it():
    torch.manual_seed(0)
    model = TinyTransformer()          # dim 64, 4 layers, sequence 64
    tokens = token_batch(8)[0]
    counts = flops.count_step(model, tokens)
    batch, seq, dim, layers = 8, 64, 64, 4
    attention = layers * 2 * (2 * batch * seq * seq * dim)       # QK^T and AV, full t^2
    # on the CPU the fused attention kernel is not counted: without MATH this would be missing
    assert counts["forward"] == 218_103_808 + attention == 251_658_240
    assert counts["backward"] == 2 * counts["forward"]    # tokens are an embedding lookup


def test_mfu_is_achieved_over_peak():
    assert flops.mfu(2e12, 0.5, 8e12) == pytest.approx(0.5)
