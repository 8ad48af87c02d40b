"""Lesson 13's measurement (given code, not graded): ``local_steps_sweep.py``.

One small launch of the sweep's rank function (3 ranks, H = 2 and 4, 8 steps: the size is
the test's, the full run's is the script's) with the references of 13.1-13.4 in place; the
bytes, syncs and agreement of the ranks are exact, the projection is checked against the ring
model by hand, and bad flags end in one line.
"""

from __future__ import annotations

import math

import pytest

from dpt.ranks import run_distributed
from tests.l13_local_sgd import rank_fns_sweep as rf
from tests.lessons import load

LESSON = "13_local_sgd"
TIMEOUT = 250
MLP_BYTES = 101_770 * 4  # dpt.models.MLP in fp32


@pytest.fixture(scope="module")
def rows():
    from tests.lessons import lesson_dir

    if not (lesson_dir(LESSON) / "local_steps_sweep.py").is_file():
        pytest.skip("local_steps_sweep.py is not in this lesson tree")
    return run_distributed(rf.sweep_rows, world_size=rf.N, timeout=TIMEOUT, echo=False)


@pytest.mark.timeout(TIMEOUT + 50)
def test_every_configuration_runs_on_the_same_samples_and_ends_with_the_ranks_agreeing(rows):
    runs = rows[0]
    assert [(r["method"], r["H"]) for r in runs] == (
        [("ddp", 1)] + [(m, h) for h in rf.HS for m in ("local_sgd", "diloco")])
    for r in runs:
        assert r["rank_spread"] == 0.0, (
            f"{r['method']} at H={r['H']}: the ranks' final weights differ by "
            f"{r['rank_spread']:.2e}: a run must end on a sync (--steps a multiple of H)")
        assert math.isfinite(r["eval_loss"]) and r["eval_loss"] > 0, r
    assert len({round(r["eval_loss"], 12) for r in runs}) == len(runs), (
        "two configurations gave the same eval loss: they did not train differently")


@pytest.mark.timeout(TIMEOUT + 50)
def test_bytes_and_syncs_fall_by_h_exactly(rows):
    for r in rows[0]:
        syncs = rf.STEPS // r["H"] if r["method"] != "ddp" else rf.STEPS
        assert (r["syncs"], r["bytes_per_rank"]) == (syncs, syncs * MLP_BYTES), (
            f"{r['method']} at H={r['H']}: {r['syncs']} syncs, {r['bytes_per_rank']:,} bytes "
            f"per rank in {rf.STEPS} steps; expected {syncs} and {syncs * MLP_BYTES:,} "
            "(one all-reduce of the fp32 model every H steps)")


@pytest.mark.timeout(TIMEOUT + 50)
def test_summary_table_and_figure(rows, tmp_path):
    sweep = load(LESSON, "local_steps_sweep")
    summary = sweep.summarize(rows[0] + [dict(r, seed=1, eval_loss=r["eval_loss"] + 0.01)
                                         for r in rows[0]])
    ddp = summary[0]
    assert ddp["seeds"] == 2 and ddp["lo"] < ddp["eval_loss"] < ddp["hi"]
    assert ddp["eval_loss"] == pytest.approx(rows[0][0]["eval_loss"] + 0.005)
    result = {"config": {"nproc": rf.N, "hs": list(rf.HS), "seeds": 2, "steps": rf.STEPS,
                         "per_rank": rf.PER_RANK, "samples": rf.STEPS * rf.N * rf.PER_RANK,
                         "eval_images": rf.N_EVAL},
              "summary": summary, "compute_s_per_step": 0.005, "compute_from": "test",
              "projection": sweep.projection(0.005, MLP_BYTES, rf.N, rf.HS)}
    text = sweep.format_table(result)
    assert "diloco" in text and "ethernet-1g" in text and "H=4" in text
    sweep.plot(result, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_projection_is_the_ring_model_every_h_steps():
    from benchmarks.costmodel import RingModel

    sweep = load(LESSON, "local_steps_sweep")
    # 1 Gb/s = 0.125 GB/s: 2 (3-1)/3 * 407,080 B / 0.125e9 B/s = 4.342 ms, plus 100 us alpha
    one = 100e-6 + 2 * 2 / 3 * MLP_BYTES / 0.125e9
    assert RingModel.preset("ethernet-1g").allreduce_s(3, MLP_BYTES) == pytest.approx(one)
    got = sweep.project_seconds(768, 8, 0.005, MLP_BYTES, 3, "ethernet-1g")
    assert got == pytest.approx(768 * 0.005 + 96 * one, rel=1e-12)
    assert sweep.project_seconds(10, 4, 0.0, MLP_BYTES, 3, "ethernet-1g") == pytest.approx(
        3 * one), "10 steps at H = 4 sync 3 times (after steps 4, 8 and a last one)"
    with pytest.raises(ValueError, match="unknown interconnect"):
        sweep.project_seconds(8, 2, 0.0, 1, 3, "ethernet-2g")


@pytest.mark.parametrize("argv, says", [
    (["--steps", "100", "--hs", "8,32"], "not a multiple of H = 8, 32"),
    (["--nproc", "1"], "--nproc must be at least 2"),
    (["--quick", "--seeds", "0"], "--seeds must be at least 1"),
])
def test_bad_flags_end_in_one_line(argv, says, capsys):
    sweep = load(LESSON, "local_steps_sweep")
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
