"""One device rule for every lesson (dpt.device.pick_device), pinned down on this Linux box.

A Mac's MPS serves one process: no distributed backend supports it (gloo runs on the CPU,
NCCL on CUDA). So ``auto`` picks MPS for a single-process lesson and the CPU for ranks, and an
explicit ``mps`` with several processes is refused in one line. The tests make the code believe
MPS is there by patching ``dpt.device.mps_available``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import dpt.device
import dpt.dist
from dpt.device import DeviceError, pick_device
from tests.lessons import load


@pytest.fixture
def mac(monkeypatch):
    """An Apple-silicon laptop: MPS available, no CUDA."""
    monkeypatch.setattr(dpt.device, "mps_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_auto_is_mps_for_one_process_and_cpu_for_ranks(mac):
    assert pick_device("auto").type == "mps"
    assert pick_device("auto", distributed=True).type == "cpu"


def test_explicit_mps_with_several_processes_is_one_clear_line(mac):
    with pytest.raises(DeviceError) as err:
        pick_device("mps", distributed=True)
    message = str(err.value)
    assert "\n" not in message and "MPS" in message and "--device" in message


def test_without_mps_or_cuda_auto_is_the_cpu_everywhere(monkeypatch):
    monkeypatch.setattr(dpt.device, "mps_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto").type == pick_device("auto", distributed=True).type == "cpu"


def test_the_shared_process_group_setup_refuses_mps_before_joining(mac, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(dpt.dist.find_free_port()))
    with pytest.raises(DeviceError, match="MPS"):
        dpt.dist.setup(rank=0, world_size=2, device="mps")
    assert not torch.distributed.is_initialized()


@pytest.mark.timeout(60)
def test_the_shared_setup_puts_ranks_on_the_cpu_under_auto(mac, monkeypatch, capsys):
    monkeypatch.setenv("MASTER_PORT", str(dpt.dist.find_free_port()))
    threads = torch.get_num_threads()
    try:
        assert dpt.dist.setup(rank=0, world_size=1, device="auto").type == "cpu"
        assert torch.distributed.get_backend() == "gloo"
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and "MPS" in out[0] and "CPU" in out[0], out  # said once
    finally:
        dpt.dist.cleanup()
        torch.set_num_threads(threads)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.pop(var, None)


def test_lesson06_ddp_refuses_mps_in_one_line(mac, capsys):
    from dpt import cli

    ddp_amp = load("06_mixed_precision", "ddp_amp")
    assert cli.main(cli.with_free_port(ddp_amp.launch), ddp_amp.build_parser(),
                    ["--device", "mps", "-g", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "MPS" in err[0]


def test_lesson06_single_process_keeps_mps(mac):
    from dpt.precision import choose_precision

    assert pick_device("auto").type == "mps"
    # autocast on MPS: fp32 (bf16 is refused there with its reason), never an error for auto
    dtype, scaler = choose_precision(torch.device("mps"), "auto")
    assert dtype is None and scaler is False


def test_lesson07_lightning_ranks_on_a_mac_use_the_cpu(mac, capsys):
    lit = load("07_lightning", "lit_train")
    assert lit.resolve_accelerator("auto", 2, False, True) == "cpu"
    assert "MPS" in capsys.readouterr().err
    assert lit.resolve_accelerator("auto", 1, False, True) == "auto"  # Lightning picks MPS
    with pytest.raises(lit.UsageError, match="MPS"):
        lit.resolve_accelerator("mps", 2, False, True)


# ------------------------------------------------------------------ ranks sharing the GPUs
# DPT_SHARE_GPU=1 lets N ranks run on a machine's GPUs (gloo, local rank r on GPU r % count),
# so a one-GPU machine runs multi-rank code with its tensors on the GPU. These tests fake the
# GPUs: torch.cuda's answers are patched, and torch.cuda.set_device only records its argument.


def _fake_gpus(count: int, patch=None) -> list[torch.device]:
    """Make this process see ``count`` CUDA GPUs (0: none); returns the set_device calls.

    ``patch`` is pytest's monkeypatch in the test process; in a rank process (which ends
    after the rank function) plain assignment does."""
    calls: list[torch.device] = []
    fakes = {"is_available": lambda: count > 0, "device_count": lambda: count,
             "set_device": lambda d: calls.append(torch.device(d))}
    for name, fake in fakes.items():
        if patch is not None:
            patch.setattr(torch.cuda, name, fake)
        else:
            setattr(torch.cuda, name, fake)
    if patch is not None:
        patch.setattr(dpt.device, "mps_available", lambda: False)
    else:
        dpt.device.mps_available = lambda: False
    return calls


@pytest.fixture
def no_share(monkeypatch):
    """Neither this machine's DPT_SHARE_GPU nor DPT_TEST_BACKEND decides for the test."""
    monkeypatch.delenv("DPT_SHARE_GPU", raising=False)
    monkeypatch.delenv("DPT_TEST_BACKEND", raising=False)


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_sharing_ranks_use_gloo_and_gpu_r_mod_count(monkeypatch, no_share, gpus):
    _fake_gpus(gpus, monkeypatch)
    assert not dpt.dist.shares_gpu() and dpt.device.backend_for("cuda") == "nccl"
    monkeypatch.setenv("DPT_SHARE_GPU", "1")
    assert dpt.dist.shares_gpu(), "DPT_SHARE_GPU=1 on a GPU machine: the ranks share the GPUs"
    assert dpt.device.backend_for("cuda") == "gloo", "NCCL refuses two ranks on one GPU"
    assert dpt.device.backend_for("cpu") == "gloo"
    for local_rank in range(2 * gpus + 1):
        assert dpt.device.gpu_for(local_rank) == torch.device("cuda", local_rank % gpus)


def test_without_a_gpu_the_share_variable_changes_nothing(monkeypatch, no_share):
    _fake_gpus(0, monkeypatch)
    monkeypatch.setenv("DPT_SHARE_GPU", "1")
    assert not dpt.dist.shares_gpu()
    assert pick_device("auto", distributed=True).type == "cpu"


def test_a_bad_share_value_is_one_clear_line(monkeypatch, no_share):
    _fake_gpus(1, monkeypatch)
    monkeypatch.setenv("DPT_SHARE_GPU", "maybe")
    with pytest.raises(DeviceError) as err:
        dpt.dist.shares_gpu()
    assert "\n" not in str(err.value) and "DPT_SHARE_GPU" in str(err.value)


def test_without_sharing_a_rank_past_the_last_gpu_is_refused_naming_the_way_out(
        monkeypatch, no_share):
    _fake_gpus(2, monkeypatch)
    assert dpt.device.gpu_for(1) == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match="needs GPU 2.*DPT_SHARE_GPU=1"):
        dpt.device.gpu_for(2)


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_the_launcher_accepts_more_processes_than_gpus_when_they_share(monkeypatch, no_share,
                                                                       device):
    from dpt import cli

    _fake_gpus(1, monkeypatch)
    with pytest.raises(DeviceError, match="one GPU per process"):
        cli.check_launch(1, 4, 0, device)
    monkeypatch.setenv("DPT_SHARE_GPU", "1")
    assert cli.check_launch(1, 4, 0, device) == 4, (
        "with DPT_SHARE_GPU=1, -g 4 on one GPU must be accepted: the ranks share it")


def test_run_distributed_picks_gloo_and_a_gpu_per_rank_when_they_share(monkeypatch, no_share):
    from dpt import ranks

    _fake_gpus(2, monkeypatch)
    assert ranks.default_backend(2) == "nccl"  # a GPU per rank, not sharing
    assert ranks.rank_cuda_device(1, "nccl") == torch.device("cuda", 1)
    assert ranks.rank_cuda_device(1, "gloo") is None  # gloo alone: the CPU
    monkeypatch.setenv("DPT_SHARE_GPU", "1")
    assert ranks.default_backend(2) == ranks.default_backend(5) == "gloo"
    assert [ranks.rank_cuda_device(r, "gloo") for r in range(5)] == [
        torch.device("cuda", r % 2) for r in range(5)]


@pytest.mark.parametrize("gpus", [0, 1, 2, 8])
def test_more_ranks_than_gpus_share_the_gpus_and_the_placement_says_so(monkeypatch, no_share,
                                                                       gpus):
    from dpt import ranks

    _fake_gpus(gpus, monkeypatch)
    where = ranks.placement(4)
    if gpus == 0:  # a machine without CUDA: as always, gloo on the CPU
        assert where == ("gloo", "cpu", False, "gloo (CPU)")
    elif gpus >= 4:
        assert where.backend == "nccl" and where.device == "cuda" and not where.shared
    else:
        assert (where.backend, where.device, where.shared) == ("gloo", "cuda", True), (
            f"4 ranks on {gpus} GPU(s) ran as {where}: on a GPU machine the ranks must not "
            "fall back to the CPU without a word; they share the GPUs with gloo")
        assert f"sharing {gpus} GPU(s)" in where.label, where.label
    assert ranks.default_backend(4) == where.backend
    monkeypatch.setenv("DPT_TEST_BACKEND", "gloo")  # the suite keeps its ranks on the CPU
    assert ranks.placement(4) == ("gloo", "cpu", False, "gloo (CPU)")


def share_variable(rank, world_size):
    return os.environ.get("DPT_SHARE_GPU")


@pytest.mark.timeout(90)
def test_run_distributed_shares_too_few_gpus_and_says_so_once(monkeypatch, no_share, capsys):
    from dpt import ranks

    _fake_gpus(1, monkeypatch)
    monkeypatch.setattr(ranks, "_SAID", set(), raising=False)
    for _ in range(2):
        got = ranks.run_distributed(share_variable, 2, timeout=60, echo=False)
        assert got == ["1", "1"], (
            f"the ranks saw DPT_SHARE_GPU={got}: 2 ranks on 1 GPU must share it (gloo, rank r "
            "on cuda:r % 1), not compute on the CPU while the GPU runs nothing")
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 1 and "2 ranks on 1 GPU(s)" in notes[0] and "share" in notes[0], notes


@pytest.mark.parametrize("gpus, backend", [(1, "gloo"), (2, "nccl"), (8, "nccl")])
def test_the_gpu_suites_traced_step_uses_the_gpus_this_machine_has(monkeypatch, gpus, backend):
    """tests/gpu's lesson 10 trace: NCCL with 2+ GPUs, the ranks sharing one GPU otherwise.
    It failed on every 2+ GPU node: the suite's DPT_TEST_BACKEND=gloo put its ranks on the
    CPU, and the trace held no CUDA kernel."""
    from dpt import ranks
    from tests.gpu.test_gpu import use_the_gpus

    _fake_gpus(gpus, monkeypatch)
    monkeypatch.setenv("DPT_TEST_BACKEND", "gloo")  # as tests/conftest.py sets it
    monkeypatch.delenv("DPT_SHARE_GPU", raising=False)
    assert ranks.placement(2).device == "cpu"  # the suite's own rank functions
    use_the_gpus(monkeypatch)
    where = ranks.placement(2)
    assert (where.backend, where.device, where.shared) == (backend, "cuda", gpus < 2), (
        f"on {gpus} GPU(s) the GPU test's 2 ranks would run as {where}")


@pytest.mark.timeout(60)
def test_setup_joins_with_gloo_on_this_rank_s_share_of_the_gpus(monkeypatch, no_share):
    calls = _fake_gpus(2, monkeypatch)
    monkeypatch.setenv("DPT_SHARE_GPU", "1")
    monkeypatch.setenv("MASTER_PORT", str(dpt.dist.find_free_port()))
    threads = torch.get_num_threads()
    try:
        # local process 3 of a machine with 2 GPUs (a world of one, so it can join alone)
        device = dpt.dist.setup(rank=0, world_size=1, local_rank=3, device="cuda", threads=1)
        assert device == torch.device("cuda", 1)
        assert calls == [torch.device("cuda", 1)], f"torch.cuda.set_device calls: {calls}"
        assert torch.distributed.get_backend() == "gloo"
        assert dpt.dist.rank_device() == torch.device("cuda", 1)
    finally:
        dpt.dist.cleanup()
        torch.set_num_threads(threads)
    assert dpt.dist.rank_device() == torch.device("cpu")  # outside a group


def shared_gpu_rank(rank, world_size, gpus):
    """A rank on a machine with ``gpus`` faked GPUs that joins through dpt.dist.setup."""
    calls = _fake_gpus(gpus)
    device = dpt.dist.setup(device="cuda", timeout_s=30)
    t = torch.tensor([float(rank + 1)])  # on the CPU: the GPUs are only pretended
    torch.distributed.all_reduce(t)
    out = {"device": str(device), "rank_device": str(dpt.dist.rank_device()),
           "set_device": [str(d) for d in calls], "backend": torch.distributed.get_backend(),
           "sum": t.item()}
    dpt.dist.cleanup()
    return out


@pytest.mark.timeout(90)
def test_two_ranks_share_one_gpu_in_a_real_group(no_share):
    from dpt.ranks import run_distributed

    results = run_distributed(shared_gpu_rank, 2, args=(1,), backend=None, timeout=60,
                              env={"DPT_SHARE_GPU": "1"}, echo=False)
    for rank, r in enumerate(results):
        assert r["backend"] == "gloo", f"rank {rank} joined with {r['backend']}"
        assert r["device"] == r["rank_device"] == "cuda:0", (
            f"rank {rank} got {r['device']}, rank_device() {r['rank_device']}: both ranks "
            "share the one GPU")
        assert r["set_device"] == ["cuda:0"] and r["sum"] == 3.0, r


# ------------------------------------------------------------------ the ranks agree first


def test_a_backend_mismatch_names_which_ranks_use_what():
    from dpt.dist import backend_mismatch

    gpu, cpu, shared = ("nccl", "cuda"), ("gloo", "cpu"), ("gloo", "cuda")
    assert backend_mismatch({0: gpu, 1: gpu}) is None
    assert backend_mismatch({0: cpu, 1: shared}) is None  # both gloo: they can talk
    line = backend_mismatch({0: gpu, 1: gpu, 2: cpu, 3: gpu})
    assert "\n" not in line
    assert "rank 2 runs on the CPU with gloo" in line and "ranks 0-1, 3 use NCCL" in line, line
    assert "--device cpu" in line, line
    assert "DPT_SHARE_GPU" in backend_mismatch({0: shared, 1: gpu})


def join_on_a_machine_with(rank, world_size, gpus_by_rank):
    """Rank ``rank`` sees ``gpus_by_rank[rank]`` (faked) GPUs and joins under --device auto."""
    _fake_gpus(gpus_by_rank[rank])
    start = time.monotonic()
    try:
        dpt.dist.setup(device="auto", timeout_s=30, threads=1)
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank was told
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start,
                "joined": torch.distributed.is_initialized()}
    dpt.dist.cleanup()
    return {"error": None}


@pytest.mark.timeout(90)
def test_a_node_without_a_gpu_among_gpu_nodes_is_one_error_on_every_rank(no_share):
    from dpt.ranks import run_distributed

    # rank 0 on a GPU machine (NCCL under auto), rank 1 on a machine without one (gloo)
    results = run_distributed(join_on_a_machine_with, 2, args=({0: 1, 1: 0},), backend=None,
                              timeout=60, echo=False)
    for rank, r in enumerate(results):
        error = r["error"]
        assert error and error.startswith("LaunchError"), (
            f"rank {rank} was told {error!r}: the ranks must agree on the backend before "
            "joining, and refuse with one clear error on every rank")
        assert "\n" not in error and "rank 1 runs on the CPU" in error, error
        assert "rank 0 uses NCCL" in error and "--device cpu" in error, error
        assert not r["joined"] and r["seconds"] < 20, r


def test_without_a_cpp_compiler_inductor_is_refused_in_one_line_and_the_benchmark_skips(
        monkeypatch, tmp_path):
    from benchmarks.run import unmet_requirement

    dpt.device.compiler_problem.cache_clear()
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no g++, c++ or clang++
    monkeypatch.setenv("DPT_TEST_BACKEND", "gloo")  # the ranks' device: the CPU
    try:
        problem = dpt.device.compiler_problem("cpu")
        assert problem is not None and "C++ compiler" in problem and "\n" not in problem
        assert unmet_requirement(("compiler",), 1) == problem
        fake = tmp_path / "g++"
        fake.write_text("#!/bin/sh\n")
        fake.chmod(0o755)
        dpt.device.compiler_problem.cache_clear()
        if dpt.device.compiler_problem("cpu") is not None:  # only dynamo itself is missing
            assert "not supported" in dpt.device.compiler_problem("cpu")
        else:
            assert unmet_requirement(("compiler",), 1) is None
    finally:
        dpt.device.compiler_problem.cache_clear()


def test_lightning_is_skipped_in_the_benchmark_where_ranks_would_share_a_gpu(monkeypatch):
    """Lightning's ddp gives each rank a GPU of its own: with 2 ranks on one GPU
    (DPT_SHARE_GPU=1) Fabric refuses ("You requested gpu: [0, 1]"), so the N is skipped."""
    pytest.importorskip("lightning_fabric")
    from benchmarks import run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(run, "rank_placement", lambda n: ("gloo", "cuda"))
    why = run.unmet_requirement(("lightning",), 2)
    assert why is not None and "needs 2 CUDA GPUs" in why and "\n" not in why, why
    assert run.unmet_requirement(("lightning",), 1) is None
