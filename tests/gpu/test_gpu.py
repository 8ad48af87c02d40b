"""The GPU paths, run for real on CUDA: `make gpu-check` runs these first.

On a machine without CUDA every test here is skipped with its reason; they are written for
one GPU (``gpu``) or two and more (``gpu2``: NCCL, one rank per GPU). The rest of the suite
runs on the CPU with gloo on every machine (see tests/conftest.py), so these are where the
CUDA tensors, NCCL collectives and device meshes are exercised.
"""

from __future__ import annotations

import math

import pytest
import torch

from dpt.ranks import run_distributed
from tests.gpu import rank_fns
from tests.lessons import load

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
gpu = pytest.mark.skipif(N_GPUS < 1, reason="needs a CUDA GPU")
gpu2 = pytest.mark.skipif(N_GPUS < 2, reason="needs 2 or more CUDA GPUs (NCCL, one per rank)")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def use_the_gpus(monkeypatch) -> None:
    """Let ``run_distributed(backend="auto")`` place the ranks by this machine's GPUs.

    The suite forces gloo on the CPU (``DPT_TEST_BACKEND=gloo``, tests/conftest.py); a test
    that means the GPUs undoes it: NCCL with a GPU per rank, else the ranks share the GPU(s)
    with gloo (``dpt.ranks.placement``)."""
    monkeypatch.setenv("DPT_TEST_BACKEND", "auto")
    monkeypatch.delenv("DPT_SHARE_GPU", raising=False)


@gpu
def test_precision_auto_is_bf16_only_where_the_gpu_has_it_natively():
    from dpt.precision import choose_precision

    device = torch.device("cuda", 0)
    dtype, scaler = choose_precision(device, "auto")
    native = torch.cuda.get_device_properties(device).major >= 8
    assert (dtype, scaler) == ((torch.bfloat16, False) if native else (torch.float16, True))


@gpu
def test_fp16_step_skips_an_injected_inf_and_backs_off():
    from dpt.dist import group_of_one
    from dpt.models import ConvNet

    amp = load("06_mixed_precision", "amp_train")
    ddp_amp = load("06_mixed_precision", "ddp_amp")
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g))
    with group_of_one(device):  # the lesson's Trainer wraps its model in DDP
        trainer = ddp_amp.Trainer(model, None, opt, device, precision="fp16", max_norm=1.0)
        assert trainer.scaler.is_enabled()
        out = amp.watched_step(trainer, batch)
        assert math.isfinite(out["loss"]) and not out["skipped"]
        before = [p.detach().clone() for p in model.parameters()]
        out = amp.watched_step(trainer, amp.inject_inf(batch))
        assert out["skipped"] and trainer.scaler.get_scale() == out["scale"] / 2
    for p, q in zip(model.parameters(), before):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # the step was skipped


@gpu
def test_gloo_ranks_on_a_gpu_machine_shard_on_the_cpu():
    """FSDP2 without a mesh would take the accelerator's: cuda, for gloo ranks."""
    for mode in ("fsdp2", "ddp"):
        ranks = run_distributed(rank_fns.fsdp2_worker, world_size=2, backend="gloo",
                                args=(mode,), timeout=240)
        assert {r["device"] for r in ranks} == {"cpu"}


@gpu2
def test_nccl_all_reduce_on_each_ranks_gpu():
    ranks = run_distributed(rank_fns.all_reduce_on_rank_device, world_size=2,
                            backend="nccl", timeout=120)
    assert [r["device"] for r in ranks] == ["cuda:0", "cuda:1"]
    assert all(r["backend"] == "nccl" and r["sum"] == [3.0] * 4 for r in ranks)


@gpu2
def test_fsdp2_on_nccl_trains_like_ddp():
    fsdp = run_distributed(rank_fns.fsdp2_worker, world_size=2, backend="nccl",
                           args=("fsdp2",), timeout=240)
    ddp = run_distributed(rank_fns.fsdp2_worker, world_size=2, backend="nccl",
                          args=("ddp",), timeout=240)
    assert [r["device"] for r in fsdp] == ["cuda:0", "cuda:1"]
    # Reductions in another order on GPU: close, not bit-equal.
    assert fsdp[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-3, abs=1e-4)


@gpu2
def test_sharded_optimizer_on_nccl_matches_plain_adam():
    ranks = run_distributed(rank_fns.zero_demo, world_size=2, backend="nccl", timeout=240)
    assert all(r["max_diff"] < 1e-4 for r in ranks)


@gpu2
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_ddp_autocast_on_nccl_keeps_ranks_in_sync(precision):
    if precision == "bf16" and torch.cuda.get_device_properties(0).major < 8:
        pytest.skip("bf16 is emulated before compute capability 8.0")
    ranks = run_distributed(rank_fns.amp_ddp, world_size=2, backend="nccl",
                            args=(precision,), timeout=240)
    assert all(r["allreduce_dtypes"] == ["torch.float32"] for r in ranks)
    torch.testing.assert_close(ranks[0]["params"], ranks[1]["params"])


@gpu
def test_lesson_10_traces_on_the_gpu_hold_kernels_and_the_collectives(monkeypatch, tmp_path):
    """One traced step on the GPU(s): NCCL with a GPU per rank, else 2 gloo ranks sharing
    one GPU. The trace holds CUDA kernels, communication, and a hidden fraction in [0, 1]."""
    from dpt.ranks import placement

    tr = load("10_inside_a_step", "traces")
    use_the_gpus(monkeypatch)
    where = placement(2)
    assert where.device == "cuda" and where.backend == ("nccl" if N_GPUS >= 2 else "gloo"), where
    ranks = tr.run_traces(("torch_ddp", "naive", "bucketed"), nproc=2, out=tmp_path,
                          timeout=240)
    for method in ("torch_ddp", "naive", "bucketed"):
        events = tr.read_trace(tr.result_of(ranks, method)[0]["path"])
        assert tr.on_gpu(events), f"{method}: no CUDA kernel in the trace"
        assert tr.comm_intervals(events), f"{method}: no communication in the trace"
        if N_GPUS >= 2:
            assert any("nccl" in e.name.lower() for e in events if e.cat == "kernel"), method
        fraction = tr.hidden_fraction(events)["fraction"]
        assert fraction is not None and 0.0 <= fraction <= 1.0, (method, fraction)


@gpu
def test_lesson_10_compiled_ddp_on_one_gpu_trains_like_eager():
    cdp = load("10_inside_a_step", "compile_ddp")
    problem = cdp.compiler_problem("cuda")
    if problem:
        pytest.skip(problem)
    (rank,) = run_distributed(rank_fns.compiled_vs_eager, world_size=1, backend="nccl",
                              args=("inductor",), timeout=280)
    assert rank["device"] == "cuda:0"
    # inductor fuses and reorders float operations: close, not bit-equal
    assert rank["compiled"] == pytest.approx(rank["eager"], rel=1e-3, abs=1e-4)
