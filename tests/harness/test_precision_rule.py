"""The 16-bit format lesson 09 and its benchmark methods compute in: the course's own rule.

``dpt.precision`` says bf16 only where the hardware has it (a GPU of compute capability 8+,
and on a CPU the only 16-bit autocast); on a T4 or a V100 bf16 is emulated and fp16 is the
fast one. Lesson 09's ``--dtype`` and the ``fsdp_by_hand_bf16`` method used to hard-code bf16.
The GPUs are faked: ``torch.cuda.get_device_properties`` answers a compute capability.
"""

from __future__ import annotations

import types

import pytest
import torch

import dpt.device
from dpt.precision import compute_format, low_precision_for
from tests.lessons import load


def _gpus(monkeypatch, count: int, major: int = 8) -> None:
    """``count`` CUDA GPUs of compute capability ``major``.x; the suite's backend unset."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(major=major, minor=0))
    monkeypatch.setattr(dpt.device, "mps_available", lambda: False)
    monkeypatch.delenv("DPT_TEST_BACKEND", raising=False)
    monkeypatch.delenv("DPT_SHARE_GPU", raising=False)


@pytest.mark.parametrize("major, expected", [(6, "fp16"), (7, "fp16"), (8, "bf16"), (9, "bf16")])
def test_low_precision_for_follows_the_compute_capability(monkeypatch, major, expected):
    _gpus(monkeypatch, 1, major)
    assert low_precision_for((major, 5)) == expected
    assert low_precision_for(torch.device("cuda", 0)) == expected
    assert low_precision_for("cuda") == expected
    assert low_precision_for("cpu") == "bf16"  # the CPU's autocast has no fp16 recipe


def test_dtype_auto_says_what_it_chose_and_explicit_bf16_says_it_is_emulated(monkeypatch):
    _gpus(monkeypatch, 1, 7)  # a T4 (7.5) or a V100 (7.0)
    name, note = compute_format("auto", "cuda")
    assert name == "fp16" and "fp16" in note and "emulated" in note and "\n" not in note
    name, note = compute_format("bf16", "cuda")
    assert name == "bf16" and "emulated" in note, "an explicit bf16 runs as asked, said slow"
    assert compute_format("fp32", "cuda") == ("fp32", None)
    _gpus(monkeypatch, 1, 8)
    assert compute_format("bf16", "cuda") == ("bf16", None)
    assert compute_format("auto", "cpu")[0] == "bf16"


@pytest.mark.parametrize("major, dtype", [(7, torch.float16), (8, torch.bfloat16)])
def test_fsdp_by_hand_dtype_auto_computes_in_the_gpus_fast_format(monkeypatch, capsys,
                                                                   major, dtype):
    from dpt import ranks

    fbh = load("09_fsdp", "fsdp_by_hand")
    _gpus(monkeypatch, 2, major)
    asked = {}

    def fake_run(fn, world_size=2, **kw):
        asked.update(kw["kwargs"])
        return [{"rank": r, "losses": [1.0, 0.9], "step_seconds": [0.1],
                 "memory": {"shards": 1024, "gathered": 0}} for r in range(world_size)]

    monkeypatch.setattr(ranks, "run_distributed", fake_run)
    assert fbh.main(["--dtype", "auto", "--steps", "2"]) == 0
    assert asked["compute_dtype"] == dtype, (
        f"--dtype auto on a GPU of compute capability {major} computed in "
        f"{asked['compute_dtype']}: bf16 is emulated below 8, fp16 is the fast format there")
    out = capsys.readouterr()
    name = "fp16" if dtype == torch.float16 else "bf16"
    assert f"{name} compute" in out.out and f"--dtype auto computes in {name}" in out.err


@pytest.mark.parametrize("major, dtype, noted", [(7, torch.float16, True),
                                                 (8, torch.bfloat16, False)])
def test_the_hand_fsdp_benchmark_method_picks_by_the_rule_and_notes_it(monkeypatch, major,
                                                                       dtype, noted):
    from benchmarks.methods_l09 import compute_format as method_format

    _gpus(monkeypatch, 1, major)
    chosen, notes = method_format(torch.device("cuda", 0))
    assert chosen == dtype
    assert bool(notes) == noted and all("fp16" in n and "emulated" in n for n in notes)
    assert method_format(torch.device("cpu")) == (torch.bfloat16, [])


def test_the_comm_hooks_benchmark_labels_ranks_on_a_shared_gpu_as_such(monkeypatch):
    import sys

    from tests.lessons import REPO

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sys.modules.pop("bench_l10_comm_hooks", None)
    import bench_l10_comm_hooks as bench

    _gpus(monkeypatch, 0)
    assert bench.ranks_label(2) == "gloo (CPU)"
    _gpus(monkeypatch, 1)
    assert bench.ranks_label(2) == "gloo (CPU)"  # its ranks are gloo: the CPU unless shared
    monkeypatch.setenv("DPT_SHARE_GPU", "1")
    label = bench.ranks_label(2)
    assert "CPU" not in label and "sharing 1 GPU" in label, label


@pytest.mark.parametrize("major, dtype, noted", [(7, torch.float16, True),
                                                 (8, torch.bfloat16, False)])
def test_the_fsdp2_benchmark_method_builds_task_09_17s_policy_in_the_rules_format(
        monkeypatch, major, dtype, noted):
    """On a T4 the FSDP2 method's parameters compute in fp16 (bf16 is emulated there), with
    the student's policy otherwise as written (fp32 reduce), and its record says so."""
    import benchmarks.methods_l09 as methods

    fsdp2 = load("09_fsdp", "fsdp2_practice")
    monkeypatch.setitem(__import__("sys").modules, "fsdp2_practice", fsdp2)
    policies = []
    monkeypatch.setattr(fsdp2, "fully_shard",
                        lambda module, **kw: policies.append(kw["mp_policy"]))
    monkeypatch.setattr(fsdp2, "set_prefetch", lambda blocks, ahead=1: True)
    monkeypatch.setattr(fsdp2, "materialize", lambda model, device, seed: model)
    monkeypatch.setattr(methods, "_needs_group", lambda name: None)
    monkeypatch.setattr(fsdp2, "device_mesh", lambda: None)
    _gpus(monkeypatch, 1, major)
    made = fsdp2.MixedPrecisionPolicy
    ctx = types.SimpleNamespace(device=torch.device("cuda", 0), seed=0, rank=0, batch_size=2)
    monkeypatch.setattr(methods, "_tokens", lambda ctx: (None, None))
    monkeypatch.setattr(methods, "_step", lambda model, opt, batch: "step")
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr: None)
    step, record = methods.fsdp2_bf16(ctx)
    assert step == "step" and policies, "the method did not build through task 09.17's recipe"
    assert {p.param_dtype for p in policies} == {dtype}, (
        f"compute capability {major}: FSDP2 computed in {policies[0].param_dtype}, "
        f"not {dtype} (bf16 is emulated below 8)")
    assert {p.reduce_dtype for p in policies} == {torch.float32}
    assert bool(record.get("notes")) == noted
    assert fsdp2.MixedPrecisionPolicy is made, "the lesson's policy was left swapped"
