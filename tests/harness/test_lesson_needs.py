"""Lessons that run an earlier lesson's code say so: README, notebook and grade.

Lesson 09's memory table calls lesson 08's ``predict_bytes``; lesson 10 traces lesson 05's DDPs
and lesson 09's FSDP. Which tasks each lesson runs is read from the code once
(tests/dependencies.py); each README's "**Needs**" paragraph, each notebook block's
``needs_tasks(..., earlier=...)`` and the grade's ``needs`` line must agree with it. Where such a
task is not done, the notebook shows the course's reference result, saying so in one line.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import nbformat
import pytest

import dpt.notebook as nbk
from tests import dependencies as deps
from tests.harness.test_notebooks_partial import code_cells, needs_calls
from tests.lessons import REPO

LESSONS = [p.name for p in deps.lesson_folders(REPO / "solutions")]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


# ------------------------------------------------------------------ reading the code


def _lesson(root, name, files):
    folder = root / name
    folder.mkdir(parents=True)
    for file, text in files.items():
        (folder / file).write_text(textwrap.dedent(text))


def test_the_tasks_an_import_runs_follow_its_definitions(tmp_path):
    """A made-up course: lesson 02 imports one class of lesson 01. Its tasks, its base
    class's (in another module of lesson 01) and those of a helper it calls count; a task of
    a function nobody imports does not. Stubs (exercises/) count as solution blocks do."""
    _lesson(tmp_path, "01_first", {
        "base.py": '''
            class Base:
                def sync(self):
                    # BEGIN SOLUTION 01.1: average
                    pass
                    # END SOLUTION
            ''',
        "child.py": '''
            from base import Base

            def helper():
                raise NotImplementedError("Task 01.3: the helper")

            def unused():
                # BEGIN SOLUTION 01.4: not imported by anyone
                pass
                # END SOLUTION

            class Child(Base):
                def step(self):
                    helper()
                    # BEGIN SOLUTION 01.2: a step
                    pass
                    # END SOLUTION
            ''',
        "given.py": "def plain():\n    return 1\n"})
    _lesson(tmp_path, "02_second", {
        "uses.py": "import sys\nfrom child import Child\nfrom given import plain\n",
        "child2.py": "def f():\n    from base import Base  # inside a function too\n"})
    _lesson(tmp_path, "03_third", {"own.py": "from own2 import x\n", "own2.py": "x = 1\n"})
    deps.needs.cache_clear()
    deps.lesson_tasks.cache_clear()
    try:
        found = deps.needed_tasks("02_second", tmp_path)
        assert found == {"01_first": ("01.1", "01.2", "01.3")}, found
        assert deps.needed_tasks("01_first", tmp_path) == {}
        assert deps.needed_tasks("03_third", tmp_path) == {}, "a lesson's own modules are not needs"
        files = {(n.file, n.module) for n in deps.needs(tmp_path)["02_second"]}
        assert files == {("uses.py", "child"), ("uses.py", "given"), ("child2.py", "base")}
        target = tmp_path  # the same tree, graded: 01.3 is still a stub there
        line = deps.lesson_needs("02", target, tmp_path)
        assert "lesson 01's 01.1-01.3" in line and "not done in this tree: 01.3" in line, line
        assert deps.lesson_needs("01", target, tmp_path) is None
    finally:
        deps.needs.cache_clear()
        deps.lesson_tasks.cache_clear()


def test_solutions_and_exercises_give_the_same_dependencies():
    """The grade reads solutions/ where the course has it, else exercises/: the same list."""
    for lesson in LESSONS:
        assert deps.needed_tasks(lesson, REPO / "solutions") == deps.needed_tasks(
            lesson, REPO / "exercises"), lesson


def test_the_course_has_the_dependencies_the_issue_found():
    # memory_table.predict_peak calls predict_bytes (08.1); traces.py builds lesson 05's DDPs
    assert "08.1" in deps.needed_tasks("09_fsdp").get("08_sharding", ())
    ten = deps.needed_tasks("10_inside_a_step")
    assert {"05.3", "05.4", "05.6"} <= set(ten.get("05_ddp_from_scratch", ())), ten


# ------------------------------------------------------------------ READMEs


@pytest.mark.parametrize("lesson", LESSONS)
def test_each_readme_names_the_earlier_tasks_its_lesson_runs(lesson):
    text = (REPO / "solutions" / lesson / "README.md").read_text()
    wanted = {t for tasks in deps.needed_tasks(lesson).values() for t in tasks}
    said = deps.readme_needs(text)
    if not wanted:
        assert said is None, f"{lesson}'s README has a Needs paragraph, but runs no other " \
                             "lesson's code"
        return
    assert said is not None, (
        f"{lesson} runs the tasks {deps.needed_tasks(lesson)} of earlier lessons; its README "
        "says so in a paragraph starting with **Needs**")
    named = {t for t in deps.expand(said) if t[:2] != lesson[:2]}
    assert named == wanted, (f"{lesson}'s README Needs names {sorted(named, key=deps.task_key)},"
                             f" its code runs {sorted(wanted, key=deps.task_key)}")
    assert "stand alone" not in text, f"{lesson}'s README still says its parts stand alone"


# ------------------------------------------------------------------ notebooks: what they declare


def _earlier_of(source: str) -> list[tuple[int, tuple[str, ...], str | None]]:
    """Each needs_tasks call's earlier= and reference= literals: (line, tasks, reference)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "needs_tasks":
            kw = {k.arg: k.value for k in node.keywords}
            if "earlier" in kw:
                out.append((node.lineno, tuple(ast.literal_eval(kw["earlier"])),
                            ast.literal_eval(kw["reference"]) if "reference" in kw else None))
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_blocks_name_earlier_tasks_their_lesson_runs_with_a_reference(path):
    wanted = {t for tasks in deps.needed_tasks(path.stem).values() for t in tasks}
    declared = []
    for i, source in enumerate(code_cells(path)):
        assert all(named is not None for _, named in needs_calls(source))
        for line, earlier, reference in _earlier_of(source):
            where = f"{path.name}, code cell {i}, line {line}"
            declared.append(earlier)
            extra = set(earlier) - wanted
            assert not extra, f"{where}: earlier= names {sorted(extra)}, which {path.stem} " \
                              "does not run"
            assert reference and (nbk.BENCH_REFERENCE / reference).is_file(), (
                f"{where}: a block that runs an earlier lesson's task shows a committed "
                f"reference in its place; {reference!r} is not in {nbk.BENCH_REFERENCE}")
    if wanted:
        assert declared, f"{path.stem} runs {sorted(wanted)} of earlier lessons; no block says so"


# ------------------------------------------------------------------ needs_tasks' fallback


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    monkeypatch.setattr(nbk, "_SKIPPED", [])
    monkeypatch.setattr(nbk, "BLOCKS", [])
    monkeypatch.setattr(nbk, "BENCH_REFERENCE", tmp_path)
    return tmp_path


def test_an_earlier_lessons_task_not_done_shows_the_reference_in_one_line(fresh_kernel, capsys):
    (fresh_kernel / "l09_table.json").write_text(json.dumps({"rows": [1, 2]}))
    ran = []
    with nbk.needs_tasks("09.13", earlier=("08.1",), reference="l09_table.json"):
        ran.append("before")
        raise NotImplementedError("Task 08.1: each stage divides one more")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("Task 08.1 is not done in your tree: showing the course's reference run "
                        f"({nbk._shown(fresh_kernel / 'l09_table.json')})"), lines
    assert json.loads("\n".join(lines[1:])) == {"rows": [1, 2]}
    block = nbk.BLOCKS[-1]
    assert block["skipped"] is None and block["reference"].endswith("l09_table.json"), block
    assert block["earlier"] == ["Task 08.1"]
    # a later block that uses what this one would have made is skipped, naming the task
    with nbk.needs_tasks("09.13"):
        undefined_name  # noqa: B018, F821
    assert "skipped: this cell needs Task 08.1" in capsys.readouterr().out


def test_the_block_shows_an_image_or_calls_its_own_show(fresh_kernel, capsys, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    (fresh_kernel / "l10_timeline.png").write_bytes(
        (REPO / "benchmarks" / "reference" / "lessons" / "l10_timeline.png").read_bytes())
    with nbk.needs_tasks("10.1", earlier=("05.3",), reference="l10_timeline.png"):
        raise RuntimeError("rank 1 failed:\nNotImplementedError: Task 05.3: sum")
    assert len(shown) == 1 and isinstance(shown[0], IPython.display.Image)
    (fresh_kernel / "t.txt").write_text("the table")
    seen = []
    with nbk.needs_tasks("09.13", earlier="08.1", reference="t.txt", show=seen.append):
        raise NotImplementedError("Task 08.1: x")
    assert seen == [fresh_kernel / "t.txt"]
    assert capsys.readouterr().out.count("is not done in your tree") == 2


def test_own_tasks_and_undeclared_earlier_ones_are_skipped_as_before(fresh_kernel, capsys):
    (fresh_kernel / "r.txt").write_text("REFERENCE")
    with nbk.needs_tasks("09.13", earlier=("08.1",), reference="r.txt"):
        raise NotImplementedError("Task 09.13: the peak")  # the lesson's own task
    with nbk.needs_tasks("09.13", earlier=("08.1",), reference="r.txt"):
        raise NotImplementedError("Task 08.2: not named in earlier")
    with nbk.needs_tasks("09.13", earlier=("08.1",)):  # no reference to show
        raise NotImplementedError("Task 08.1: x")
    out = capsys.readouterr().out
    assert "REFERENCE" not in out
    assert [b["skipped"] for b in nbk.BLOCKS] == ["Task 09.13", "Task 08.2", "Task 08.1"]
    with pytest.raises(ValueError, match="earlier="):
        with nbk.needs_tasks("09.13", reference="r.txt"):
            pass
    with pytest.raises(ValueError, match="needs_tasks"):
        with nbk.needs_tasks("09.13", earlier=("8.1",)):
            pass
    (fresh_kernel / "r.txt").unlink()
    with pytest.raises(FileNotFoundError, match="r.txt"):
        with nbk.needs_tasks("09.13", earlier=("08.1",), reference="r.txt"):
            raise NotImplementedError("Task 08.1: x")


# ------------------------------------------------------------------ the grade names them


FAKE = '''
import pytest


@pytest.mark.task("{lesson}.1")
def test_done():
    pass
'''


@pytest.mark.timeout(150)
@pytest.mark.parametrize("lesson, needs", [("10", True), ("05", False)])
def test_the_grade_names_the_earlier_tasks_a_lesson_runs(tmp_path, lesson, needs):
    tests = tmp_path / f"l{lesson}_fake"
    tests.mkdir()
    (tests / "test_fake.py").write_text(FAKE.format(lesson=lesson))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    task(id): a task\n")
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "solutions" / "05_ddp_from_scratch", tree / "05_ddp_from_scratch")
    stubbed = tree / "05_ddp_from_scratch" / "naive_ddp.py"
    stubbed.write_text((REPO / "exercises" / "05_ddp_from_scratch" / "naive_ddp.py").read_text())
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(tmp_path / "pytest.ini"),
         "--rootdir", str(tmp_path), "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-p", "no:randomly", "-p", "no:xdist", "--target", str(tree), "--grade", str(tests)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "COLUMNS": "100"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    found = re.search(rf"^{lesson}\s+needs\s+(.*?)(?=^\S|\Z)", text, re.M | re.S)
    if not needs:
        assert found is None, text
        return
    assert found, f"no needs line under lesson {lesson}:\n{text}"
    said = " ".join(found.group(1).split())
    assert "lesson 05's 05.2-05.9" in said and "lesson 09's" in said and "traces.py" in said, said
    # naive_ddp.py holds 05.3 alone; the other lesson 05 files and lesson 09 are absent (no stub)
    assert "not done in this tree: 05.3:" in said, said


# ------------------------------------------------------------------ notebooks 09 and 10, run


def untouched_earlier_tree(root, untouched=("05_ddp_from_scratch", "08_sharding")):
    """solutions/, but with ``untouched`` lessons as a student receives them (exercises/)."""
    tree = root / "tree"
    shutil.copytree(REPO / "solutions", tree, ignore=shutil.ignore_patterns("__pycache__"))
    for lesson in untouched:
        shutil.rmtree(tree / lesson)
        shutil.copytree(REPO / "exercises" / lesson, tree / lesson,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tree


# The cells run: the setup cell, what the blocks with earlier= read (lesson 10's traces), and
# those blocks. The rest of each notebook is run whole by test_notebooks.py.
KEEP = {"09_fsdp": ("use_lesson(",), "10_inside_a_step": ("use_lesson(", "tr.run_traces(")}


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("lesson", sorted(KEEP))
def test_with_lessons_05_and_08_untouched_the_notebook_shows_the_references(
        lesson, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    path = REPO / "notebooks" / f"{lesson}.ipynb"
    cells = [c for c in code_cells(path)
             if any(k in c for k in KEEP[lesson]) or _earlier_of(c)]
    assert sum(bool(_earlier_of(c)) for c in cells) >= 1
    monkeypatch.setenv("DPT_TARGET", str(untouched_earlier_tree(tmp_path)))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.v4.new_notebook()
    report = "import json as _j, dpt.notebook as _n\nprint('BLOCKS ' + _j.dumps(_n.BLOCKS))"
    nb.cells = [nbformat.v4.new_code_cell(c) for c in [*cells, report]]
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [cell.get("outputs", []) for cell in nb.cells]
    texts = ["".join(o.get("text", "") for o in outs if o.get("output_type") == "stream")
             for outs in outputs]
    blocks = json.loads(texts.pop().split("BLOCKS ", 1)[1])
    with_earlier = [b for b in blocks if b.get("earlier")]
    assert with_earlier and all(b["reference"] and not b["skipped"] for b in with_earlier), (
        f"every block that runs lesson 05's or 08's code shows its reference: {with_earlier}\n"
        + "\n".join(texts))
    for i, cell in enumerate(cells):
        if not _earlier_of(cell):
            continue
        line = re.search(r"^(Task \d\d\.\d+) is not done in your tree: showing the course's "
                         r"reference run \((benchmarks/reference/lessons/\S+)\)$", texts[i], re.M)
        assert line and line.group(1)[5:7] in ("05", "08"), texts[i]
        assert "skipped: this cell needs" not in texts[i], texts[i]
        if line.group(2).endswith(".png"):
            assert any("image/png" in o.get("data", {}) for o in outputs[i]), "no image shown"
        else:  # the reference rows, as the table the cell prints
            assert re.search(r"^(DDP|FSDP)", texts[i].split(line.group(0), 1)[1].strip(),
                             re.M), texts[i]
