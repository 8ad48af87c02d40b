"""The tests' reference answers, derived from ``solutions/``: one generated module per lesson.

A lesson's tests grade each task on its own: the student's code for that task, a reference for
every other task it needs. The references are the solution's own definitions: for every
``# BEGIN SOLUTION NN.K`` block, the function or method that encloses it (found with ``ast``),
copied as it is written, markers left out. They are written to ``tests/<lesson tests>/
_references.py`` (:data:`LESSONS`), beside the tests, so grading a student's tree needs no
``solutions/``; ``make exercises`` writes them (``tools/make_exercises.py --references-only``
writes only them), and ``tests/harness/test_references.py`` fails when one is stale.

In the generated module a method sits in a bare class of its class's name (only the methods
that hold a task, no bases): ``OverlapDDP.finish_gradient_synchronization`` is a plain
function. ``TASKS`` says where each task's definitions live in the lesson (file and dotted
name), ``DECORATORS`` which decorators they carry. The module imports nothing:
``tests/references.py`` rebinds each function to the module of the lesson tree under test, so
the names it uses (``torch``, ``dist``, a helper, another task's function) are looked up there,
as they are for the code it replaces, and applies the decorators there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEGIN = re.compile(r"^[ \t]*# BEGIN SOLUTION (?P<task>\d\d\.\d+[a-z]?): (?P<hint>.+?)\s*$")
END = re.compile(r"^[ \t]*# END SOLUTION\s*$")
# lesson folder -> (the tests folder its references go to, the lesson files whose tasks the
# tests take references of)
LESSONS = {"05_ddp_from_scratch": ("tests/l05_ddp_from_scratch",
                                   ("ddp_base", "naive_ddp", "overlap_ddp", "bucketed_ddp")),
           "09_fsdp": ("tests/l09_fsdp", ("fsdp_by_hand", "fsdp2_practice", "dcp_checkpoint")),
           "10_inside_a_step": ("tests/l10_inside_a_step", ("traces", "compile_ddp")),
           "11_time_to_accuracy": ("tests/l11_time_to_accuracy",
                                   ("global_batch", "sync_bn", "lr_scaling", "large_batch")),
           "12_step_cost": ("tests/l12_step_cost",
                            ("flops", "bandwidth", "crossover", "memory_calc")),
           "13_local_sgd": ("tests/l13_local_sgd",
                            ("local_sgd", "diloco", "streaming", "compress", "fault_tolerance"))}
NAME = "_references.py"


class ReferenceError(ValueError):
    pass


def _enclosing(tree: ast.Module, lineno: int) -> list[ast.AST]:
    """The chain of classes and functions from the module down to the innermost function
    whose body holds line ``lineno``."""
    chain: list[ast.AST] = []
    body = tree.body
    while True:
        for node in body:
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and node.lineno < lineno <= node.end_lineno):
                chain.append(node)
                body = node.body
                break
        else:
            break
        if not isinstance(chain[-1], ast.ClassDef):
            break  # a nested function's blocks belong to the outer function
    return chain


def _check(node: ast.AST, where: str) -> None:
    """What a definition must not do to be emitted without the module around it."""
    for arg in [*node.args.defaults, *[d for d in node.args.kw_defaults if d is not None]]:
        if any(isinstance(n, ast.Name) for n in ast.walk(arg)):
            raise ReferenceError(f"{where}: default value {ast.unparse(arg)!r} uses a name; "
                                 "a reference's defaults must be literals")
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in ("super", "__class__"):
            raise ReferenceError(f"{where}: uses {sub.id}, which needs the class around it; "
                                 "write the parent class out (Base.method(self, ...))")


def _lines(text: list[str], node: ast.AST) -> list[str]:
    """The definition's lines without its decorators and docstring (the lesson shows them),
    solution markers dropped."""
    skip: set[int] = set()
    first = node.body[0]
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        skip = set(range(first.lineno, first.end_lineno + 1))
    return [line for lineno, line in enumerate(text[node.lineno - 1:node.end_lineno],
                                               node.lineno)
            if lineno not in skip and not (BEGIN.match(line) or END.match(line))]


def lesson_references(lesson_dir: Path, files: tuple[str, ...]) -> str:
    """The text of the generated ``_references.py`` of ``lesson_dir`` (a solutions lesson),
    for the tasks of ``files`` (module names)."""
    where_root = f"solutions/{lesson_dir.name}"
    tasks: dict[str, list[tuple[str, str]]] = {}
    decorators: dict[str, list[str]] = {}
    sections: list[str] = []
    seen: dict[str, str] = {}  # top-level name -> file that defines it here
    for stem in files:
        path = lesson_dir / f"{stem}.py"
        text = path.read_text()
        lines = text.splitlines(keepends=True)
        starts = [(i + 1, m["task"]) for i, line in enumerate(lines) if (m := BEGIN.match(line))]
        if not starts:
            raise ReferenceError(f"{where_root}/{path.name}: no BEGIN SOLUTION block")
        tree = ast.parse(text)
        where = f"{where_root}/{path.name}"
        found: dict[tuple[str, ...], ast.AST] = {}  # dotted path -> innermost definition
        for lineno, task in starts:
            chain = _enclosing(tree, lineno)
            if not chain or isinstance(chain[-1], ast.ClassDef):
                raise ReferenceError(f"{where}:{lineno}: task {task}'s block is not inside a "
                                     "function: the tests cannot put a reference in its place")
            names = tuple(n.name for n in chain)
            found.setdefault(names, chain[-1])
            entry = (path.stem, ".".join(names))
            if entry not in tasks.setdefault(task, []):
                tasks[task].append(entry)
        out = [f"# --- {where}\n"]
        emitted_classes: set[tuple[str, ...]] = set()
        for names, node in sorted(found.items(), key=lambda kv: kv[1].lineno):
            dotted = ".".join(names)
            _check(node, f"{where}: {dotted}")
            owner = seen.setdefault(names[0], path.name)
            if owner != path.name:
                raise ReferenceError(f"{where}: {names[0]} is also defined in {owner}; the "
                                     "references of one lesson share one namespace")
            for depth in range(1, len(names)):
                if names[:depth] not in emitted_classes:
                    emitted_classes.add(names[:depth])
                    indent = "    " * (depth - 1)
                    out.append(f"\n\n{indent}class {names[depth - 1]}:\n")
            out.append("\n" if len(names) > 1 else "\n\n")
            if node.decorator_list:
                decorators[dotted] = [ast.unparse(d) for d in node.decorator_list]
                indent = "    " * (len(names) - 1)
                out.extend(f"{indent}# @{d} in the lesson (DECORATORS)\n"
                           for d in decorators[dotted])
            out.extend(_lines(lines, node))
        sections.append("".join(out))
    if not tasks:
        raise ReferenceError(f"{where_root}: no task to make references of")
    head = [
        f'"""Reference answers of lesson {lesson_dir.name[:2]}\'s tasks: generated by `make exercises` '
        f'from\n{where_root}/ ({", ".join(f"{f}.py" for f in files)})\nby tools/derive_references.py; '
        'do not edit.\n\n'
        "Each function is the definition that holds a task's solution block, as written there\n"
        "(markers, decorators and docstring left out). tests/references.py puts one in the place\n"
        "of the code it replaces, its names looked up in that code's module.\n\"\"\"\n",
        "# ruff: noqa\n",
        "from __future__ import annotations\n\n",
        "# task -> ((lesson file, dotted name), ...)\n",
        "TASKS = {\n",
        *[f"    {task!r}: ({''.join(f'{e!r}, ' for e in entries).rstrip(' ')}),\n"
          for task, entries in sorted(tasks.items(), key=lambda kv: _task_key(kv[0]))],
        "}\n",
        "# dotted name -> decorators, applied in the lesson's module\n",
        "DECORATORS = {\n",
        *[f"    {name!r}: ({''.join(f'{d!r}, ' for d in decos).rstrip(' ')}),\n"
          for name, decos in decorators.items()],
        "}\n",
    ]
    return "".join(head) + "".join(f"\n\n{s.rstrip()}\n" for s in sections)


def _task_key(task: str) -> tuple[int, int, str]:
    m = re.fullmatch(r"(\d\d)\.(\d+)([a-z]?)", task)
    return int(m[1]), int(m[2]), m[3]


def expected(solutions: Path = REPO / "solutions") -> dict[Path, str]:
    """Every generated file (path under the repository) and the text it must have."""
    return {REPO / tests / NAME: lesson_references(solutions / lesson, files)
            for lesson, (tests, files) in LESSONS.items()}


def write(solutions: Path = REPO / "solutions") -> list[Path]:
    """Write the references that differ; return the paths written."""
    written = []
    for path, text in expected(solutions).items():
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


def stale(solutions: Path = REPO / "solutions") -> list[str]:
    """The generated references that differ from ``solutions/`` (paths, repo-relative)."""
    return [str(path.relative_to(REPO)) for path, text in expected(solutions).items()
            if not path.is_file() or path.read_text() != text]
