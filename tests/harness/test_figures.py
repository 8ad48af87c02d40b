"""The lessons' diagrams: drawn by code, committed as SVG, shown in the READMEs and notebooks.

Each ``solutions/NN_*/figures/*.py`` with ``FIGURES`` owns SVGs next to itself
(``tools/draw_figures.py`` rewrites them). A committed SVG must be what its code draws now,
its lesson's README must show it, and the notebook must call the code that draws it.
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.lessons import REPO

sys.path.insert(0, str(REPO / "tools"))
import draw_figures  # noqa: E402

MODULES = draw_figures.modules()


def _svgs(module_path):
    """The SVG names a figure module declares, read from its source (no import needed)."""
    m = re.search(r"^FIGURES = \{(.*?)\}", module_path.read_text(), re.M | re.S)
    assert m, f"{module_path}: FIGURES must be a dict literal on one line"
    return re.findall(r'"([\w.-]+\.svg)"', m.group(1))


FIGURES = [(path, name) for path in MODULES for name in _svgs(path)]


def test_every_lesson_with_a_diagram_is_found():
    lessons = {path.parent.parent.name for path in MODULES}
    assert {"02_data_parallel", "03_ddp_spawn", "05_ddp_from_scratch"} <= lessons, lessons
    stems = [path.stem for path in MODULES]
    assert len(stems) == len(set(stems)), (
        f"two lessons' figures/ hold modules of the same name ({stems}): `from figures import "
        "x` would find either, since a process keeps each lesson folder it loaded on sys.path")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path, name", FIGURES, ids=[name for _, name in FIGURES])
def test_the_committed_svg_is_what_its_code_draws(path, name):
    import matplotlib

    svg = path.parent / name
    assert svg.is_file(), f"{svg} is missing: run `python tools/draw_figures.py`"
    committed = svg.read_bytes()
    drawn_by = draw_figures.drawn_by(committed)
    if drawn_by != matplotlib.__version__:
        pytest.skip(f"{name} was drawn by matplotlib {drawn_by}, this is "
                    f"{matplotlib.__version__}: SVG bytes differ between versions")
    fresh = draw_figures.svg_bytes(draw_figures.load(path).FIGURES[name])
    assert fresh == committed, (f"{svg.relative_to(REPO)} is not what {path.name} draws now: "
                                "run `python tools/draw_figures.py`, then `make exercises`")


def test_drawing_twice_gives_the_same_bytes():
    """What makes the drift test above possible: no date, no random ids in the SVG."""
    path = next(p for p in MODULES if p.stem == "ring_diagram")
    draw = draw_figures.load(path).FIGURES["ring_allreduce.svg"]
    first = draw_figures.svg_bytes(draw)
    assert first == draw_figures.svg_bytes(draw)
    assert b"<dc:date>" not in first


@pytest.mark.parametrize("path, name", FIGURES, ids=[name for _, name in FIGURES])
def test_the_lessons_readme_and_notebook_show_the_figure(path, name):
    lesson = path.parent.parent
    readme = (lesson / "README.md").read_text()
    assert f"](figures/{name})" in readme, (
        f"{lesson.name}/README.md does not show figures/{name} (a markdown image link)")
    notebook = (lesson / "tutorial.py").read_text()
    assert f"import {path.stem}" in notebook and f"{path.stem}.draw(" in notebook, (
        f"{lesson.name}'s notebook does not draw {name} with figures/{path.stem}.py")


def test_the_student_tree_has_the_same_figures():
    for path, name in FIGURES:
        rel = path.parent.relative_to(REPO / "solutions") / name
        copy = REPO / "exercises" / rel
        assert copy.is_file(), f"exercises/{rel} is missing: run `make exercises`"


# ------------------------------------------------------------------ what the diagrams claim

def _module(stem):
    return draw_figures.load(next(p for p in MODULES if p.stem == stem))


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_the_ring_diagram_is_a_correct_ring_all_reduce(n):
    steps = _module("ring_diagram").ring_steps(n)
    assert len(steps) == 1 + 2 * (n - 1)
    everyone = set(range(n))
    for step in steps[1:]:
        senders = [r for r, _ in step["sends"]]
        assert sorted(senders) == list(range(n)), "every rank sends exactly one chunk a step"
    after_rs = steps[n - 1]["have"]
    for r in range(n):
        full = [c for c in range(n) if after_rs[r][c] == everyone]
        assert full == [(r + 1) % n], (
            f"after reduce-scatter rank {r} should own the finished chunk {(r + 1) % n}, "
            f"owns {full}")
    assert all(chunk == everyone for row in steps[-1]["have"] for chunk in row)


def test_the_timeline_is_drawn_from_a_consistent_measurement():
    measured = json.loads((REPO / "solutions" / "05_ddp_from_scratch" / "figures" /
                           "backward_timeline.json").read_text())
    cfg = measured["config"]
    for rank in measured["ranks"]:
        naive, bucketed = rank["runs"]["naive"], rank["runs"]["bucketed"]
        for run in (naive, bucketed):
            names = [layer["name"] for layer in run["layers"]]
            assert names == ["out"] + [f"fc{i}" for i in range(cfg["depth"], 0, -1)], (
                f"backward finishes the layers last to first, got {names}")
            assert run["backward"][1] <= run["sync"][0] <= run["sync"][1] <= run["step"][0]
            for e in run["allreduce"]:
                assert e["launch"] <= e["done"] <= run["step"][1]
        assert len(naive["allreduce"]) == 2 * (cfg["depth"] + 1)  # a weight and a bias each
        assert all(not e["async"] and e["launch"] >= naive["sync"][0]
                   for e in naive["allreduce"])
        assert len(bucketed["allreduce"]) == len(bucketed["buckets"]) >= 2
        assert all(e["async"] for e in bucketed["allreduce"])
        assert bucketed["allreduce"][0]["launch"] < bucketed["backward"][1], (
            "the first bucket's all-reduce must start during backward")
