"""MFU in `make benchmark`: model FLOPs per step, the peak of the device and dtype, the columns.

The harness counts the benchmark model's step once per (model, per-rank batch) on the meta
device, watches each method's last (untimed) step for the dtype its FLOPs ran in, and divides
the achieved FLOP/s by the peak of that device and dtype times the devices computing. Here the
rank side runs in this process (one rank, no process group) and GPUs are faked.
"""

from __future__ import annotations

import csv
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import benchmarks.run as run
import dpt.flops as flops
from benchmarks.registry import BenchContext, Method, optimizer_step


def _hand_count(model: nn.Module, x: torch.Tensor) -> int:
    """Forward + backward FLOPs of ``model`` on ``x`` from its layers' shapes, by hand.

    Forward: 2 per multiply-add of every convolution and linear layer. Backward: the weight
    gradient costs as much again, the input gradient too, except for the first layer (its
    input, the data, needs no gradient).
    """
    shapes = []

    def hook(module, inputs, out):
        if isinstance(module, nn.Conv2d):
            kh, kw = module.kernel_size
            macs = (out.numel() * (module.in_channels // module.groups) * kh * kw)
        else:
            macs = out.numel() * module.in_features
        shapes.append(2 * macs)

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return sum(shapes) + 2 * sum(shapes) - shapes[0]


def _record(method="ddp", n=2, batch=8, sps=400.0, lo=360.0, hi=440.0, **extra) -> dict:
    rec = {"method": method, "nprocs": n, "status": "ok", "per_rank_batch": batch,
           "samples_per_s": sps, "samples_per_s_lo": lo, "samples_per_s_hi": hi,
           "flops_seen": 1, "compute_dtype": "fp32", "devices": n}
    rec.update(extra)
    return rec


def _peaks(asked: list):
    table = {"fp32": (2e12, "fp32 test peak"), "bf16": (8e12, "bf16 test peak")}

    def peak_fn(device_type, dtype, threads, probe=None):
        asked.append((device_type, dtype, threads))
        return table[dtype]
    return peak_fn


def test_mfu_is_model_flops_per_sample_times_samples_per_s_over_peak_times_devices():
    asked: list = []
    records = [_record("ddp", 1, devices=1), _record("ddp", 2),
               _record("amp_bf16", 2, compute_dtype="bf16"),
               _record("dp", 1, devices=2),                       # one process, two GPUs
               _record("sleeps", 2, flops_seen=0),
               {"method": "broken", "nprocs": 2, "status": "failed", "error": "x"}]
    block = run.add_mfu(records, "convnet", "cuda", 1, peak_fn=_peaks(asked))
    ctx = BenchContext(0, 1, torch.device("cpu"), 8, "convnet")
    per_sample = _hand_count(ctx.model(), ctx.batch()[0]) / 8
    for r in records[:4]:
        peak = 8e12 if r["compute_dtype"] == "bf16" else 2e12
        assert r["flops_per_sample"] == pytest.approx(per_sample), r["method"]
        assert r["flops_per_step"] == per_sample * r["per_rank_batch"]
        assert r["achieved_tflops"] == pytest.approx(per_sample * 400.0 / 1e12)
        assert r["achieved_tflops_per_rank"] == pytest.approx(r["achieved_tflops"] / r["nprocs"])
        assert r["mfu"] == pytest.approx(per_sample * 400.0 / (peak * r["devices"])), r["method"]
        assert r["mfu_lo"] < r["mfu"] < r["mfu_hi"]
        assert r["mfu_lo"] == pytest.approx(r["mfu"] * 360 / 400)
    # each dtype's peak is got once per run, whatever the number of records
    assert asked == [("cuda", "fp32", 1), ("cuda", "bf16", 1)]
    assert "mfu" not in records[4] and "no MFU" in records[4]["notes"][0]
    assert "mfu" not in records[5]
    assert block["peaks"] == {"fp32": {"tflops": 2.0, "label": "fp32 test peak"},
                              "bf16": {"tflops": 8.0, "label": "bf16 test peak"}}


def test_a_method_that_trains_its_own_model_is_rated_on_that_models_flops():
    """Lesson 09's methods train a TinyTransformer whatever --model says: their MFU counts its
    FLOPs (about 20 times the convnet's at the same batch), not the convnet's."""
    from benchmarks.registry import REGISTRY, load_all
    from dpt.models import TinyTransformer, token_batch

    load_all()
    records = [_record("fsdp2_bf16", 2, compute_dtype="bf16"), _record("ddp", 2)]
    run.add_mfu(records, "convnet", "cuda", 1, peak_fn=_peaks([]))
    config = sys.modules[REGISTRY["fsdp2_bf16"].factory.__module__].CONFIG
    x, _ = token_batch(8, config["seq_len"], config["vocab"])
    own = flops.step_flops(TinyTransformer(**config), x)
    convnet = run.model_flops_per_step("convnet", 8)
    assert records[0]["flops_per_step"] == own and records[0]["flops_model"] == "TinyTransformer"
    assert records[0]["mfu"] == pytest.approx(own / 8 * 400.0 / (8e12 * 2))
    assert records[1]["flops_per_step"] == convnet and "flops_model" not in records[1]
    assert own > 5 * convnet
    # rank 0's step computed what the method's own count says: no note
    records = [_record("fsdp_by_hand_bf16", 2, compute_dtype="bf16", flops_seen=own)]
    run.add_mfu(records, "convnet", "cuda", 1, peak_fn=_peaks([]))
    assert "notes" not in records[0]


def test_the_summary_and_the_csv_carry_flops_mfu_and_name_the_peak(monkeypatch):
    text, records = _summary_on_a_faked(monkeypatch, "NVIDIA H200")
    head = next(line for line in text.splitlines() if line.startswith("| method |"))
    assert "TFLOP/s all (per rank)" in head and "| MFU |" in head
    row = next(line for line in text.splitlines() if line.startswith("| amp_bf16 | 2 | ok |"))
    cells = [c.strip() for c in row.split("|")]
    columns = [c.strip() for c in head.split("|")]
    mfu_cell = cells[columns.index("MFU")]
    r = records[1]
    assert mfu_cell.startswith(f"{run._sig(100 * r['mfu'])}% [") and mfu_cell.endswith("bf16")
    assert cells[columns.index("TFLOP/s all (per rank)")] == (
        f"{run._sig(r['achieved_tflops'])} ({run._sig(r['achieved_tflops_per_rank'])})")
    # the peak named with where it came from: H200's datasheet for both dtypes
    assert "H200 datasheet, dense bf16 (989.4 TFLOP/s)" in text
    assert "H200 datasheet, dense fp32 (67 TFLOP/s)" in text
    rows = list(csv.DictReader(run.records_csv(records).splitlines()))
    assert float(rows[1]["mfu"]) == pytest.approx(r["mfu"])
    assert rows[1]["compute_dtype"] == "bf16" and float(rows[1]["peak_tflops"]) == 989.4


def test_make_gpu_check_expects_the_mfu_the_summary_writes_on_a_gpu(monkeypatch, tmp_path):
    import importlib.util
    import re

    from tests.lessons import REPO

    spec = importlib.util.spec_from_file_location("gpu_check_h5", REPO / "tools" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check_h5", gpu_check)   # its dataclasses look it up
    spec.loader.exec_module(gpu_check)
    bench = next(i for i in gpu_check.items(1, 16, tmp_path) if i.name == "benchmark-quick")
    assert bench.expect and "MFU" in bench.what
    text, _ = _summary_on_a_faked(monkeypatch, "NVIDIA H200")
    assert all(re.search(pattern, text) for pattern in bench.expect), text
    plain, _ = _summary_on_a_faked(monkeypatch, "NVIDIA H200", with_mfu=False)
    assert not any(re.search(pattern, plain) for pattern in bench.expect), plain


def _summary_on_a_faked(monkeypatch, gpu: str, with_mfu: bool = True) -> tuple[str, list]:
    """The summary of two records (fp32 DDP, bf16 autocast) measured on a faked ``gpu``."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    records = [_record("ddp", 2), _record("amp_bf16", 2, compute_dtype="bf16")]
    for r in records:
        r.update(step_s=0.02, peak_mem_mb=100.0, final_loss=0.5)
    result = {"machine": {"label": "test", "cpu": "cpu", "torch": torch.__version__},
              "config": {"scaling": "weak", "batch_size": 8, "strong": False, "repeats": 2,
                         "steps": 2}, "stamp": "now", "records": records}
    if with_mfu:
        result["mfu"] = run.add_mfu(records, "convnet", "cuda", 1)
    return run.summary_markdown(result), records


def test_an_unknown_gpu_and_the_cpu_get_the_probe_labelled_as_such(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    monkeypatch.setattr(flops, "measure_peak", lambda device, dtype=None, seconds=0.3: 3e12)
    peak, label = run.device_peak("cuda", "bf16", 1)
    assert peak == 3e12 and label == (f"{flops.PROBE_LABEL} (no datasheet entry for "
                                      "'NVIDIA L40S')")
    threads = []
    monkeypatch.setattr(flops, "measure_peak",
                        lambda device, dtype=None, seconds=0.3: threads.append(
                            torch.get_num_threads()) or 5e10)
    before = torch.get_num_threads()
    peak, label = run.device_peak("cpu", "fp32", 1)
    assert peak == 5e10 and threads == [1] and torch.get_num_threads() == before
    assert label.startswith(flops.PROBE_LABEL) and "one rank's share" in label
    # bf16 on a CPU without bf16 instructions: the fp32 units' rate, said so
    monkeypatch.setattr("dpt.precision.cpu_flags", lambda: ["avx2", "fma"])
    asked = []
    monkeypatch.setattr(flops, "measure_peak",
                        lambda device, dtype=None, seconds=0.3: asked.append(dtype) or 5e10)
    peak, label = flops.peak_flops("cpu", torch.bfloat16)
    assert asked == [torch.float32] and "no bf16 instructions" in label
    monkeypatch.setattr("dpt.precision.cpu_flags", lambda: ["avx512_bf16"])
    flops.peak_flops("cpu", torch.bfloat16)
    assert asked[-1] == torch.bfloat16


def _method(name: str, autocast: bool) -> Method:
    def factory(ctx: BenchContext):
        model = ctx.model().to(ctx.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        batch = ctx.batch()

        def step():
            if not autocast:
                return optimizer_step(model, opt, batch)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            opt.step()
            return loss.item()
        return step
    return Method(name, "test only", factory)


def test_each_rank_reports_the_dtype_its_step_computed_in_and_the_flops_it_saw(monkeypatch):
    methods = {"plain": _method("plain", False), "autocast_bf16": _method("autocast_bf16", True)}
    monkeypatch.setattr(run, "load_all", lambda: methods)
    monkeypatch.setattr("dpt.dist.rank_device", lambda: torch.device("cpu"))
    cfg = {"threads_per_rank": 1, "pin": False, "batch_size": 4, "strong": False,
           "model": "convnet", "warmup": 1, "steps": 1, "repeats": 1}
    expected = run.model_flops_per_step("convnet", 4)
    for name, dtype in (("plain", "fp32"), ("autocast_bf16", "bf16")):
        out = run.bench_rank(0, 1, name, cfg)
        assert out["compute_dtype"] == dtype, name
        assert out["flops_seen"] == expected and out["devices"] == ["cpu"]


def test_launch_counts_the_distinct_gpus_of_a_launch_and_each_cpu_rank(monkeypatch):
    ranks = [{"rank": i, "step_times": [0.1], "per_rank_batch": 8, "peak_mem_mb": 1.0,
              "mem_kind": "x", "loss": 0.0, "threads": 1, "devices": ["cuda:0"],
              "compute_dtype": "bf16", "flops_seen": 5} for i in range(2)]  # sharing a GPU
    monkeypatch.setattr("dpt.ranks.run_distributed", lambda *a, **k: ranks)
    spawn = types.SimpleNamespace(launcher="spawn")
    out = run.launch("m", 2, run.Config(), {"m": spawn})
    assert out["status"] == "ok", out
    assert out["devices"] == 1 and out["compute_dtype"] == "bf16" and out["flops_seen"] == 5
    for r in ranks:
        r["devices"] = ["cpu"]
    assert run.launch("m", 2, run.Config(), {"m": spawn})["devices"] == 2
    ranks[1]["devices"] = ["cuda:1"]
    for r in ranks:
        r["devices"] = [f"cuda:{r['rank']}"]
    assert run.launch("m", 2, run.Config(), {"m": spawn})["devices"] == 2


def test_a_run_probes_the_cpu_once_when_bf16_runs_on_the_fp32_units(monkeypatch):
    monkeypatch.setattr("dpt.precision.cpu_flags", lambda: ["avx2", "fma"])
    asked = []
    monkeypatch.setattr(flops, "measure_peak",
                        lambda device, dtype=None, seconds=0.3: asked.append(dtype) or 4e10)
    records = [_record("ddp", 2), _record("amp_bf16", 2, compute_dtype="bf16")]
    block = run.add_mfu(records, "convnet", "cpu", 1)
    assert asked == [torch.float32]
    assert block["peaks"]["fp32"]["tflops"] == block["peaks"]["bf16"]["tflops"] == 0.04
    assert records[0]["mfu"] == pytest.approx(records[1]["mfu"])   # same rate, same peak
