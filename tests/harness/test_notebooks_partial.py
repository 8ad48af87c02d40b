"""A student with half a lesson done: each notebook runs to the end, and says what it skipped.

The tree under test is built here from solutions/: in each lesson only the first task is
solved, every other task is the stub that raises ``NotImplementedError("Task NN.K: ...")``.
Cells that reach an unsolved task must print ``skipped: this cell needs Task NN.K`` (the
notebooks wrap them in ``dpt.notebook.needs_tasks``), and every other cell must run.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.lessons import REPO

sys.path.insert(0, str(REPO / "tools"))
import make_exercises as gen  # noqa: E402

NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SKIP_LINE = re.compile(r"skipped: this cell needs (Task \d\d\.\d+[a-z]?)")


def _first_tasks() -> dict[str, str]:
    """The lowest task id of each lesson, e.g. {'06_mixed_precision': '06.1'}."""
    first = {}
    for py in (REPO / "solutions").glob("[0-9][0-9]_*/*.py"):
        tasks = gen.strip_solutions(py.read_text(), str(py))[1]
        for task in tasks:
            lesson = py.parent.name
            key = tuple(int(x) for x in re.findall(r"\d+", task))
            if lesson not in first or key < first[lesson][0]:
                first[lesson] = (key, task)
    return {lesson: task for lesson, (_, task) in first.items()}


def _keep_only(text: str, keep: str) -> str:
    """``text`` with every solution block stubbed except those of task ``keep``."""
    out, inside, keeping = [], False, False
    for line in text.splitlines(keepends=True):
        m = gen.BEGIN.match(line)
        if m:
            inside, keeping = True, m["task"] == keep
            if not keeping:
                hint = m["hint"].replace("\\", "\\\\").replace('"', '\\"')
                out.append(f'{m["indent"]}raise NotImplementedError("Task {m["task"]}: {hint}")\n')
            continue
        if gen.END.match(line):
            inside = keeping = False
            continue
        if not inside or keeping:
            out.append(line)
    return "".join(out)


@pytest.fixture(scope="module")
def half_done(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("half-done") / "tree"
    shutil.copytree(REPO / "solutions", tree, ignore=shutil.ignore_patterns("__pycache__"))
    first = _first_tasks()
    for py in tree.glob("[0-9][0-9]_*/*.py"):
        if py.name != gen.NOTEBOOK_SOURCE and py.parent.name in first:
            py.write_text(_keep_only(py.read_text(), first[py.parent.name]))
    return tree


def test_the_half_done_tree_has_one_task_solved_per_lesson(half_done):
    first = _first_tasks()
    assert first, "no tasks found"
    for lesson, task in first.items():
        text = "".join(p.read_text() for p in (half_done / lesson).glob("*.py"))
        stubs = set(re.findall(r'NotImplementedError\("(Task \d\d\.\d+[a-z]?)', text))
        assert f"Task {task}" not in stubs, f"{lesson}: its first task {task} is stubbed"


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_to_the_end_with_only_the_first_task_done(path, half_done, monkeypatch):
    monkeypatch.setenv("DPT_TARGET", str(half_done))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    lesson = path.stem
    first = _first_tasks().get(lesson)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            text = out.get("text", "") if out.get("output_type") == "stream" else ""
            for task in SKIP_LINE.findall(text):
                assert task != f"Task {first}", f"a cell skipped the solved task {task}"
                assert task[5:7] <= lesson[:2], f"{lesson} skipped a later lesson's {task}"


def test_needs_tasks_skips_a_pending_task_and_what_depends_on_it(monkeypatch, capsys):
    import dpt.notebook as nbk

    monkeypatch.setattr(nbk, "_SKIPPED", [])
    with nbk.needs_tasks():
        raise NotImplementedError("Task 05.3: register the hooks")
    with nbk.needs_tasks():  # a rank's traceback, as run_distributed or mp.spawn report it
        raise RuntimeError('rank 1 failed:\n...\nNotImplementedError: Task 05.4: buckets')
    with nbk.needs_tasks():  # two ranks' tracebacks interleaved in one log (seen under load)
        raise RuntimeError('the run ended before its first snapshot:\n  raise Not'
                           'ImplementedError("Task 04.1: read")\nNotImplementedErrorNotImpl'
                           'ementedError: : Task 04.1: read the variablesTask 04.1: read the')
    with nbk.needs_tasks():
        undefined_name  # noqa: B018, F821 - what a skipped cell would have defined
    lines = capsys.readouterr().out.strip().splitlines()
    assert [SKIP_LINE.search(ln).group(1) for ln in lines] == ["Task 05.3", "Task 05.4",
                                                             "Task 04.1", "Task 05.3"]
    # A message that only mentions a task, with no stub's NotImplementedError, is a real error.
    with pytest.raises(RuntimeError), nbk.needs_tasks():
        raise RuntimeError("Task 05.3: the loss is nan after 3 steps")
    with pytest.raises(ValueError), nbk.needs_tasks():
        raise ValueError("a real bug is not hidden")


def test_before_any_skip_a_name_error_is_a_real_error(monkeypatch):
    import dpt.notebook as nbk

    monkeypatch.setattr(nbk, "_SKIPPED", [])
    with pytest.raises(NameError), nbk.needs_tasks():
        undefined_name  # noqa: B018, F821


def test_scripts_started_from_a_notebook_do_not_inherit_a_launch(monkeypatch):
    # After a ddp_notebook cell the kernel holds these; a script inheriting LOCAL_RANK waits
    # for ranks that nobody starts (notebook 07's Fabric run hung that way).
    from dpt.notebook import script_env

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "12345")
    env = script_env(OMP_NUM_THREADS="1")
    assert "LOCAL_RANK" not in env and "MASTER_PORT" not in env
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == __import__("os").environ["PATH"]
