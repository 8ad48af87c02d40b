"""The generator of exercises/ and notebooks/, and the drift between them and solutions/."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.lessons import REPO

sys.path.insert(0, str(REPO / "tools"))
import make_exercises as gen  # noqa: E402

SOLUTION = '''def f(x):
    y = 1
    # BEGIN SOLUTION 09.1: double "x"
    return 2 * x
    # END SOLUTION
'''


def test_a_block_becomes_a_raise_at_its_indentation():
    text, tasks = gen.strip_solutions(SOLUTION)
    assert tasks == ["09.1"]
    assert '    raise NotImplementedError("Task 09.1: double \\"x\\"")\n' in text
    assert "2 * x" not in text and "y = 1" in text
    namespace = {}
    exec(text, namespace)
    with pytest.raises(NotImplementedError, match='Task 09.1: double "x"'):
        namespace["f"](1)


@pytest.mark.parametrize("bad", [
    "# BEGIN SOLUTION 09.1: a\nx = 1\n",                  # never closed
    "x = 1\n# END SOLUTION\n",                             # END without BEGIN
    "# BEGIN SOLUTION 09.1: a\n# BEGIN SOLUTION 09.2: b\n# END SOLUTION\n",
    "# BEGIN SOLUTION: no task id\n# END SOLUTION\n",      # malformed
])
def test_broken_markers_are_refused(bad):
    with pytest.raises(gen.MarkerError):
        gen.strip_solutions(bad)


def test_committed_exercises_and_notebooks_are_up_to_date():
    stale = gen.stale(REPO)
    assert not stale, ("exercises/ or notebooks/ are stale; run `make exercises` and commit:\n"
                       + "\n".join(stale))


def test_the_trees_are_parallel_and_module_names_unique():
    sol, ex = REPO / "solutions", REPO / "exercises"
    lessons = sorted(p.name for p in sol.iterdir() if p.is_dir())
    assert lessons and lessons == sorted(p.name for p in ex.iterdir() if p.is_dir())
    seen = {}
    for lesson in lessons:
        assert re.fullmatch(r"\d\d_[a-z0-9_]+", lesson), lesson
        for py in (sol / lesson).glob("*.py"):
            if py.name == gen.NOTEBOOK_SOURCE:
                continue
            assert py.stem not in seen, f"{py.stem}.py is in {seen.get(py.stem)} and {lesson}"
            seen[py.stem] = lesson


def test_every_task_has_tests_and_every_test_task_exists():
    tasks = set()
    for py in (REPO / "solutions").rglob("*.py"):
        tasks |= set(gen.strip_solutions(py.read_text(), str(py))[1])
    marked = set()
    for py in (REPO / "tests").rglob("test_*.py"):
        marked |= set(re.findall(r"mark\.task\(\"(\d\d\.\d+[a-z]?)\"\)", py.read_text()))
    assert tasks - marked == set(), f"tasks with no test: {sorted(tasks - marked)}"
    assert marked - tasks == set(), f"tests for tasks that do not exist: {sorted(marked - tasks)}"


# What a student reads after `make grade` on a fresh tree: one line per failing test and the
# score table. The untouched exercises, where every graded test fails, print the most.
GRADE_LINES = 300


def _grade_exercises(tmp_path, env=None):
    out = tmp_path / "grade.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--target", str(REPO / "exercises"), "--grade",
         "--grade-json", str(out), "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-m", "not slow", "--timeout", "120", str(REPO / "tests")],
        capture_output=True, text=True, timeout=1200, cwd=REPO,
        env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_stubs_fail_each_with_their_own_task_message(tmp_path):
    """`make grade` on the untouched exercises: every task fails, naming itself, and the
    whole report stays short enough to read (one line per failing test, then the table)."""
    result, stdout = _grade_exercises(tmp_path)
    scores = result["tasks"]
    assert scores, "no task was graded"
    for task, s in scores.items():
        assert s["state"] == "fail", f"task {task} is {s['state']} on its stub: {s}"
        assert f"Task {task}" in s["first_error"], f"task {task} failed with: {s['first_error']}"
    lines = stdout.splitlines()
    assert len(lines) < GRADE_LINES, (
        f"grading the untouched exercises printed {len(lines)} lines (at most {GRADE_LINES}): "
        "a student scrolls through all of it; first lines:\n" + "\n".join(lines[:40]))


@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_without_data_the_stubs_still_score_nothing_and_the_grade_says_it_is_incomplete(
        tmp_path):
    """Data missing: skipped tests count neither way, no stub scores, and the grade says why."""
    empty = tmp_path / "no-data"
    empty.mkdir()
    result, stdout = _grade_exercises(tmp_path, env={
        "DPT_DATA": str(empty), "DPT_DEBIAN_DIR": str(empty), "DPT_OFFLINE": "1"})
    scores = result["tasks"]
    assert scores, "no task was graded"
    for task, s in scores.items():
        assert s["state"] != "pass", f"task {task} passes on its stub without data: {s}"
        assert s["passed"] == 0, f"task {task}: {s['passed']} test(s) pass on the stub: {s}"
    skipped = sum(s["skipped"] for s in scores.values())
    assert skipped > 0, "no test needed the data: this test no longer checks anything"
    assert result["complete"] is False
    assert "score incomplete" in stdout and "make data" in stdout, stdout[-2000:]


def test_lesson_paths_point_at_the_students_tree():
    text = "python solutions/06_mixed_precision/amp_train.py; see ../solutions/x and my_solutions/01_a"
    assert gen.to_exercises_paths(text) == (
        "python exercises/06_mixed_precision/amp_train.py; see ../solutions/x and my_solutions/01_a")


def test_no_command_in_the_students_tree_runs_the_solutions():
    """Commands in exercises/ and notebooks/ run the student's code, never solutions/."""
    pointing = re.compile(r"(?<![\w.-])solutions/[\w.*{]")
    hits = []
    for tree in (REPO / "exercises", REPO / "notebooks"):
        for path in sorted(tree.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for lineno, line in enumerate(text.splitlines(), 1):
                if pointing.search(line):
                    hits.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()[:100]}")
    assert not hits, ("the student's tree points at solutions/ (it would run the reference "
                      "answers, not the student's code):\n" + "\n".join(hits[:20]))


# ------------------------------------------------------------- lessons as diffs (01 -> 03 -> 04)

# The most lines of code one lesson may change in the previous lesson's main file: "about 80",
# what a reader takes in as one step (PyTorch's DDP tutorial series grows by 40 and 59 lines).
# gen.code_lines_changed counts lines added plus lines removed, and leaves out blank lines,
# comment-only lines (solution markers included) and docstrings: prose may grow freely.
CHANGE_BUDGET = 85


def test_code_lines_changed_counts_code_only():
    before = 'def f(x):\n    """Double x."""\n    return 2 * x\n'
    after = ('def f(x):\n    """Double x, then add one.\n\n    More words.\n    """\n'
             '    # a comment\n\n    y = 2 * x\n    return y + 1\n')
    assert gen.code_lines_changed(before, before) == 0
    assert gen.code_lines_changed(before, after) == 3  # -return 2 * x, +y = 2 * x, +return y + 1


@pytest.mark.parametrize("before, after", list(zip(gen.GROWTH, gen.GROWTH[1:])),
                         ids=lambda p: p[0][:2])
def test_each_lesson_grows_the_previous_ones_main_file_within_the_budget(before, after):
    sol = REPO / "solutions"
    a, b = (sol / lesson / name for lesson, name in (before, after))
    changed = gen.code_lines_changed(a.read_text(), b.read_text())
    assert changed <= CHANGE_BUDGET, (
        f"{b.relative_to(sol)} changes {changed} lines of code of {a.relative_to(sol)} "
        f"(budget {CHANGE_BUDGET}): move plumbing into dpt/, or keep the shapes the same")
    assert (b.parent / gen.CHANGES).read_text() == gen.changes_diff(a, b), (
        "CHANGES.diff is stale: run `make exercises`")
