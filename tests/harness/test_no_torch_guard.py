"""A lesson script started by a python that is not the course's venv says so in one line.

Students run ``python exercises/NN_*/script.py`` from the repository root; outside the
course's venv that used to end in ``ModuleNotFoundError: No module named 'torch'`` (or
``'dpt'``). Every lesson script (a file of a lesson with a ``__main__`` block) opens with one
statement, :data:`GUARD`, before any import: without ``dpt`` (installed only in the venv) it
stops with one ``error:`` line naming the python to use. ``dpt/__init__.py`` keeps the longer
message for a python that finds ``dpt`` but no torch. This test keeps the copies identical and
runs each script with an interpreter that sees neither (``python -S``: no site-packages).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys

import pytest

from tests.lessons import REPO

GUARD = '''__import__("importlib.util").util.find_spec("dpt") or __import__("sys").exit(
    "error: this python lacks the course's packages; use .venv/bin/python (`make setup`)")
'''


def _scripts(tree: str) -> list:
    return sorted(p.relative_to(REPO) for p in (REPO / tree).glob("[0-9][0-9]_*/**/*.py")
                  if 'if __name__ == "__main__"' in p.read_text())


SCRIPTS = _scripts("solutions") + _scripts("exercises")


def test_there_are_lesson_scripts_in_both_trees():
    names = {p.relative_to(p.parts[0]) for p in SCRIPTS}
    assert len(SCRIPTS) == 2 * len(names) >= 2 * 14, SCRIPTS


@pytest.mark.parametrize("rel", SCRIPTS, ids=str)
def test_every_lesson_script_opens_with_the_guard(rel):
    text = (REPO / rel).read_text()
    assert GUARD in text, (f"{rel} lacks the venv guard: paste GUARD from {__name__} "
                           "right after `from __future__ import annotations`")
    guard_line = text[:text.index(GUARD)].count("\n") + 1
    early = [ast.unparse(node) for node in ast.parse(text).body
             if node.lineno < guard_line and isinstance(node, (ast.Import, ast.ImportFrom))
             and getattr(node, "module", None) != "__future__"]
    assert not early, f"{rel} imports {early} before the guard: they would fail first"
    old_guard = 'find_spec("torch") is None'
    assert old_guard not in text, f"{rel} still carries the old 5-line guard as well"


@functools.cache
def _torch_visible_to(*flags: str) -> bool:
    proc = subprocess.run([sys.executable, *flags, "-c",
                           "import importlib.util, sys; "
                           "sys.exit(importlib.util.find_spec('torch') is None)"],
                          capture_output=True, timeout=30)
    return proc.returncode == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rel", SCRIPTS, ids=str)
def test_without_torch_a_script_says_which_python_to_use(rel):
    flags = ("-S", "-E")  # no site-packages, no PYTHONPATH: a python without torch
    if _torch_visible_to(*flags):
        pytest.skip("torch is importable even without site-packages here")
    proc = subprocess.run([sys.executable, *flags, str(rel), "--help"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and proc.stdout == "" and len(lines) == 1, (
        f"{rel} without torch: exit {proc.returncode}, stderr:\n{proc.stderr}")
    line = lines[0]
    assert line.startswith("error: ") and ".venv/bin/python" in line, line
    assert "make setup" in line, f"how to create the venv is missing: {line}"


@pytest.mark.timeout(120)
def test_a_python_that_finds_dpt_but_no_torch_says_which_python_to_use(tmp_path):
    flags = ("-S",)  # no site-packages (no torch), but PYTHONPATH puts dpt in reach
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    if _torch_visible_to(*flags):
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
