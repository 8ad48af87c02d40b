"""`make gpu-check` (tools/gpu_check.py): what can be checked without a GPU."""

import subprocess
import sys

import pytest
import torch

from tests.lessons import REPO


@pytest.mark.timeout(120)
def test_without_a_gpu_it_says_so_in_one_line_and_exits_3():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run `make gpu-check` itself")
    proc = subprocess.run([sys.executable, "tools/gpu_check.py"], capture_output=True,
                          text=True, timeout=100, cwd=REPO)
    assert proc.returncode == 3
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0], proc.stderr


@pytest.mark.timeout(120)
def test_every_item_names_an_existing_script(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_check

    for item in gpu_check.items(2, tmp_path):
        text = " ".join(item.argv)
        for word in text.replace("&&", " ").split():
            if word.startswith(("solutions/", "tests/")) and word.endswith(".py"):
                assert (REPO / word).is_file(), f"{item.name}: {word} does not exist"
            if word.startswith("tests.") or word.startswith("benchmarks."):
                path = REPO / (word.replace(".", "/") + ".py")
                assert path.is_file(), f"{item.name}: module {word} does not exist"
