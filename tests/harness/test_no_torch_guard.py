"""A lesson script started by a python without torch (the system one) says so in one line.

Students run ``python exercises/NN_*/script.py`` from the repository root; outside the
course's venv that used to end in ``ModuleNotFoundError: No module named 'torch'`` (or
``'dpt'``). Every lesson script (a file of a lesson with a ``__main__`` block) opens with the
same few lines, :data:`GUARD`, before any other import: they name the python that lacks torch
and the command to use instead. This test keeps the copies identical and runs each script
with an interpreter that cannot see torch (``python -S``: no site-packages).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys

import pytest

from tests.lessons import REPO

GUARD = '''import importlib.util
import sys

if importlib.util.find_spec("torch") is None:  # not the course's venv: say so in one line
    sys.exit(f"error: {sys.executable} has no torch; use the course's venv: .venv/bin/python "
             f"{sys.argv[0]} (or `source .venv/bin/activate` first; `make setup` creates it)")
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
    assert GUARD in text, (f"{rel} lacks the no-torch guard: paste GUARD from {__name__} "
                           "right after `from __future__ import annotations`")
    guard_line = text[:text.index(GUARD)].count("\n") + 1
    early = [ast.unparse(node) for node in ast.parse(text).body
             if node.lineno < guard_line and isinstance(node, (ast.Import, ast.ImportFrom))
             and getattr(node, "module", None) != "__future__"]
    assert not early, f"{rel} imports {early} before the guard: they would fail first"


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
    assert line.startswith("error: ") and "has no torch" in line, line
    assert f".venv/bin/python {rel}" in line, f"the command to use instead is missing: {line}"
    assert "source .venv/bin/activate" in line and "make setup" in line, line
