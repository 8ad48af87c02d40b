"""Generate ``exercises/`` and the student notebooks from ``solutions/``.

``solutions/`` is the single source of truth. In its Python files, each part a student
writes sits between two comment lines, nbgrader style::

    # BEGIN SOLUTION 03.2: all-reduce the correct/total counts so every rank sees the totals
    ...the solution...
    # END SOLUTION

The generator replaces each block by one line, at the block's indentation::

    raise NotImplementedError("Task 03.2: all-reduce the correct/total counts ...")

Every other file is copied as it is (README.md, HINTS.md, figures), except that in every text
file a path into a lesson, ``solutions/NN_*``, becomes ``exercises/NN_*``: commands in the
student's tree run the student's code. Each lesson's ``tutorial.py`` (jupytext percent format)
becomes ``notebooks/<lesson>.ipynb`` from its exercises version, without outputs.

Lessons 01, 03 and 04 grow one training script (see :data:`GROWTH`), and lesson 06 grows lesson
03's (:data:`GROWTH_STEPS` lists every pair): each lesson folder gets a
``CHANGES.diff``, the unified diff of its main file against the previous lesson's, written in
both trees from that tree's own files (the exercises' diff shows stubs, never a solution).
:func:`code_lines_changed` measures a diff as the lines of code it adds plus those it removes:
blank lines, comment-only lines (solution markers included) and docstrings do not count.

Usage: ``python tools/make_exercises.py`` (writes), ``--check`` (exit 1 if anything is stale),
``--out DIR`` (write the trees under DIR instead of the repository).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import filecmp
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION (?P<task>\d\d\.\d+[a-z]?): (?P<hint>.+?)\s*$")
END = re.compile(r"^[ \t]*# END SOLUTION\s*$")
LESSON_PATH = re.compile(r"(?<![\w.-])solutions/(?=\d\d_)")  # solutions/06_x -> exercises/06_x
SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints", "runs", "checkpoints", "outputs"}
SKIP_SUFFIXES = {".pyc", ".pt", ".pth", ".ckpt", ".png", ".log"}
NOTEBOOK_SOURCE = "tutorial.py"
HEADER = ("# Exercise file, generated from solutions/ by `make exercises`.\n"
          "# Replace each `raise NotImplementedError(\"Task ...\")` with your code;\n"
          "# `make grade` scores each task.\n")


# (lesson, main file) in the order the training script grows; CHANGES.diff goes into each
# lesson after the first, against the one before.
GROWTH = (("01_single_device", "single_device.py"), ("03_ddp_spawn", "ddp_spawn.py"),
          ("04_ddp_torchrun", "ddp_torchrun.py"))
# Every (previous, next) pair that gets a CHANGES.diff: the chain above, and lesson 06, which
# grows lesson 03's file too (mixed precision instead of torchrun).
GROWTH_STEPS = (*zip(GROWTH, GROWTH[1:]),
                (("03_ddp_spawn", "ddp_spawn.py"), ("06_mixed_precision", "ddp_amp.py")))
CHANGES = "CHANGES.diff"


class MarkerError(ValueError):
    pass


def changes_diff(before: Path, after: Path) -> str:
    """The unified diff of ``after`` against ``before``, named by lesson folder and file."""
    a, b = before.read_text().splitlines(keepends=True), after.read_text().splitlines(keepends=True)
    name = lambda p: f"{p.parent.name}/{p.name}"  # noqa: E731
    return "".join(difflib.unified_diff(a, b, name(before), name(after), n=3))


def _not_code(text: str) -> set[int]:
    """1-based numbers of the lines of ``text`` that are not code: blank, comment-only, or
    part of a docstring (module, class or function)."""
    lines = text.splitlines()
    skip = {i for i, line in enumerate(lines, 1) if not line.strip()
            or line.strip().startswith("#")}
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            skip |= set(range(body[0].lineno, body[0].end_lineno + 1))
    return skip


def code_lines_changed(before: str, after: str) -> int:
    """Lines of code added plus lines of code removed between two versions of a file."""
    a, b = before.splitlines(), after.splitlines()
    skip_a, skip_b = _not_code(before), _not_code(after)
    changed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        changed += sum(1 for i in range(i1, i2) if i + 1 not in skip_a)
        changed += sum(1 for j in range(j1, j2) if j + 1 not in skip_b)
    return changed


def write_changes(tree: Path) -> None:
    """Write ``CHANGES.diff`` into each lesson of ``tree`` that grows the previous one."""
    for (l1, f1), (l2, f2) in GROWTH_STEPS:
        if (tree / l1 / f1).is_file() and (tree / l2 / f2).is_file():
            (tree / l2 / CHANGES).write_text(changes_diff(tree / l1 / f1, tree / l2 / f2))


def strip_solutions(text: str, where: str = "<text>") -> tuple[str, list[str]]:
    """Replace every BEGIN/END SOLUTION block with a ``raise``; return text and task ids."""
    out, tasks = [], []
    inside = None
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        m = BEGIN.match(line)
        if m:
            if inside:
                raise MarkerError(f"{where}:{lineno}: BEGIN SOLUTION inside another block")
            hint = m["hint"].replace("\\", "\\\\").replace('"', '\\"')
            out.append(f'{m["indent"]}raise NotImplementedError("Task {m["task"]}: {hint}")\n')
            tasks.append(m["task"])
            inside = lineno
            continue
        if END.match(line):
            if not inside:
                raise MarkerError(f"{where}:{lineno}: END SOLUTION without BEGIN")
            inside = None
            continue
        if "SOLUTION" in line and ("# BEGIN" in line or "# END" in line):
            raise MarkerError(f"{where}:{lineno}: malformed marker (expected "
                              "'# BEGIN SOLUTION NN.K: hint' or '# END SOLUTION')")
        if not inside:
            out.append(line)
    if inside:
        raise MarkerError(f"{where}:{inside}: BEGIN SOLUTION is never closed")
    return "".join(out), tasks


def to_exercises_paths(text: str) -> str:
    """Point every ``solutions/NN_*`` path in ``text`` at ``exercises/NN_*``."""
    return LESSON_PATH.sub("exercises/", text)


def notebook_json(source: str) -> str:
    """A percent-format script as a notebook, with fixed metadata and no outputs."""
    import jupytext
    import nbformat

    nb = jupytext.reads(source, fmt="py:percent")
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for i, cell in enumerate(nb.cells):
        cell.metadata = {}
        cell["id"] = f"cell-{i:02d}"
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nbformat.validate(nb)
    return json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def _files(tree: Path):
    for path in sorted(tree.rglob("*")):
        rel = path.relative_to(tree)
        if path.is_dir() or set(rel.parts) & SKIP_DIRS or path.suffix in SKIP_SUFFIXES:
            continue
        yield path, rel


def generate(out_root: Path, solutions: Path = REPO / "solutions") -> dict[str, list[str]]:
    """Write ``out_root/exercises`` and ``out_root/notebooks``; return tasks per lesson."""
    exercises, notebooks = out_root / "exercises", out_root / "notebooks"
    for d in (exercises,):
        if d.exists():
            shutil.rmtree(d)
    notebooks.mkdir(parents=True, exist_ok=True)
    for old in notebooks.glob("[0-9][0-9]_*.ipynb"):
        old.unlink()
    tasks: dict[str, list[str]] = {}
    for path, rel in _files(solutions):
        if rel.name == CHANGES:
            continue  # written below from the exercise files themselves
        dest = exercises / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix != ".py":
            try:
                dest.write_text(to_exercises_paths(path.read_text()))
            except UnicodeDecodeError:  # a binary file
                shutil.copyfile(path, dest)
            shutil.copymode(path, dest)
            continue
        text, found = strip_solutions(to_exercises_paths(path.read_text()), str(rel))
        if found and rel.name != NOTEBOOK_SOURCE:
            text = HEADER + text
            tasks.setdefault(rel.parts[0], []).extend(found)
        dest.write_text(text)
        shutil.copymode(path, dest)
        if rel.name == NOTEBOOK_SOURCE and len(rel.parts) == 2:
            (notebooks / f"{rel.parts[0]}.ipynb").write_text(notebook_json(text))
    write_changes(exercises)
    if solutions.resolve() == (REPO / "solutions").resolve() and out_root.resolve() == REPO:
        write_changes(solutions)
    return tasks


def stale(out_root: Path = REPO) -> list[str]:
    """Paths where the committed trees differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        diffs = []
        for sub in ("exercises", "notebooks"):
            fresh, committed = Path(tmp) / sub, out_root / sub
            want = {rel for _, rel in _files(fresh)}
            have = {rel for _, rel in _files(committed)} if committed.is_dir() else set()
            if sub == "notebooks":  # other files (a README, results) may live there too
                have = {r for r in have if r.suffix == ".ipynb" and r.name[:2].isdigit()}
            for rel in sorted(want | have):
                a, b = fresh / rel, committed / rel
                if not (a.is_file() and b.is_file() and filecmp.cmp(a, b, shallow=False)):
                    diffs.append(f"{sub}/{rel}")
        sol = REPO / "solutions"
        for (l1, f1), (l2, f2) in GROWTH_STEPS:
            path = sol / l2 / CHANGES
            if not path.is_file() or path.read_text() != changes_diff(sol / l1 / f1, sol / l2 / f2):
                diffs.append(f"solutions/{l2}/{CHANGES}")
        return diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report stale files")
    ap.add_argument("--out", type=Path, default=REPO)
    args = ap.parse_args(argv)
    if args.check:
        diffs = stale(args.out)
        for d in diffs:
            print(f"stale: {d}")
        if diffs:
            print("run `make exercises` and commit the result", file=sys.stderr)
        return 1 if diffs else 0
    tasks = generate(args.out)
    for lesson, ids in sorted(tasks.items()):
        print(f"{lesson}: tasks {', '.join(dict.fromkeys(ids))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
