"""The benchmark's cost-model figure (costmodel.png): beside this machine's measured points and
fit, lesson 12's crossover for real model sizes, drawn by the lesson tree's own crossover.py
(``benchmarks.costmodel.crossover_from_lesson``); a stub leaves one line in its place."""

from __future__ import annotations

import math

import pytest

from benchmarks.analysis import judge
from tests.lessons import load
from tests.references import put

LESSON = "12_step_cost"
MARK = 777_777  # tokens no real calculation gives: proves where the figure's data comes from


def _result():
    """A run's result with a cost model (the measured panel is tested in test_benchmarks)."""
    cm = {"alpha_s": 1e-4, "bandwidth_Bps": 1e9, "compute_s": 60e-3, "grad_bytes": 116e3,
          "fit_nprocs": 2, "compute_from": "ddp_spawn", "projections": {}}
    return {"machine": {"label": "test"}, "config": {"rounds": 3}, "records": [],
            "verdict": judge([]), "cost_model": cm}


@pytest.fixture
def crossover(monkeypatch):
    """The target tree's crossover.py with the reference 12.8-12.10 in place, the course's
    models given (counting their FLOPs is the lesson's CLI's job, seconds long) and every
    call of its plot recorded."""
    import matplotlib

    matplotlib.use("Agg")
    put(LESSON, ["12.8", "12.9", "12.10"], monkeypatch.setattr)
    co = load(LESSON, "crossover")
    monkeypatch.setattr(co, "course_models", lambda: [co.ModelSize("MLP", 101_770, 1, None,
                                                                   "test")])
    drawn = []
    plot = co.plot_crossover

    def spy(rows, *args, **kwargs):
        drawn.append(rows)
        return plot(rows, *args, **kwargs)

    monkeypatch.setattr(co, "plot_crossover", spy)
    return co, drawn


def test_the_cost_model_figure_draws_the_lessons_crossover_for_125m_and_8b(monkeypatch,
                                                                          crossover):
    import matplotlib.pyplot as plt

    from benchmarks.run import cost_model_figure

    co, drawn = crossover
    hiding = co.hiding_tokens
    marked = {}

    def marking(strategy, setup, overlap_next_forward=False):
        marked[setup.params] = hiding(strategy, setup, overlap_next_forward)
        return MARK + int(setup.params % 1000)

    monkeypatch.setattr(co, "hiding_tokens", marking)
    result = _result()
    fig = cost_model_figure(result, result["cost_model"], [], {})
    assert len(fig.axes) == 3, "costmodel.png is not measured + split + hiding batch"
    plt.close(fig)
    assert len(drawn) == 1, "costmodel.png did not draw lesson 12's crossover"
    rows = drawn[0]
    models = {r["model"]: r["params"] for r in rows}
    for name, params in (("GPT 125M", 125e6), ("Llama-3.1-8B", 8.03e9), ("MLP", 101_770)):
        assert models.get(name) == params, f"{name} ({params:g} parameters) missing: {models}"
        assert params in marked, f"the crossover was not computed for {name}"
    assert all(r["hiding_tokens"] == MARK for r in rows if r["params"] % 1000 == 0), (
        "the figure's hiding batches are not the lesson's hiding_tokens")
    big = [r for r in rows if r["model"] == "Llama-3.1-8B" and r["link"] == "ethernet-10g"
           and r["strategy"] == "ddp"]
    assert big and big[0]["exposed_ms"] > big[0]["compute_ms"], (
        "8B on 10 Gb/s Ethernet at 4096 tokens per rank should be communication-bound")
    assert math.isfinite(marked[8.03e9]) and marked[8.03e9] > 4096


def test_a_stub_crossover_leaves_one_line_and_the_measured_part(monkeypatch, crossover):
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    from benchmarks.run import cost_model_figure

    co, drawn = crossover

    def stub(*args, **kwargs):
        raise NotImplementedError("Task 12.10: the stub's hint")

    monkeypatch.setattr(co, "step_split", stub)
    texts = []
    text = Figure.text

    def spy(self, x, y, s, *args, **kwargs):
        texts.append(s)
        return text(self, x, y, s, *args, **kwargs)

    monkeypatch.setattr(Figure, "text", spy)
    result = _result()
    fig = cost_model_figure(result, result["cost_model"], [], {})
    assert [ax.get_xlabel() for ax in fig.axes] == ["N (ranks)"], (
        "a stub's figure keeps the measured panel alone")
    plt.close(fig)
    assert not drawn, "a stub's crossover was drawn"
    notes = [t for t in texts if "Task 12.10" in t]
    assert len(notes) == 1 and "\n" not in notes[0] and "12.8-12.10" in notes[0], texts
