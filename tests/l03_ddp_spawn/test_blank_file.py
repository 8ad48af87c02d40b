"""Lesson 03's "Check yourself": DDP written from a blank file (torch only) trains on 2 ranks.

``blank_file_ddp.py`` is what a student who finished the lesson can write without the course's
package: the rendezvous variables, ``init_process_group``, a ``DistributedSampler`` with
``set_epoch``, DDP, ``mp.spawn`` and ``destroy_process_group``. Here it runs on 2 gloo CPU ranks.
"""

from __future__ import annotations

import pytest
import torch

from dpt.dist import find_free_port
from tests.helpers import run_script
from tests.lessons import REPO

BLANK = REPO / "tests" / "l03_ddp_spawn" / "blank_file_ddp.py"


def test_the_lesson_readme_invites_the_student_to_write_it():
    readme = (REPO / "solutions" / "03_ddp_spawn" / "README.md").read_text()
    assert "## Check yourself" in readme and "tests/l03_ddp_spawn/blank_file_ddp.py" in readme


def test_the_blank_file_script_uses_torch_only():
    imports = [ln.split()[1] for ln in BLANK.read_text().splitlines()
               if ln.startswith(("import ", "from "))]
    assert imports and all(m.split(".")[0] in {"argparse", "os", "torch"} for m in imports), (
        imports)


@pytest.mark.timeout(180)
def test_ddp_from_a_blank_file_keeps_the_ranks_identical_and_learns(tmp_path):
    epochs = 5
    proc = run_script(BLANK, "--port", str(find_free_port()), "--world-size", "2",
                      "--epochs", str(epochs), "--out", str(tmp_path), timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for name, w0 in ranks[0]["model"].items():
        w1 = ranks[1]["model"][name]
        assert torch.equal(w0, w1), f"{name} differs between rank 0 and rank 1 after training"
    for r, state in enumerate(ranks):
        losses = state["losses"]
        assert len(losses) == epochs, losses
        assert losses[-1] < 0.5 * losses[0], f"rank {r}: the loss did not fall: {losses}"
