"""Lesson 13's optional path (given code, not graded): ``torchft_job.py`` with torchft.

Slow (a minute and more on 2 cores) and skipped where torchft does not import (it ships
wheels for Linux x86_64 only: ``pip install torchft``, in the ``dev`` extra there).
"""

from __future__ import annotations

import pytest

from tests.lessons import load

LESSON = "13_local_sgd"
STEPS, KILL = 300, 30


@pytest.mark.slow
@pytest.mark.tools  # 25 s: run by `make check-tools`, not by `make test`
@pytest.mark.timeout(400)
def test_survivors_go_on_and_the_replacement_heals_to_bitwise_equal_weights():
    pytest.importorskip("torchft", reason="torchft is not installed (Linux x86_64 wheels only)")
    job = load(LESSON, "torchft_job")
    result = job.run_job(steps=STEPS, kill=KILL, pace=0.03, timeout=300)
    reps = result["replicas"]
    assert sorted(reps) == ["0", "1", "2"] and result["death"]["step"] == KILL
    for idx in ("0", "1"):
        steps = [s for s, _ in reps[idx]["log"]]
        assert steps == list(range(steps[0], STEPS + 1)), (
            f"survivor {idx} skipped or repeated steps: torchft goes on with the live replicas")
        assert reps[idx]["participants"].get("2", 0) > 0, (
            f"survivor {idx} never stepped with 2 participants: the quorum did not shrink")
    joiner = reps["2"]
    assert joiner["first_step"] > KILL, (
        f"the replacement started at step {joiner['first_step']}: it should have been healed "
        "to the survivors' step (and state) before its first step")
    assert len({(r["weights_sum"], tuple(r["weights_head"])) for r in reps.values()}) == 1, (
        "final weights differ between replicas: healing must bring weights and optimizer state")
