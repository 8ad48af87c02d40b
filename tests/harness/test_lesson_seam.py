"""Lessons know nothing of the course's machinery, and the machinery reaches them one way.

- A lesson's file edits no ``sys.path`` (Python puts a script's folder first: its siblings
  import by name) and carries no venv check of its own (its first import is ``import dpt``:
  ``tests/harness/test_no_torch_guard.py``).
- A lesson that builds on an earlier one gets its module from ``dpt.lessons.load(lesson,
  module, __file__)`` (the earlier lesson of its own tree: a student's ``exercises/09_fsdp``
  uses their ``exercises/08_sharding``), never by a bare name that only resolves when some
  other code put that lesson's folder on ``sys.path``.
- Benchmarks, tools and ``dpt`` reach lesson code only through ``dpt.lessons.load``: no
  bare-name import of a lesson's module.
- A lesson writes into its own ``runs/`` (an argument's default), not into ``benchmarks/runs``.

The lesson notebooks' sources (``tutorial.py``) open their lesson with ``use_lesson`` and import
its modules by name; they are checked for the venv line only.
"""

from __future__ import annotations

import ast
import functools
import string
import textwrap
from pathlib import Path

import pytest

from tests.lessons import REPO

SOLUTIONS = REPO / "solutions"
LESSON_FILES = sorted(p for p in SOLUTIONS.glob("[0-9][0-9]_*/**/*.py")
                      if "runs" not in p.relative_to(SOLUTIONS).parts)
SCRIPTS = [p for p in LESSON_FILES if p.name != "tutorial.py"]


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _lesson_of(path: Path) -> str:
    return path.relative_to(SOLUTIONS).parts[0]


@functools.cache
def _owners() -> dict[str, str]:
    """Module name -> the lesson folder that holds it (names held by several left out)."""
    seen: dict[str, set] = {}
    for p in SOLUTIONS.glob("[0-9][0-9]_*/*.py"):
        seen.setdefault(p.stem, set()).add(p.parent.name)
    return {name: lessons.pop() for name, lessons in seen.items() if len(lessons) == 1}


def _imported_names(tree: ast.AST) -> list[tuple[str, int]]:
    """``(top-level module name, line)`` of every absolute import, lazy ones too."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno))
    return found


def _code_strings(tree: ast.AST) -> list[str]:
    """The string constants of a file's code, its docstrings left out."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs]


def _is(node: ast.AST, text: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == text


def test_there_are_lesson_files():
    assert len(SCRIPTS) >= 30 and len(LESSON_FILES) > len(SCRIPTS), LESSON_FILES


@pytest.mark.parametrize("path", LESSON_FILES, ids=_rel)
def test_a_lesson_file_checks_no_venv_itself(path):
    text = path.read_text()
    assert 'find_spec("dpt")' not in text and "lacks the course's packages" not in text, (
        f"{_rel(path)} checks for the course's python itself: its first import, `import dpt`, "
        "is the check (dpt/__init__.py says which python to use)")


@pytest.mark.parametrize("path", LESSON_FILES, ids=_rel)  # notebooks' sources too
def test_a_lesson_file_edits_no_sys_path(path):
    tree = ast.parse(path.read_text())
    edits = sorted({n.lineno for n in ast.walk(tree) if _is_sys_path(n)})
    assert not edits, (
        f"{_rel(path)} uses sys.path (line {', '.join(map(str, edits))}): a script's siblings "
        "import by name as they are; an earlier lesson's module comes from "
        "dpt.lessons.load(lesson, module, __file__)")


@pytest.mark.parametrize("path", SCRIPTS, ids=_rel)
def test_a_lesson_reaches_an_earlier_lesson_through_the_loader(path):
    owners, lesson = _owners(), _lesson_of(path)
    bare = [f"{name} (line {line}, lesson {owners[name]})"
            for name, line in _imported_names(ast.parse(path.read_text()))
            if owners.get(name, lesson) != lesson]
    assert not bare, (f"{_rel(path)} imports another lesson's module by name: {bare}; use "
                      "dpt.lessons.load(lesson, module, __file__), which takes it from this "
                      "lesson's own tree")


@pytest.mark.parametrize("path", SCRIPTS, ids=_rel)
def test_a_lesson_writes_into_its_own_runs_folder(path):
    tree = ast.parse(path.read_text())
    into_benchmarks = [s for s in _code_strings(tree) if "benchmarks/runs" in s]
    for node in ast.walk(tree):  # ... / "benchmarks" / "runs"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _is(node.right,
                                                                                "runs"):
            left = node.left.right if isinstance(node.left, ast.BinOp) else node.left
            if _is(left, "benchmarks"):
                into_benchmarks.append(f'... / "benchmarks" / "runs" (line {node.lineno})')
    assert not into_benchmarks, (
        f"{_rel(path)} writes into benchmarks/runs ({into_benchmarks}): a lesson's output "
        "folder is an argument whose default is the lesson's own runs/ (git ignores it)")


MACHINERY = sorted(p for top in ("benchmarks", "tools", "dpt") for p in (REPO / top).rglob("*.py")
                   if "runs" not in p.relative_to(REPO).parts and "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", MACHINERY, ids=_rel)
def test_benchmarks_tools_and_dpt_reach_lesson_code_only_through_the_loader(path):
    owners = _owners()
    bare = [f"{name} (line {line}, lesson {owners[name]})"
            for name, line in _imported_names(ast.parse(path.read_text())) if name in owners]
    assert not bare, (f"{_rel(path)} imports lesson modules by bare name: {bare}; use "
                      'dpt.lessons.load("NN_lesson", "module", "solutions")')


# ------------------------------------------------ tests and tools: the loader, never sys.path

SUITE = sorted(p for top in ("tests", "tools") for p in (REPO / top).rglob("*.py")
               if "__pycache__" not in p.parts)
# Files whose strings hold code that is read, never run: their own code is checked, the code
# in their strings is not.
FIXTURE_STRINGS = {
    REPO / "tests" / "harness" / "test_lesson_seam.py": "this check's own cases",
    REPO / "tests" / "harness" / "test_import_cycles.py": "fake trees for the cycle walker",
    REPO / "tests" / "harness" / "test_notebooks_partial.py":
        "notebook cells for the cell-dependency reader (a notebook imports its lesson's "
        "modules by name after use_lesson)",
}
ROOT_NAMES = {"REPO", "REPO_ROOT", "ROOT"}  # the repository's root, as the course names it
PLACEHOLDER = "_formatted_"  # what a string's {field} becomes before the string is parsed


@functools.cache
def _lesson_modules() -> frozenset[str]:
    """Every module name a lesson folder holds (``tutorial`` included)."""
    return frozenset(p.stem for p in SOLUTIONS.glob("[0-9][0-9]_*/*.py"))


def _as_code(node: ast.AST) -> ast.Module | None:
    """The code a string of a file holds (a script it writes or runs with ``-c``), its
    ``{fields}`` (f-string or ``.format``) replaced by a name; None when it is not code."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        texts = [node.value]
        try:  # a template for str.format: {{ is {, {field} a value
            texts.append("".join(lit + (PLACEHOLDER if field is not None else "")
                                 for lit, field, _, _ in string.Formatter().parse(node.value)))
        except ValueError:
            pass
    elif isinstance(node, ast.JoinedStr):
        texts = ["".join(v.value if isinstance(v, ast.Constant) else PLACEHOLDER
                         for v in node.values)]
    else:
        return None
    for text in texts:
        if "import" in text or "sys.path" in text:
            try:
                return ast.parse(textwrap.dedent(text))
            except (SyntaxError, ValueError):
                continue
    return None


def _trees(tree: ast.AST, strings_too: bool = True, first: int = 0):
    """``(lines before it, tree)`` of a file's code, then of the code held in its strings."""
    yield first, tree
    if strings_too:
        parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            inner = None if id(node) in parts else _as_code(node)  # an f-string's piece: no
            if inner is not None:
                yield from _trees(inner, True, first + node.lineno - 1)


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def _course_folder(node: ast.AST) -> bool:
    """True when ``node`` is the repository's root, its ``tools/``, or a folder found from the
    file's own ``__file__`` (its folder or one above it): none of them a lesson folder."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
            "str", "Path") and len(node.args) == 1:
        node = node.args[0]
    if isinstance(node, ast.Name) and node.id in ROOT_NAMES:
        return True
    if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _is(node.right, "tools")
            and isinstance(node.left, ast.Name) and node.left.id in ROOT_NAMES):
        return True
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    strings = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
               and isinstance(n.value, str)]
    return "__file__" in names and names <= {"__file__", "Path", "os"} and not strings


def _added_to_sys_path(tree: ast.AST) -> list[tuple[ast.AST, int]]:
    """``(folder expression, line)`` for each folder a file's code adds to ``sys.path``."""
    added = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(
                node.func.value):
            how, args = node.func.attr, node.args
            if how == "insert" and len(args) == 2:
                added.append((args[1], node.lineno))
            elif how == "append" and len(args) == 1:
                added.append((args[0], node.lineno))
            elif how == "extend" and len(args) == 1:
                items = args[0].elts if isinstance(args[0], (ast.List, ast.Tuple)) else args
                added += [(item, node.lineno) for item in items]
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                base = target.value if isinstance(target, ast.Subscript) else target
                if _is_sys_path(base):
                    value = node.value
                    items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [
                        n for n in ast.walk(value) if not _is_sys_path(n)
                        and isinstance(n, (ast.Name, ast.Call, ast.BinOp, ast.Constant))][:1]
                    added += [(item, node.lineno) for item in items]
    return added


def seam_breaches(source: str, strings_too: bool = True) -> list[str]:
    """Where a file of tests/ or tools/ reaches lesson code other than through the loader:
    a lesson module imported by bare name, or a folder other than the course's own put on
    ``sys.path`` (in its code, or in code it holds in a string)."""
    lesson_modules, found = _lesson_modules(), []
    for first, tree in _trees(ast.parse(source), strings_too):
        for name, line in _imported_names(tree):
            if name in lesson_modules:
                found.append(f"line {first + line}: imports the lesson module {name} by name")
        for node in ast.walk(tree):  # importlib.import_module("name"), __import__("name")
            if not (isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in (
                    "importlib.import_module", "import_module", "__import__")):
                continue
            name = node.args[0]
            if (isinstance(name, ast.Constant) and isinstance(name.value, str)
                    and name.value.split(".")[0] in lesson_modules):
                found.append(f"line {first + node.lineno}: imports the lesson module "
                             f"{name.value} by name")
        for folder, line in _added_to_sys_path(tree):
            if not _course_folder(folder):
                found.append(f"line {first + line}: puts "
                             f"{ast.unparse(folder).replace(PLACEHOLDER, '{...}')} on sys.path")
    return found


def test_the_suite_and_tools_are_scanned():
    names = {p.name for p in SUITE}
    assert {"conftest.py", "lessons.py", "grade_class.py", "rank_fns.py"} <= names, names


# Files that run a lesson script as the interpreter runs it, script folder first on sys.path
# (``python lesson/script.py``): they import nothing of the lesson themselves.
SCRIPT_RUNNERS = {
    REPO / "tests" / "script_cases.py": "runs a script as __main__ several times in one process",
}


def test_a_script_runner_puts_only_the_script_s_own_folder_on_sys_path():
    for path in SCRIPT_RUNNERS:
        added = [ast.unparse(folder) for folder, _ in _added_to_sys_path(ast.parse(
            path.read_text()))]
        assert added == ["os.path.dirname(os.path.abspath(script))"], (
            f"{_rel(path)} puts {added} on sys.path: a script runner adds the folder of the "
            "script it runs, as `python script.py` does, and nothing else")


@pytest.mark.parametrize("path", SUITE, ids=_rel)
def test_tests_and_tools_reach_lesson_code_only_through_the_loader(path):
    if path in SCRIPT_RUNNERS:
        pytest.skip(f"{_rel(path)}: {SCRIPT_RUNNERS[path]} (checked on its own above)")
    found = seam_breaches(path.read_text(), strings_too=path not in FIXTURE_STRINGS)
    assert not found, (
        f"{_rel(path)} reaches lesson code around the loader: {'; '.join(found)}. Load it with "
        'tests.lessons.load("NN_lesson", "module") (the tree under test) or '
        "dpt.lessons.load(lesson, module, tree): a bare name finds whichever tree's folder "
        "came first on sys.path, and a rank process started before that import finds none")


@pytest.mark.parametrize("source, caught", [
    ("import ddp_spawn\n", True),
    ("def f():\n    from amp_inspect import DtypeRecorder\n", True),
    ("import importlib\nimportlib.import_module('hang_runner')\n", True),
    ("for d in lessons:\n    sys.path.insert(0, d)\n", True),
    ("sys.path.insert(0, str(lesson_dir('03_ddp_spawn')))\n", True),
    ("sys.path[:0] = [str(folder), str(REPO)]\n", True),
    ('code = f"""\nimport sys\nsys.path.insert(0, {str(tree)!r})\n"""\n', True),
    ('RUN = """\nimport sys\nsys.path[:0] = [{lesson!r}]\nprint({{1}})\n"""\n', True),
    ('code = "import scratch_demo; scratch_demo.main()"\n', True),
    ("sys.path.insert(0, str(REPO))\nsys.path.insert(0, str(REPO / 'tools'))\n", False),
    ("sys.path.insert(0, str(Path(__file__).resolve().parents[2]))\n", False),
    ("sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\n", False),
    ("from tests.lessons import load\nddp_spawn = load('03_ddp_spawn', 'ddp_spawn')\n", False),
    ('code = f"""\nfrom dpt.lessons import load\nm = load("10_x", "m", {str(tree)!r})\n"""\n',
     False),
    ("import torch\nfrom tests.l06_mixed_precision import rank_fns\n", False),
])
def test_the_seam_check_tells_the_loader_from_a_way_around_it(source, caught):
    assert bool(seam_breaches(source)) is caught, (source, seam_breaches(source))
