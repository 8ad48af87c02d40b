"""Which earlier lessons' tasks a lesson runs, read from its code: the one list, kept by nobody.

A lesson file may use another lesson's module: ``09_fsdp/memory_table.py`` takes
``predict_bytes`` from ``load("08_sharding", "zero_accounting", __file__)`` (``dpt.lessons``),
``10_inside_a_step/traces.py`` loads lesson 05's DDPs. The tasks such an import runs are the task blocks inside the
definition of each imported name (``# BEGIN SOLUTION NN.K`` in solutions/, the stub's
``NotImplementedError("Task NN.K: ...")`` in exercises/), and inside the definitions that one
uses in turn: the module's other functions and classes its body names, and what it imports
from its own lesson (``NaiveDDP`` -> its base class ``DDPBase``, in ``ddp_base.py``). A class
counts whole, every method with it.

The READMEs' "**Needs**" paragraphs, the notebooks' ``needs_tasks(..., earlier=...)`` and the
grade's ``needs`` lines are checked against (or made from) :func:`needed_tasks`.
Plain Python (``ast``), no torch: the grade imports it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASK_MARK = re.compile(r"BEGIN SOLUTION (\d\d\.\d+[a-z]?)\b"
                       r"|NotImplementedError\(\s*f?[\"']Task (\d\d\.\d+[a-z]?)\b")
TASK_ID = re.compile(r"\d\d\.\d+[a-z]?")


def default_tree() -> Path:
    """solutions/ where the course has it, else exercises/ (the same imports and task marks)."""
    return REPO / "solutions" if (REPO / "solutions").is_dir() else REPO / "exercises"


def task_key(task: str) -> tuple:
    major, minor, letter = re.fullmatch(r"(\d\d)\.(\d+)([a-z]?)", task).groups()
    return int(major), int(minor), letter


@dataclass(frozen=True)
class Need:
    """One import of another lesson's code: ``file`` of ``lesson`` imports ``names`` from
    ``module`` of ``source``, which run ``tasks`` (of ``source``, sorted)."""
    lesson: str
    file: str
    source: str
    module: str
    names: tuple[str, ...]
    tasks: tuple[str, ...]


def lesson_folders(tree: Path) -> list[Path]:
    return sorted(p for p in Path(tree).iterdir() if p.is_dir() and p.name[:2].isdigit())


class _Module:
    def __init__(self, path: Path):
        self.path = path
        self.lines = path.read_text().splitlines()
        self.tree = ast.parse("\n".join(self.lines), str(path))
        self.defs = {n.name: n for n in self.tree.body
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        self.imports = {a.asname or a.name: (n.module, a.name)  # top-level from-imports
                        for n in self.tree.body if isinstance(n, ast.ImportFrom) and n.module
                        for a in n.names}

    def tasks_in(self, node: ast.AST) -> set[str]:
        text = "\n".join(self.lines[node.lineno - 1:node.end_lineno])
        return {a or b for a, b in TASK_MARK.findall(text)}


@cache
def _module(path: Path) -> _Module:
    return _Module(path)


def _tasks_of(folder: Path, module: str, name: str, seen: set) -> set[str]:
    """The tasks that ``name`` of ``folder/module.py`` holds or uses, within that lesson."""
    path = folder / f"{module}.py"
    if (module, name) in seen or not path.is_file():
        return set()
    seen.add((module, name))
    mod = _module(path)
    node = mod.defs.get(name)
    if node is None:  # a constant, or a name the module imports itself
        origin = mod.imports.get(name)
        return _tasks_of(folder, origin[0], origin[1], seen) if origin else set()
    found = mod.tasks_in(node)
    local = {a.asname or a.name: (n.module, a.name) for n in ast.walk(node)
             if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
    for ref in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | set(local):
        if ref in mod.defs:
            found |= _tasks_of(folder, module, ref, seen)
        elif ref in local or ref in mod.imports:
            other, real = local.get(ref) or mod.imports[ref]
            found |= _tasks_of(folder, other, real, seen)
    return found


def _loads(tree: ast.Module, lessons: set[str]) -> dict[int, tuple[str, str, tuple]]:
    """The file's calls ``load("NN_lesson", "module", ...)`` of another lesson's module, by
    ``id``: ``(lesson, module, the names it uses)``. The names are the attribute read off the
    call (``load(...).predict_bytes``) or off the variable it is assigned to (``zero_accounting
    = load(...)``, then ``zero_accounting.predict_bytes``); ``("*",)`` when neither."""
    parents = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    found = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and len(node.args) >= 2 and getattr(
                node.func, "id", getattr(node.func, "attr", None)) == "load"):
            continue
        lesson, module = (a.value if isinstance(a, ast.Constant) else None for a in node.args[:2])
        if lesson not in lessons or not isinstance(module, str):
            continue
        up = parents.get(id(node))
        if isinstance(up, ast.Attribute):
            names = (up.attr,)
        elif isinstance(up, ast.Assign) and [type(x) for x in up.targets] == [ast.Name]:
            var = up.targets[0].id
            names = tuple(sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                                  and isinstance(n.value, ast.Name) and n.value.id == var}))
        else:
            names = ("*",)
        found[id(node)] = (lesson, module, names or ("*",))
    return found


@cache
def needs(tree: Path | None = None) -> dict[str, tuple[Need, ...]]:
    """``{lesson: its imports of other lessons' code}``, for every lesson of ``tree`` (every
    lesson is a key, most with nothing)."""
    tree = Path(tree or default_tree())
    folders = lesson_folders(tree)
    where: dict[str, list[Path]] = {}
    for folder in folders:
        for py in folder.glob("*.py"):
            where.setdefault(py.stem, []).append(folder)
    out = {}
    for folder in folders:
        own = {py.stem for py in folder.glob("*.py")}
        found = []
        for py in sorted(folder.glob("*.py")):
            loaded = _loads(_module(py).tree, {f.name for f in folders})
            for node in ast.walk(_module(py).tree):
                if id(node) in loaded:  # dpt.lessons.load("08_sharding", "zero_accounting", ...)
                    lesson, module, names = loaded[id(node)]
                    src, tasks = tree / lesson, set()
                    for name in names:
                        tasks |= ({a or b for a, b in TASK_MARK.findall("\n".join(_module(
                            src / f"{module}.py").lines))} if name == "*" else _tasks_of(
                            src, module, name, set()))
                    found.append(Need(folder.name, py.name, lesson, module, names,
                                      tuple(sorted(tasks, key=task_key))))
                    continue
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    module, names = node.module, tuple(a.name for a in node.names)
                elif isinstance(node, ast.Import):
                    module, names = None, ()
                    for alias in node.names:
                        if alias.name in where and alias.name not in own:
                            module, names = alias.name, ("*",)
                else:
                    continue
                if module is None or module in own or module not in where:
                    continue
                sources = [f for f in where[module] if f != folder]
                if len(sources) != 1:
                    raise RuntimeError(f"{py}: `{module}` is a module of several lessons "
                                       f"({', '.join(f.name for f in sources)}); which one runs?")
                src = sources[0]
                if names == ("*",):
                    text = "\n".join(_module(src / f"{module}.py").lines)
                    tasks = {a or b for a, b in TASK_MARK.findall(text)}
                else:
                    tasks = set()
                    for name in names:
                        tasks |= _tasks_of(src, module, name, set())
                found.append(Need(folder.name, py.name, src.name, module, names,
                                  tuple(sorted(tasks, key=task_key))))
        out[folder.name] = tuple(found)
    return out


def needed_tasks(lesson: str, tree: Path | None = None) -> dict[str, tuple[str, ...]]:
    """``{earlier lesson: the tasks of it that ``lesson``'s code runs}``, lessons in order;
    empty when the lesson runs only its own code."""
    by_source: dict[str, set[str]] = {}
    for need in needs(tree).get(lesson, ()):
        if need.tasks:
            by_source.setdefault(need.source, set()).update(need.tasks)
    return {s: tuple(sorted(t, key=task_key)) for s, t in sorted(by_source.items())}


@cache
def lesson_tasks(lesson: str, tree: Path | None = None) -> tuple[str, ...]:
    """The lesson's own tasks (its number), in order, from the task marks of its files."""
    folder = Path(tree or default_tree()) / lesson
    found = {a or b for py in folder.glob("*.py") for a, b in TASK_MARK.findall(py.read_text())}
    return tuple(sorted((t for t in found if t[:2] == lesson[:2]), key=task_key))


def ranges(tasks, lesson: str, tree: Path | None = None) -> str:
    """``("05.2", "05.3", "05.4")`` -> ``"05.2-05.4"``: runs of consecutive tasks of ``lesson``
    joined, the others listed, in order."""
    order = lesson_tasks(lesson, tree)
    index = sorted(order.index(t) for t in tasks)
    runs: list[list[int]] = []
    for i in index:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(order[r[0]] if len(r) == 1 else f"{order[r[0]]}-{order[r[-1]]}"
                     for r in runs)


def expand(text: str, tree: Path | None = None) -> set[str]:
    """The task ids written in ``text``, ranges ``"05.2-05.9"`` expanded (to the tasks of that
    lesson between the two)."""
    out: set[str] = set()
    for m in re.finditer(r"(\d\d\.\d+[a-z]?)(?:\s*[-\u2013]\s*(\d\d\.\d+[a-z]?))?", text):
        first, last = m.group(1), m.group(2)
        if last is None:
            out.add(first)
            continue
        lesson = next((f.name for f in lesson_folders(Path(tree or default_tree()))
                       if f.name[:2] == first[:2]), None)
        order = lesson_tasks(lesson, tree) if lesson else ()
        if first not in order or last not in order or first[:2] != last[:2]:
            raise ValueError(f"cannot read the range {m.group(0)!r}: both ends must be tasks "
                             "of one lesson")
        out.update(order[order.index(first):order.index(last) + 1])
    return out


NEEDS_LINE = re.compile(r"^\*\*Needs\*\*(.*?)(?:\n\s*\n|\Z)", re.M | re.S)


def readme_needs(text: str) -> str | None:
    """The "**Needs** ..." paragraph of a lesson README (None when it has none)."""
    m = NEEDS_LINE.search(text)
    return None if m is None else " ".join(m.group(1).split())


def stubs_left(tree: Path, lesson: str, tasks) -> list[str]:
    """Those of ``tasks`` whose stub is still in ``tree/lesson``'s files, in order."""
    folder = Path(tree) / lesson
    text = "".join(py.read_text() for py in folder.glob("*.py")) if folder.is_dir() else ""
    found = {b for _, b in TASK_MARK.findall(text) if b}
    return [t for t in tasks if t in found]


def lesson_needs(lesson: str, target: Path, tree: Path | None = None) -> str | None:
    """What the grade says under a lesson (``"10"`` or ``"10_inside_a_step"``) that runs earlier
    lessons' code: which tasks, which files of it run them, and which are still stubs in
    ``target``. None for a lesson that runs only its own code."""
    tree = Path(tree or default_tree())
    if not tree.is_dir():
        return None
    folder = next((f.name for f in lesson_folders(tree) if f.name[:2] == lesson[:2]), None)
    wanted = needed_tasks(folder, tree) if folder else {}
    if not wanted:
        return None
    files = sorted({n.file for n in needs(tree)[folder] if n.tasks})
    parts, missing = [], []
    for source, tasks in wanted.items():
        parts.append(f"lesson {source[:2]}'s {ranges(tasks, source, tree)}")
        left = stubs_left(target, source, tasks)
        if left:
            missing.append(ranges(left, source, tree))
    said = f"runs {' and '.join(parts)} ({', '.join(files)} calls your code)"
    if missing:
        return (f"{said}; not done in this tree: {', '.join(missing)}: the notebook shows the "
                "course's reference results in their place, and tests that run them are "
                "skipped, not scored")
    return said + "; all written in this tree"
