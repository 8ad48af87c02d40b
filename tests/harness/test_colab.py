"""The README's Colab recipe, checked as far as this machine can: its commands, and the device
choice on Colab's one GPU with two ranks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import dpt.device
from dpt import testing
from dpt.device import pick_device
from tests.lessons import REPO


def _recipe() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("### Colab"):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "the README's Colab section has no setup cell"
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


def test_one_gpu_two_ranks_the_notebooks_ranks_use_gloo_on_the_cpu(colab):
    # run_distributed(..., backend="auto") with 2 ranks and 1 GPU: gloo, so rank_device() is
    # the CPU in each rank (NCCL would need a GPU per rank).
    assert testing.default_backend(2) == "gloo"
    assert testing.default_backend(1) == "nccl"
    # a single-process lesson takes the GPU
    assert pick_device("auto").type == "cuda"
