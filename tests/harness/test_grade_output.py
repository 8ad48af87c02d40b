"""What `make grade` prints: the score table first, one line per task not started (its stub's
hint, no traceback), tracebacks only for the tasks started, and every pytest "error" named.

The classification is plain Python (tests/scoring.py) and tested here directly; the order of the
report is tested on a small made-up lesson graded through the course's conftest, and on lesson
05 with its first five tasks solved (slow: its tests start ranks).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.lessons import REPO
from tests.scoring import (
    error_line,
    failure_kind,
    shorten_message,
    stub_in,
    task_line,
    task_order,
    task_progress,
    wrap_line,
)

# ------------------------------------------------------------------ classifying one failure

OWN = "E       NotImplementedError: Task 05.6: walk the parameters from last to first"
SOURCE = '>       raise NotImplementedError("Task 05.6: walk the parameters from last to first")'


def test_a_stub_is_read_from_the_raised_message_not_from_the_source_line():
    assert stub_in(SOURCE + "\n" + OWN) == ("05.6", "walk the parameters from last to first")
    assert stub_in(SOURCE + "\nE       AssertionError: the buckets differ") is None
    assert stub_in("") is None


def test_two_ranks_interleaving_their_last_lines_still_name_the_stub():
    text = "RuntimeError: rank 1 failed:\nNotImplementedErrorNotImplementedError: : Task 04.1: " \
           "wrap the model\n"
    assert stub_in(text) == ("04.1", "wrap the model")


@pytest.mark.parametrize("task, when, text, kind", [
    ("05.6", "call", OWN, "stub"),
    ("05.7", "call", OWN, "needs"),
    ("05.6", "setup", OWN, "stub"),  # a fixture that runs the task's code stops at its stub
    ("05.6", "setup", "E       RuntimeError: no data", "error"),
    ("05.6", "teardown", "E       RuntimeError: a rank is still running", "error"),
    ("05.6", "call", "E       AssertionError: the buckets differ", "failed"),
    # a notebook cell a test runs prints that it skipped for the task, and the test fails
    ("01.3", "call", "AssertionError: the reload cell did not finish: 'skipped: this cell needs "
                     "Task 01.3, which is not done yet.'", "stub"),
])
def test_each_failure_is_a_stub_another_tasks_stub_an_error_or_a_real_failure(
        task, when, text, kind):
    assert failure_kind(task, when, text)[0] == kind


def test_a_task_is_not_started_only_while_every_failure_stops_at_a_stub():
    own = failure_kind("05.7", "call", "NotImplementedError: Task 05.7: fill the buckets")
    other = failure_kind("05.7", "call", OWN)
    wrong = failure_kind("05.7", "call", "AssertionError: the gradients differ")
    broken = failure_kind("05.7", "setup", "RuntimeError: the fixture broke")
    assert task_progress("05.7", [own, own]) == ("not started", "fill the buckets")
    assert task_progress("05.7", [other, own]) == ("not started", "fill the buckets")
    cell = failure_kind("05.7", "call", "'skipped: this cell needs Task 05.7, which is not'")
    assert task_progress("05.7", [cell, own]) == ("not started", "fill the buckets")
    assert task_progress("05.7", [cell])[0] == "not started"
    state, detail = task_progress("05.7", [other, other])
    assert state == "waiting" and detail.startswith("Task 05.6: walk"), detail
    assert task_progress("05.7", [own, wrong])[0] == "started"  # one of its stubs is replaced
    assert task_progress("05.7", [broken])[0] == "started"


def test_the_lines_name_the_task_its_hint_and_the_error():
    line = task_line("05.2", "not started", "make every parameter equal to rank src's")
    assert line.split()[:3] == ["05.2", "not", "started:"] and line.endswith("rank src's")
    assert "Task 05.6" in task_line("05.7", "waiting", "Task 05.6: walk the parameters")
    err = error_line("tests/l04/test_x.py::test_y", "setup", "RuntimeError: rank 1 died")
    assert err == "error in setup of tests/l04/test_x.py::test_y: RuntimeError: rank 1 died"
    assert error_line("tests/l04/test_x.py", "collect", "").startswith("error collecting ")


# ------------------------------------------------------------------ the report, in order

FAKE_LESSON = '''
import pytest


def _stub(task, hint):
    raise NotImplementedError(f"Task {task}: {hint}")


@pytest.mark.task("05.1")
def test_done():
    pass


@pytest.mark.task("05.2")
@pytest.mark.parametrize("n", [1, 2, 3])
def test_not_started(n):
    _stub("05.2", "make every parameter equal to rank src's")


@pytest.mark.task("05.3")
def test_started():
    assert 1 + 1 == 3, "STARTED-BUT-WRONG"


@pytest.mark.task("05.4")
def test_waits_for_an_earlier_task():
    _stub("05.2", "make every parameter equal to rank src's")


@pytest.fixture
def broken():
    raise RuntimeError("FIXTURE-BROKE")


@pytest.mark.task("05.5")
def test_its_fixture_breaks(broken):
    pass


@pytest.fixture
def runs_the_students_code():
    _stub("05.6", "walk the parameters from last to first")


@pytest.mark.task("05.6")
def test_its_fixture_stops_at_the_stub(runs_the_students_code):
    pass
'''


def _grade_fake(tmp_path, *extra: str, source: str = FAKE_LESSON) -> list[str]:
    """Grade a made-up lesson through the course's conftest (as a plugin), in a subprocess,
    on an 80-column terminal."""
    tests = tmp_path / "l05_fake"
    tests.mkdir()
    (tests / "test_fake.py").write_text(textwrap.dedent(source))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    task(id): a task\n")
    (tmp_path / "tree").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(tmp_path / "pytest.ini"),
         "--rootdir", str(tmp_path), "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-p", "no:randomly", "-p", "no:xdist", "--target", str(tmp_path / "tree"), "--grade",
         *extra, str(tests)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.splitlines()


def _unwrapped(lines: list[str]) -> list[str]:
    """The report's lines with the wrapped ones joined again (a continuation is indented)."""
    out: list[str] = []
    for line in lines:
        if out and line.startswith("    ") and line.strip():
            out[-1] += " " + line.strip()
        else:
            out.append(line)
    return out


def _first(lines: list[str], needle: str) -> int:
    found = [i for i, line in enumerate(lines) if needle in line]
    assert found, f"{needle!r} is not in the report:\n" + "\n".join(lines)
    return found[0]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("whole_course", [False, True], ids=["one-lesson", "whole-course"])
def test_the_table_comes_first_then_a_line_per_task_then_the_started_failures(
        tmp_path, whole_course):
    # A second lesson's folder on the command line makes it a whole-course grade.
    extra = []
    if whole_course:
        (tmp_path / "l06_other").mkdir()
        (tmp_path / "l06_other" / "test_other.py").write_text("def test_given():\n    pass\n")
        extra = [str(tmp_path / "l06_other")]
    lines = _grade_fake(tmp_path, *extra)
    text = "\n".join(lines)
    table = _first(lines, "grade: ")
    assert table < _first(lines, "STARTED-BUT-WRONG"), text
    assert table < _first(lines, "FIXTURE-BROKE"), text
    for needle in ("FAILURES", "short test summary", "ERRORS"):
        assert needle not in text, f"pytest's own {needle} section is back:\n{text}"
    # One line per task not started, with its hint, and no traceback of its tests.
    todo = [line for line in lines if line.startswith(("05.2 ", "05.4 ", "05.6 "))]
    assert len(todo) == 3 and "not started: make every parameter" in todo[0], text
    assert "Task 05.2" in todo[1], text
    assert "not started: walk the parameters" in todo[2], text
    assert "_stub(" not in text and "test_not_started[" not in text, text
    # The error pytest counts is said in one line; a fixture stopping at a stub is no error.
    errors = [line for line in _unwrapped(lines) if line.startswith("error ")]
    assert len(errors) == 1 and "test_its_fixture_breaks: RuntimeError: FIXTURE-BROKE" in \
        errors[0], text
    assert "6 failed" in lines[-1] and "1 error" in lines[-1], lines[-1]
    if whole_course:  # the started task: one line, no traceback
        assert "assert 1 + 1 == 3" not in text, text
        assert "test_started: AssertionError: STARTED-BUT-WRONG" in text, text
    else:  # the started task's traceback, after the table
        assert table < _first(lines, "assert 1 + 1 == 3"), text


@pytest.mark.timeout(150)
def test_with_v_pytest_shows_every_traceback_after_the_table(tmp_path):
    lines = _grade_fake(tmp_path, "-v")
    text = "\n".join(lines)
    table = _first(lines, "grade: ")
    assert table < _first(lines, "FAILURES") < _first(lines, "_stub("), text


# ------------------------------------------------------------------ a half-done lesson 05


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_half_done_lesson_05_reads_in_under_60_lines(tmp_path):
    from tests.harness.test_notebooks_partial import build_tree, lesson_tasks

    lesson = "05_ddp_from_scratch"
    tasks = lesson_tasks(lesson)
    solved = set(tasks[:tasks.index("05.5") + 1])
    tree = build_tree(tmp_path, lesson, solved)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--target", str(tree), "--grade", "-m", "not slow",
         "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist",
         str(REPO / "tests" / "l05_ddp_from_scratch")],
        capture_output=True, text=True, timeout=840, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    text = "\n".join(lines)
    assert len(lines) < 60, f"{len(lines)} lines:\n{text}"
    table = _first(lines, "grade: ")
    assert not any(line.startswith("E ") for line in lines[:table]), text
    for task in sorted(solved):
        assert any(line.split()[1:2] == [task] and "pass" in line for line in lines), text
    for task in sorted(set(tasks) - solved):
        todo = [line for line in lines[table:] if line.startswith(task + " ")]
        assert len(todo) == 1, f"task {task}: {todo}\n{text}"
    assert "Traceback" not in text and "NotImplementedError" not in text, text


def test_tasks_sort_by_number_not_as_strings():
    """Lesson 09 has tasks 09.1-09.23: a string sort put 09.10 before 09.2 in the table."""
    assert sorted(["09.10", "09.2", "09.1", "08.3", "09.2a"], key=task_order) == \
        ["08.3", "09.1", "09.2", "09.2a", "09.10"]


# ------------------------------------------------------------------ long messages


def test_a_long_line_wraps_between_words_under_its_column():
    words = [f"w{i}" * (1 + i % 7) for i in range(120)]
    lines = wrap_line("09      09.13        2/7     FAIL  ", " ".join(words), 80)
    assert len(lines) > 1 and all(len(line) <= 80 for line in lines), lines
    assert all(line.startswith(" " * 35) and line[35] != " " for line in lines[1:]), lines
    assert " ".join(lines).split()[4:] == words, "a word was cut or lost"
    long_word = "x" * 120  # longer than the line: kept whole, never cut
    assert "      " + long_word in wrap_line("task  ", f"see {long_word} here", 80)


def test_only_a_huge_message_is_shortened_and_then_at_a_word_boundary():
    message = " ".join(f"word{i}" for i in range(100))  # 589 characters: kept whole
    assert shorten_message(message) == message
    huge = " ".join(f"word{i}" for i in range(1000))
    short = shorten_message(huge, limit=300)
    assert len(short) <= 300 and short.endswith("pytest -v shows it whole]"), short
    kept = short.split(" [...")[0].split()
    assert kept == huge.split()[:len(kept)], "the kept words differ from the message's"
    assert shorten_message("one\n  two\tthree") == "one two three"


LONG_MESSAGE = " ".join(f"clue{i:03d}" for i in range(60))  # 479 characters, the last clue059

LONG_LESSON = f'''
import pytest


@pytest.mark.task("09.13")
def test_long_message():
    assert False, "{LONG_MESSAGE}"
'''


@pytest.mark.timeout(150)
def test_the_table_wraps_a_long_message_whole_within_the_terminal(tmp_path):
    """Task 09.13's message (about 450 characters) was cut at 300, mid-word, in the table."""
    lines = _grade_fake(tmp_path, source=LONG_LESSON)
    text = "\n".join(lines)
    table = _first(lines, "grade: ")
    row = _first(lines, "09.13")
    end = _first(lines, "09      score")
    assert table < row < end, text
    rows = lines[row:end]
    assert all(len(line) <= 80 for line in rows), "\n".join(rows)
    assert all(line.startswith(" " * 8) for line in rows[1:]), "\n".join(rows)
    joined = " ".join(" ".join(rows).split())
    assert LONG_MESSAGE in joined, f"the message was cut in the table:\n{text}"
