"""One device rule for every lesson (dpt.device.pick_device), pinned down on this Linux box.

A Mac's MPS serves one process: no distributed backend supports it (gloo runs on the CPU,
NCCL on CUDA). So ``auto`` picks MPS for a single-process lesson and the CPU for ranks, and an
explicit ``mps`` with several processes is refused in one line. The tests make the code believe
MPS is there by patching ``dpt.device.mps_available``.
"""

from __future__ import annotations

import os

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
    assert cli.main(lambda args: cli.spawn(ddp_amp.run, args), ddp_amp.build_parser(),
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
