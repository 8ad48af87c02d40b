"""Generate ``exercises/`` and the student notebooks from ``solutions/``.

``solutions/`` is the single source of truth. In its Python files, each part a student
writes sits between two comment lines, nbgrader style::

    # BEGIN SOLUTION 03.6: all-reduce the correct/total counts so every rank sees the totals
    ...the solution...
    # END SOLUTION

The generator replaces each block by one line, at the block's indentation::

    raise NotImplementedError("Task 03.6: all-reduce the correct/total counts ...")

Every other file is copied as it is (README.md, HINTS.md, figures), except that in every text
file a path into a lesson, ``solutions/NN_*``, becomes ``exercises/NN_*``: commands in the
student's tree run the student's code. Each lesson's ``tutorial.py`` (jupytext percent format)
becomes ``notebooks/<lesson>.ipynb`` from its exercises version, without outputs.

Lessons 01, 03 and 04 grow one training script, and lesson 06 grows lesson 03's (see
:data:`GROWTH`, where each lesson names its parent's main file): each lesson folder gets a
``CHANGES.diff``, the unified diff of its main file against its parent's, written in both trees from that tree's own files (the
exercises' diff shows stubs, never a solution). :func:`code_lines_changed` measures a diff as
the lines of code it adds plus those it removes: blank lines, comment-only lines (solution
markers included) and docstrings do not count.

Code a lesson keeps unchanged from its parent is *carried*, and generated: a comment line ::

    # CARRIED FROM 01_single_device (generated: edit it there, then `make exercises`)

right above a function or method (its decorators included) makes ``make exercises`` replace
that definition with the parent's definition of the same name (``Trainer._run_batch``,
``save_checkpoint``), so each carried function has one source, the lesson that introduced it.
A solution block in a carried copy keeps its task id and reads ``copy your answer from lesson
NN``, NN the task's lesson. ``--check`` reports a carried copy that differs from its source.

In ``exercises/`` a carried copy's stub says where the answer comes from and how to get it
there (:func:`carried_stub`: "Task 01.1: your answer from lesson 01; run `make carry` ..."), and the
marker becomes ``# from lesson NN_name, unchanged: `make carry` updates it [carry 1a2b3c4d]``:
``tools/carry_answers.py`` (``make carry``) copies the student's own definition from the parent
lesson into each copy, and the fingerprint (:func:`fingerprint`, of the copy as last written
there) tells it whether the student has since edited the copy by hand.

The tests' reference answers are derived from the same blocks: ``tools/derive_references.py``
writes each solution definition that holds a task into ``tests/lNN_*/_references.py``.

Usage: ``python tools/make_exercises.py`` (writes), ``--check`` (exit 1 if anything is stale),
``--out DIR`` (write the trees under DIR instead of the repository), ``--references-only``
(write only the tests' references).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import filecmp
import hashlib
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ as a script's siblings

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


# Lessons that grow another lesson's main file: (parent's main file, this lesson's main file),
# paths under solutions/, a parent before its children. CHANGES.diff goes into the child's
# folder; its CARRIED FROM markers may name only its parent.
GROWTH = (("01_single_device/single_device.py", "03_ddp_spawn/ddp_spawn.py"),
          ("03_ddp_spawn/ddp_spawn.py", "04_ddp_torchrun/ddp_torchrun.py"),
          # lesson 06 grows lesson 03's script too: mixed precision instead of torchrun
          ("03_ddp_spawn/ddp_spawn.py", "06_mixed_precision/ddp_amp.py"))
CHANGES = "CHANGES.diff"
CARRIED = re.compile(r"^(?P<indent>[ \t]*)# CARRIED FROM (?P<lesson>\d\d_[a-z0-9_]+)\b.*$", re.M)
# The same line in the student's tree, with the fingerprint of the definition under it
FROM = re.compile(r"^(?P<indent>[ \t]*)# from lesson (?P<lesson>\d\d_[a-z0-9_]+)\b(?P<rest>.*)$",
                  re.M)
FINGERPRINT = re.compile(r"\[carry (?P<fp>[0-9a-f]{8})\]")
COPY_HINT = re.compile(r"copy your answer from lesson \d\d")  # what _as_carried writes
STUB = re.compile(r'^(?P<indent>[ \t]*)raise NotImplementedError\("Task (?P<task>\d\d\.\d+[a-z]?)\b'
                  r'.*\)[ \t]*$')


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
    """Write ``CHANGES.diff`` into each lesson of ``tree`` that grows another one."""
    for parent, child in GROWTH:
        if (tree / parent).is_file() and (tree / child).is_file():
            (tree / child).parent.joinpath(CHANGES).write_text(
                changes_diff(tree / parent, tree / child))


# ------------------------------------------------------------------ carried code


def _definitions(text: str) -> dict[str, ast.AST]:
    """Top-level functions and classes' methods of ``text``, by name (``Trainer.train``)."""
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{item.name}"] = item
    return found


def _span(lines: list[str], node: ast.AST) -> tuple[int, int]:
    """0-based ``[start, end)`` of a definition's lines: decorators first, and the comment
    lines that close its body (``# END SOLUTION``) last."""
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    end = node.end_lineno
    indent = len(lines[start]) - len(lines[start].lstrip())
    while end < len(lines) and lines[end].strip().startswith("#") and (
            len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    return start, end


def _as_carried(block: list[str]) -> list[str]:
    """A parent's definition as its child carries it: every solution block's hint becomes
    "copy your answer from lesson NN" (NN: the lesson the task belongs to)."""
    out = []
    for line in block:
        m = BEGIN.match(line)
        out.append(f'{m["indent"]}# BEGIN SOLUTION {m["task"]}: copy your answer from lesson '
                   f'{m["task"][:2]}\n' if m else line)
    return out


def carried_stub(task: str) -> str:
    """The message of a carried copy's stub in ``exercises/``: the same for the generator and
    for ``make carry`` (which carries a parent's unfinished stub as this one)."""
    return (f"Task {task}: your answer from lesson {task[:2]}; run `make carry` to bring it here, "
            "or copy it by hand")


def fingerprint(block: list[str]) -> str:
    """8 hex digits naming a definition's text (trailing spaces aside)."""
    text = "\n".join(line.rstrip() for line in block)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def from_marker(indent: str, lesson: str, block: list[str]) -> str:
    """The line above a carried copy in the student's tree."""
    return (f"{indent}# from lesson {lesson}, unchanged: `make carry` updates it "
            f"[carry {fingerprint(block)}]\n")


def carried_copies(text: str, where: str = "<text>") -> list[tuple[int, str, str, int, int]]:
    """Each ``# from lesson`` line of a student's file and the definition under it, as
    ``(marker line, lesson, name, start, end)`` (0-based lines, ``[start, end)``)."""
    lines = text.splitlines(keepends=True)
    mine = _definitions(text)
    spans = {name: _span(lines, node) for name, node in mine.items()}
    starts = {start: name for name, (start, _) in spans.items()}
    found = []
    for i, line in enumerate(lines):
        m = FROM.match(line)
        if not m:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j not in starts:
            raise MarkerError(f"{where}:{i + 1}: '# from lesson' must stand right above a def")
        found.append((i, m["lesson"], starts[j], *spans[starts[j]]))
    return found


def stamp(text: str, where: str = "<text>") -> str:
    """``text`` with each ``# from lesson`` line holding its definition's fingerprint."""
    lines = text.splitlines(keepends=True)
    for i, lesson, _, start, end in carried_copies(text, where):
        indent = FROM.match(lines[i])["indent"]
        lines[i] = from_marker(indent, lesson, lines[start:end])
    return "".join(lines)


def carry(parent_text: str, child_text: str, parent: str, where: str = "<text>") -> str:
    """``child_text`` with every definition under a ``# CARRIED FROM <parent>`` line replaced
    by ``parent_text``'s definition of the same name."""
    lines = child_text.splitlines(keepends=True)
    mine = _definitions(child_text)
    theirs = _definitions(parent_text)
    parent_lines = parent_text.splitlines(keepends=True)
    starts = {_span(lines, node)[0]: name for name, node in mine.items()}
    replace = []
    for i, line in enumerate(lines):
        m = CARRIED.match(line)
        if not m:
            continue
        if m["lesson"] != parent:
            raise MarkerError(f"{where}:{i + 1}: carried from {m['lesson']}, but this file's "
                              f"parent in GROWTH is {parent}")
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        name = starts.get(j)
        if name is None:
            raise MarkerError(f"{where}:{i + 1}: CARRIED FROM must stand right above a def")
        if name not in theirs:
            raise MarkerError(f"{where}:{i + 1}: {parent} has no {name} to carry")
        replace.append((_span(lines, mine[name]), _as_carried(
            parent_lines[slice(*_span(parent_lines, theirs[name]))])))
    for (start, end), block in reversed(replace):
        lines[start:end] = block
    return "".join(lines)


def carried_texts(solutions: Path) -> dict[Path, str]:
    """Every main file of :data:`GROWTH` with its carried definitions regenerated, parents
    first (a child carries its parent's regenerated text)."""
    texts: dict[Path, str] = {}
    for parent, child in GROWTH:
        p, c = solutions / parent, solutions / child
        if not (p.is_file() and c.is_file()):
            continue
        parent_text = texts.get(p, p.read_text())
        texts[c] = carry(parent_text, texts.get(c, c.read_text()), Path(parent).parts[0],
                         str(Path("solutions") / child))
    return texts


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
            message = f'Task {m["task"]}: {hint}'
            if COPY_HINT.fullmatch(m["hint"]):  # a carried copy's block: `make carry` fills it
                message = carried_stub(m["task"])
            out.append(f'{m["indent"]}raise NotImplementedError("{message}")\n')
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
    carried = carried_texts(solutions)
    writing_repo = (solutions.resolve() == (REPO / "solutions").resolve()
                    and out_root.resolve() == REPO)
    if writing_repo:  # solutions/ is the source: its carried copies are regenerated in place
        for path, text in carried.items():
            if path.read_text() != text:
                path.write_text(text)
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
        source = carried.get(path, None) or path.read_text()
        text, found = strip_solutions(to_exercises_paths(source), str(rel))
        # the student's tree is never regenerated: its carried code says where it is from, and
        # `make carry` (tools/carry_answers.py) brings the student's own answers there
        if CARRIED.search(text):
            text = stamp(CARRIED.sub(lambda m: f"{m['indent']}# from lesson {m['lesson']}", text),
                         str(rel))
        if found and rel.name != NOTEBOOK_SOURCE:
            text = HEADER + text
            tasks.setdefault(rel.parts[0], []).extend(found)
        dest.write_text(text)
        shutil.copymode(path, dest)
        if rel.name == NOTEBOOK_SOURCE and len(rel.parts) == 2:
            (notebooks / f"{rel.parts[0]}.ipynb").write_text(notebook_json(text))
    write_changes(exercises)
    if writing_repo:
        write_changes(solutions)
        import derive_references  # here, not at the top: carry_answers.py imports this file alone

        derive_references.write(solutions)
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
        for path, text in carried_texts(sol).items():
            if path.read_text() != text:
                diffs.append(f"{path.relative_to(REPO)} (carried code differs from its source)")
        for parent, child in GROWTH:
            path = (sol / child).parent / CHANGES
            if not path.is_file() or path.read_text() != changes_diff(sol / parent, sol / child):
                diffs.append(str(path.relative_to(REPO)))
        import derive_references

        diffs += [f"{path} (references differ from solutions/)"
                  for path in derive_references.stale(sol)]
        return diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report stale files")
    ap.add_argument("--out", type=Path, default=REPO)
    ap.add_argument("--references-only", action="store_true",
                    help="write only the tests' references (tests/lNN_*/_references.py)")
    args = ap.parse_args(argv)
    if args.references_only:
        import derive_references

        for path in derive_references.write():
            print(f"wrote {path.relative_to(REPO)}")
        return 0
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
