"""A lesson script started by a python that is not the course's venv stops at its first import.

Students run ``python exercises/NN_*/script.py`` from the repository root. Every lesson script
(a file of a lesson with a ``__main__`` block) imports ``dpt`` first, before any other import;
it carries no check of its own and says nothing of venvs (issue #53). So:

- a python without ``dpt`` (any python but the course's venv, where ``make setup`` installs
  it) stops at that first line with Python's own ``ModuleNotFoundError: No module named
  'dpt'``: nothing of the lesson has run, and the missing name is the course's package, not
  torch or matplotlib halfway down the file;
- a python that finds ``dpt`` but no torch (PYTHONPATH set by hand, a venv whose torch install
  failed) stops with the one ``error:`` line of ``dpt/__init__.py``, which names the python to
  use.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys

import pytest

from tests.lessons import REPO


def _scripts(tree: str) -> list:
    return sorted(p.relative_to(REPO) for p in (REPO / tree).glob("[0-9][0-9]_*/**/*.py")
                  if 'if __name__ == "__main__"' in p.read_text())


SCRIPTS = _scripts("solutions") + _scripts("exercises")


def test_there_are_lesson_scripts_in_both_trees():
    names = {p.relative_to(p.parts[0]) for p in SCRIPTS}
    assert len(SCRIPTS) == 2 * len(names) >= 2 * 14, SCRIPTS


def _imports(tree: ast.Module) -> list:
    """The file's imports in the order they run, ``from __future__`` left out."""
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return sorted((n for n in nodes if getattr(n, "module", None) != "__future__"),
                  key=lambda n: (n.lineno, n.col_offset))


@pytest.mark.parametrize("rel", SCRIPTS, ids=str)
def test_every_lesson_script_imports_dpt_first(rel):
    text = (REPO / rel).read_text()
    first = _imports(ast.parse(text))[0]
    assert isinstance(first, ast.Import) and [a.name for a in first.names] == ["dpt"], (
        f"{rel}: the first import is `{ast.unparse(first)}` (line {first.lineno}), not "
        "`import dpt`: a python without the course's packages would fail there instead, and "
        "one without torch would not get dpt's one-line error")
    assert 'find_spec("dpt")' not in text, (
        f"{rel} still checks for the course's packages itself: `import dpt` is the whole check")


@functools.cache
def _visible_to(module: str, *flags: str) -> bool:
    proc = subprocess.run([sys.executable, *flags, "-c",
                           "import importlib.util, sys; "
                           f"sys.exit(importlib.util.find_spec({module!r}) is None)"],
                          capture_output=True, timeout=30, cwd="/")
    return proc.returncode == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rel", SCRIPTS, ids=str)
def test_without_dpt_a_script_stops_at_its_first_line_naming_dpt(rel):
    flags = ("-S", "-E")  # no site-packages, no PYTHONPATH: a python without the course's dpt
    if _visible_to("dpt", *flags):
        pytest.skip("dpt is importable even without site-packages here")
    text = (REPO / rel).read_text()
    line = _imports(ast.parse(text))[0].lineno
    proc = subprocess.run([sys.executable, *flags, str(rel), "--help"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and proc.stdout == "" and lines, (
        f"{rel} without dpt: exit {proc.returncode}, stdout:\n{proc.stdout}\nstderr:\n"
        f"{proc.stderr}")
    assert lines[-1] == "ModuleNotFoundError: No module named 'dpt'", proc.stderr
    where = f'{rel}", line {line}, in <module>'  # the traceback's only frame: the script's
    assert where in proc.stderr, f"{rel} did not stop at its first import (line {line}):\n" + (
        proc.stderr)


@pytest.mark.timeout(120)
def test_a_python_that_finds_dpt_but_no_torch_says_which_python_to_use(tmp_path):
    flags = ("-S",)  # no site-packages (no torch), but PYTHONPATH puts dpt in reach
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    if _visible_to("torch", *flags):
        pytest.skip("torch is importable even without site-packages here")
    script = tmp_path / "uses_dpt.py"
    script.write_text("import dpt.data\nprint('imported')\n")
    proc = subprocess.run([sys.executable, *flags, str(script)], capture_output=True,
                          text=True, timeout=60, env=env, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and proc.stdout == "" and len(lines) == 1, (
        f"import dpt without torch: exit {proc.returncode}, stderr:\n{proc.stderr}")
    line = lines[0]
    assert line.startswith("error: ") and "has no torch" in line, line
    assert f".venv/bin/python {script}" in line, f"the command to use instead is missing: {line}"
    assert "source .venv/bin/activate" in line and "make setup" in line, line
