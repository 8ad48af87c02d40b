"""The Colab recipe of docs/machines.md, checked as far as this machine can: its commands, and the device
choice on Colab's one GPU with two ranks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import dpt.device
from dpt import ranks
from dpt.device import pick_device
from tests.lessons import REPO


def _recipe() -> list[str]:
    text = (REPO / "docs" / "machines.md").read_text()
    section = text[text.index("## Colab"):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "the Colab section of docs/machines.md has no setup cell"
    return [line.strip() for line in block.group(1).splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_the_setup_cell_clones_installs_and_fetches_with_commands_that_exist():
    lines = _recipe()
    assert lines[0].startswith("!git clone") and lines[1].startswith("%cd ")
    assert "!pip install -q -e ." in lines and (REPO / "pyproject.toml").is_file()
    fetch = [ln for ln in lines if "-m dpt.data" in ln]
    assert fetch, "no data step"
    assert (REPO / "dpt" / "data.py").is_file()


@pytest.mark.timeout(120)
def test_the_data_command_runs_here_offline():
    (fetch,) = [ln for ln in _recipe() if "-m dpt.data" in ln]
    args = fetch.split("-m dpt.data", 1)[1].split()
    from dpt.data import is_present

    if not all(is_present(name) for name in args):
        pytest.skip("the datasets are not here: run `make data`")
    proc = subprocess.run([sys.executable, "-m", "dpt.data", *args, "--no-download"],
                          capture_output=True, text=True, timeout=100, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture
def colab(monkeypatch):
    """Colab's GPU runtime: one CUDA device (a T4), no MPS."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dpt.device, "mps_available", lambda: False)
    monkeypatch.delenv("DPT_TEST_BACKEND", raising=False)
    monkeypatch.delenv("DPT_SHARE_GPU", raising=False)


def test_one_gpu_two_ranks_the_notebooks_ranks_share_the_gpu_with_gloo(colab):
    # run_distributed(..., backend="auto") with 2 ranks and 1 GPU: NCCL would need a GPU per
    # rank, so gloo, with both ranks on the T4 (said in one line), not silently on the CPU.
    where = ranks.placement(2)
    assert (where.backend, where.device, where.shared) == ("gloo", "cuda", True)
    assert ranks.default_backend(1) == "nccl"
    # a single-process lesson takes the GPU
    assert pick_device("auto").type == "cuda"


def test_one_gpu_two_ranks_scripts_started_by_a_notebook_get_the_cpu_or_share_the_gpu(
        colab, monkeypatch):
    # Notebooks 03 and 04 pass ranks_device(2) as --device: cuda would be refused by
    # check_launch (one GPU per process) unless the ranks share it (DPT_SHARE_GPU=1, gloo).
    from dpt.notebook import ranks_device

    assert ranks_device(2) == "cpu" and ranks_device(1) == "cuda"
    monkeypatch.setenv("DPT_SHARE_GPU", "1")
    assert ranks_device(2) == "cuda"
    assert ranks_device(2, share=False) == "cpu", "Lightning and Fabric cannot share a GPU"


@pytest.mark.timeout(120)
def test_one_gpu_lightning_fsdp_on_two_devices_says_it_needs_two_gpus(colab, capsys):
    # Notebook 08's Lightning cell asked Lightning for GPUs [0, 1] on Colab's one GPU and died
    # in a MisconfigurationException. The helper must say why in a RuntimeError, and the
    # notebook cell must skip in one line.
    from dpt.notebook import needs_gpus, needs_tasks
    from tests.lessons import load

    ft = load("08_sharding", "fsdp2_train")
    with pytest.raises(RuntimeError, match=r"devices=2 needs 2 GPUs.*this machine has 1"):
        ft.lightning_fsdp_trainer(devices=2)
    with needs_tasks():
        needs_gpus(2)
        raise AssertionError("the cell went on with one GPU")
    assert capsys.readouterr().out.strip() == ("skipped: this cell needs 2 GPUs, this machine "
                                               "has 1")
