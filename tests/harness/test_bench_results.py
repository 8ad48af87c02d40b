"""The lesson notebooks show the lesson benchmarks' results: yours once you have run the
script, the committed reference until then (``dpt.notebook.bench_result``)."""

from __future__ import annotations

import importlib
import re

import pytest

import dpt.notebook as nb
from tests.lessons import REPO

TUTORIALS = sorted((REPO / "solutions").glob("[0-9][0-9]_*/tutorial.py"))
# The result files a tutorial names: "l06_precision.json", "l08_memory.png", ...
ASKED = re.compile(r"""["'](l\d\d_\w+\.(?:json|png))["']""")


def _asked_for() -> dict[str, list[str]]:
    """Each result file a tutorial names, with the tutorials naming it."""
    names: dict[str, list[str]] = {}
    for tutorial in TUTORIALS:
        for name in ASKED.findall(tutorial.read_text()):
            names.setdefault(name, []).append(tutorial.parent.name)
    return names


def test_the_notebooks_find_every_result_they_show_in_the_committed_reference():
    names = _asked_for()
    assert len(names) >= 6, f"the tutorials name fewer results than they show: {names}"
    missing = {n: who for n, who in names.items() if not (nb.BENCH_REFERENCE / n).is_file()}
    assert not missing, f"not committed in {nb.BENCH_REFERENCE}: {missing}"


def test_no_notebook_reads_results_from_anywhere_else():
    """A path built by hand goes stale when the results move, as benchmarks/results/ did: the
    notebook then says "run the script" forever, even after you have."""
    stale = [t.parent.name for t in TUTORIALS
             if re.search(r'benchmarks/(results|runs|reference)\b|"benchmarks"\s*/\s*"(results|runs)"',
                          t.read_text())
             and not t.parent.name.endswith("_benchmarks")]
    assert not stale, f"read lesson results with dpt.notebook.bench_result: {stale}"


@pytest.mark.parametrize("script", sorted(p.stem for p in (REPO / "benchmarks").glob("bench_l*.py")))
def test_each_lesson_benchmark_writes_where_the_notebooks_look(script):
    module = importlib.import_module(f"benchmarks.{script}")
    assert module.OUT.resolve() == nb.BENCH_RUNS.resolve(), (
        f"{script} writes to {module.OUT}; the notebooks look in {nb.BENCH_RUNS}")


def test_yours_once_you_have_run_it_the_reference_until_then(tmp_path, monkeypatch, capsys):
    runs, reference = tmp_path / "runs", tmp_path / "reference"
    runs.mkdir()
    reference.mkdir()
    monkeypatch.setattr(nb, "BENCH_RUNS", runs)
    monkeypatch.setattr(nb, "BENCH_REFERENCE", reference)
    monkeypatch.delenv("DPT_BENCH_SHOW", raising=False)
    (reference / "l06_precision.json").write_text("{}")

    assert nb.bench_result("l06_precision.json") == reference / "l06_precision.json"
    said = capsys.readouterr().out
    assert "committed reference" in said and "benchmarks/bench_l06_precision.py" in said

    (runs / "l06_precision.json").write_text("{}")
    assert nb.bench_result("l06_precision.json") == runs / "l06_precision.json"
    assert "your run" in capsys.readouterr().out

    monkeypatch.setenv("DPT_BENCH_SHOW", "reference")  # the website shows the reference
    assert nb.bench_result("l06_precision.json") == reference / "l06_precision.json"

    with pytest.raises(FileNotFoundError, match="neither"):
        nb.bench_result("l99_nothing.json")
