"""Lesson 13's steps-lost benchmark (``benchmarks/bench_l13_fault.py``): the real torchrun
restart of lesson 04 on the supervisor's job, scored by the lesson's ``steps_lost``.

Slow (two torchrun starts of 3 processes: about 20 s on 2 cores): run by `make check-tools`.
"""

from __future__ import annotations

import pytest
import torch

from tests.lessons import load

LESSON = "13_local_sgd"
JOB = {"replicas": 3, "steps": 12, "kill": (2, 7), "snapshot_every": 5, "step_s": 0.0}


@pytest.mark.slow
@pytest.mark.tools
@pytest.mark.timeout(300)
def test_torchrun_loses_what_the_imitated_restart_loses_and_ends_on_its_weights():
    import benchmarks.bench_l13_fault as bench

    ft = load(LESSON, "fault_tolerance")
    sv = load(LESSON, "supervisor")
    real = bench.run_torchrun(timeout=240, **JOB)
    imitated = sv.supervise(policy="restart", timeout=120, **JOB)
    lost_real = ft.steps_lost(real["events"], 3)
    lost_imitated = ft.steps_lost(imitated["events"], 3)
    # replica 2 dies at the start of step 7; the snapshot is of step 5: every replica redoes
    # step 6 (3 rolled back) and each survivor threw its step 7 away (2 discarded)
    assert (lost_real["discarded"], lost_real["rolled_back"]) == (2, 3), lost_real
    assert (lost_imitated["discarded"], lost_imitated["rolled_back"]) == (2, 3), lost_imitated
    restores = [e for e in real["events"] if e["event"] == "restore"]
    assert sorted(e["replica"] for e in restores) == [0, 1, 2] and {e["step"] for e in restores} == {5}
    # torchrun's restart is a new start of every process: it idles longer than the imitation
    assert lost_real["idle_replica_s"] > lost_imitated["idle_replica_s"]
    finals = list(real["final"].values()) + list(imitated["final"].values())
    for f in finals[1:]:
        for a, b in zip(finals[0]["model"].values(), f["model"].values(), strict=True):
            assert torch.equal(a, b), "torchrun and the imitated restart must end on the same weights"


def test_the_benchmark_table_shows_each_way_with_its_interval():
    import benchmarks.bench_l13_fault as bench

    def stat(m, lo=None, hi=None):
        return {"mean": m, "lo": lo, "hi": hi}

    result = {"summary": {"ft": {"replica_steps": stat(2.0, 2.0, 2.0),
                                 "idle_replica_s": stat(0.14, 0.09, 0.19),
                                 "seconds": stat(1.1)}}}
    text = bench.table(result)
    assert "| ft | 2.0 [2.0, 2.0] | 0.14 [0.09, 0.19] | 1.1 |" in text
