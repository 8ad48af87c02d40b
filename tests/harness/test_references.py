"""The tests' references (``tests/lNN_*/_references.py``) are the solutions' code, regenerated.

``make exercises`` writes them from ``solutions/`` (``tools/derive_references.py``); the lesson
tests put them in place of the tasks a test does not grade (``tests/references.py``). A solution
edited without ``make exercises``, or a generated file edited by hand, fails here, naming the
file and the task.
"""

from __future__ import annotations

import ast
import sys
import textwrap

import pytest

from tests import references as refs
from tests.lessons import REPO

sys.path.insert(0, str(REPO / "tools"))
import derive_references as dr  # noqa: E402

FIX = "run `make exercises` (or `tools/make_exercises.py --references-only`)"


def _definitions(text: str) -> dict[str, str]:
    """Each top-level function and each method of a top-level class, by dotted name, as code
    (``ast.dump``: comments and layout aside, which the check below compares separately)."""
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = ast.dump(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found[f"{node.name}.{item.name}"] = ast.dump(item)
    return found


def _tables(text: str) -> dict[str, object]:
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = ast.literal_eval(node.value)
    return found


def differences(committed: str, fresh: str) -> list[str]:
    """What differs between a committed references file and a fresh one, by task."""
    if committed == fresh:
        return []
    tasks = _tables(fresh).get("TASKS", {})
    task_of = {dotted: task for task, places in tasks.items() for _, dotted in places}
    try:
        mine, want = _definitions(committed), _definitions(fresh)
        tables = _tables(committed)
    except (SyntaxError, ValueError) as exc:
        return [f"it does not parse ({exc})"]
    out = [f"task {task_of.get(name, '?')}: {name} "
           + ("is missing" if name not in mine else "is not in solutions/" if name not in want
              else "differs from the solution")
           for name in sorted(set(mine) | set(want)) if mine.get(name) != want.get(name)]
    out += [f"its {name} table differs" for name in ("TASKS", "DECORATORS")
            if tables.get(name) != _tables(fresh).get(name)]
    if not out:  # the same code: a comment or the layout changed
        line = next(i for i, (a, b) in enumerate(
            zip(committed.splitlines() + [""], fresh.splitlines() + [""]), 1) if a != b)
        out.append(f"line {line} differs (a comment or the layout)")
    return out


def test_the_references_are_the_solutions_code():
    problems = []
    for path, fresh in dr.expected().items():
        rel = path.relative_to(REPO)
        if not path.is_file():
            problems.append(f"{rel} is missing")
            continue
        problems += [f"{rel}: {what}" for what in differences(path.read_text(), fresh)]
    assert not problems, ("the tests' references differ from solutions/ (a solution edited "
                          f"without regenerating, or a generated file edited by hand); {FIX}:\n"
                          + "\n".join(problems))


def test_the_tests_find_every_lesson_s_references():
    assert refs.PACKAGES == {lesson: tests.replace("/", ".")
                             for lesson, (tests, _) in dr.LESSONS.items()}


@pytest.mark.parametrize("lesson", sorted(dr.LESSONS))
def test_each_reference_goes_where_the_lesson_defines_it(lesson):
    """Every reference binds to the lesson module, and lands on an existing definition."""
    for task, places in refs.generated(lesson).TASKS.items():
        for stem, dotted in places:
            owner, attr = refs.owner(lesson, stem, dotted)
            assert callable(getattr(owner, attr, None)), f"{task}: {stem}.{dotted} not found"
            fn = refs.bound(lesson, stem, dotted)
            assert callable(fn) and fn.__module__ == stem, (task, dotted)


SOLUTION = '''\
import contextlib

import torch


def given(x):
    return x


def task(x, scale=2):
    """Doc."""
    y = given(x)
    # BEGIN SOLUTION 99.1: double it
    return y * scale
    # END SOLUTION


class Box:
    def __init__(self):
        self.open = False

    @contextlib.contextmanager
    def opened(self):
        # BEGIN SOLUTION 99.2: open it for the block
        self.open = True
        try:
            yield
        finally:
            self.open = False
        # END SOLUTION
'''


def _lesson(tmp_path, text):
    lesson = tmp_path / "99_toy"
    lesson.mkdir(exist_ok=True)
    (lesson / "toy.py").write_text(textwrap.dedent(text))
    return lesson


def test_a_reference_is_the_definition_around_its_block(tmp_path):
    out = dr.lesson_references(_lesson(tmp_path, SOLUTION), ("toy",))
    tables = _tables(out)
    assert tables["TASKS"] == {"99.1": (("toy", "task"),), "99.2": (("toy", "Box.opened"),)}
    assert tables["DECORATORS"] == {"Box.opened": ("contextlib.contextmanager",)}
    assert "SOLUTION" not in out and '"""Doc."""' not in out and "given(x)" in out
    assert "import" not in out.split("DECORATORS")[1], "the names are the lesson module's"
    namespace: dict = {}
    exec(compile(out, "refs", "exec"), namespace)  # it runs without the lesson's imports
    assert namespace["task"].__defaults__ == (2,)


def test_a_solution_edit_or_a_hand_edit_is_named_by_task(tmp_path):
    lesson = _lesson(tmp_path, SOLUTION)
    fresh = dr.lesson_references(lesson, ("toy",))
    edited = dr.lesson_references(
        _lesson(tmp_path, SOLUTION.replace("return y * scale", "return y + y")), ("toy",))
    assert differences(fresh, edited) == ["task 99.1: task differs from the solution"]
    by_hand = fresh.replace("self.open = True", "self.open = 1")
    assert differences(by_hand, fresh) == ["task 99.2: Box.opened differs from the solution"]
    assert differences(fresh.replace("# ruff", "#  ruff"), fresh) == [
        f"line {fresh.splitlines().index('# ruff: noqa') + 1} differs (a comment or the layout)"]


@pytest.mark.parametrize("text, says", [
    ("x = 1\n# BEGIN SOLUTION 99.1: h\ny = 2\n# END SOLUTION\n", "not inside a function"),
    ("N = 1\ndef f(a=N):\n    # BEGIN SOLUTION 99.1: h\n    return a\n    # END SOLUTION\n",
     "must be literals"),
    ("class A(B):\n    def f(self):\n        # BEGIN SOLUTION 99.1: h\n"
     "        return super().f()\n        # END SOLUTION\n", "needs the class around it"),
])
def test_what_cannot_be_a_reference_is_refused_in_one_line(tmp_path, text, says):
    with pytest.raises(dr.ReferenceError, match=says):
        dr.lesson_references(_lesson(tmp_path, text), ("toy",))
