"""No import circles in the course's code: a module never imports, directly or through others,
a module that imports it back.

A circle between a lesson's files means the student's file and the course's plumbing cannot be
read, run or replaced one without the other (lesson 09's FSDP once imported the schedule
plotter whose decorators sat on its methods, while the plotter imported the FSDP to run it).
This walks the imports of every ``.py`` under :data:`ROOTS` statically (``ast``; nothing is
imported, so it takes well under a second) and fails on each circle, naming its files in order
with the line of each import.

What counts as an import of a file of the tree, wherever it sits (a lazy import inside a
function closes a circle as surely as one at the top):

- ``import a.b`` / ``from a.b import c``: looked up, in order, in the file's own folder (a
  script's siblings), the folders its ``sys.path`` edits add (``sys.path.insert(0, str(Path(
  __file__).resolve().parent))``, ``... .parents[1] / "08_sharding"``, ``sys.path[:0] = [...]``,
  names such as ``HERE`` or ``REPO`` assigned in the file or imported from a module of the tree,
  and loops over a tuple of names), the folder of a lesson it opens with
  ``dpt.notebook.use_lesson("NN_name")``, the repository's root (``dpt``, ``tests``, ``tools``,
  ``benchmarks``). Tests, tools and benchmarks, like a later lesson, reach lesson code only
  through the loader below (``tests/harness/test_lesson_seam.py``). ``from a import c`` counts ``a/c.py`` too; the package
  ``__init__.py`` files on the way count (not those of the importing file's own packages,
  which are imported before it).
- relative imports (``from . import x``, ``from ..pkg import y``);
- ``importlib.import_module("name")`` and ``__import__("name")`` with a literal name;
- the course's lesson loaders: any call whose first two arguments are a lesson folder's name
  and the name of a module in that folder, or in its ``figures/`` (``dpt.lessons.load(
  "08_sharding", "zero_accounting", __file__)`` in lesson 09, ``tests.lessons.load(LESSON,
  "schedule")``, ``_figure_module("05_ddp_from_scratch", "backward_timeline")``).

A file importing itself (``import hang_clinic`` in its own ``main``, so that rank processes
find its functions under that name) is no circle. Modules of the standard library and of
installed packages are not followed. ``exercises/`` and ``notebooks/`` are generated from
``solutions/`` and are not walked.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("solutions", "dpt", "tests", "tools", "benchmarks", "site")
SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints", "_build", "runs"}


@dataclass(frozen=True)
class Edge:
    target: Path
    line: int


class _Unknown:
    """A value the evaluator cannot work out statically."""


UNKNOWN = _Unknown()


class ImportGraph:
    """The imports between the ``.py`` files of ``roots`` under ``repo``; lessons are the
    folders ``NN_name`` of ``repo / lessons``."""

    def __init__(self, repo: Path = REPO, roots=ROOTS, lessons: str = "solutions"):
        self.repo = repo.resolve()
        self.files = sorted(p.resolve() for root in roots if (self.repo / root).is_dir()
                            for p in (self.repo / root).rglob("*.py")
                            if not SKIP_DIRS.intersection(p.relative_to(self.repo).parts))
        tree = self.repo / lessons
        self.lessons = sorted(p for p in tree.iterdir() if p.is_dir() and p.name[:2].isdigit()
                              ) if tree.is_dir() else []
        self._file_set = set(self.files)
        self._dir_set = {d for p in self.files for d in p.parents}
        self._trees: dict[Path, ast.Module | None] = {}
        self._nodes: dict[Path, list[ast.AST]] = {}
        self._envs: dict[Path, dict] = {}
        self._busy: set[Path] = set()
        self._dirs: dict[Path, list[Path]] = {}
        self._walked: dict[tuple, list[Path] | None] = {}
        # A file nothing imports is in no circle. pytest's test files are imported by nothing
        # but pytest, so they are read only when some file of the tree imports them.
        self.edges: dict[Path, list[Edge]] = {}
        todo = [p for p in self.files if not p.name.startswith("test_")]
        while todo:
            path = todo.pop()
            if path not in self.edges:
                self.edges[path] = self.edges_of(path)
                todo += [e.target for e in self.edges[path] if e.target not in self.edges]

    # --- parsing and a small evaluator of constant paths and names -------------------------

    def tree(self, path: Path) -> ast.Module | None:
        if path not in self._trees:
            try:
                self._trees[path] = ast.parse(path.read_text(encoding="utf-8"), str(path))
            except (SyntaxError, UnicodeDecodeError, OSError):
                self._trees[path] = None
        return self._trees[path]

    def nodes(self, path: Path) -> list[ast.AST]:
        """The statements and calls of a file that can import or edit ``sys.path``."""
        if path not in self._nodes:
            tree = self.tree(path)
            self._nodes[path] = [n for n in ast.walk(tree) if isinstance(n, _KINDS)] if tree else []
        return self._nodes[path]

    def env(self, path: Path) -> dict:
        """The names a file assigns a value this evaluator knows (a string, a path, a tuple of
        them), wherever it assigns them, later assignments winning; and the names it imports
        from a module of the tree that knows them."""
        if path in self._envs:
            return self._envs[path]
        if path in self._busy:  # two modules importing names from each other
            return {}
        self._busy.add(path)
        env: dict = {"__file__": str(path)}
        for node in self.nodes(path):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                    node.targets[0], ast.Name):
                value = self.value(node.value, env, path)
                if value is not UNKNOWN:
                    env[node.targets[0].id] = value
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = self.module_files(node.module, path, [path.parent, self.repo])
                source = self.env(found[-1]) if found else {}
                for alias in node.names:
                    if alias.name in source:
                        env[alias.asname or alias.name] = source[alias.name]
        self._busy.discard(path)
        self._envs[path] = env
        return env

    def value(self, node: ast.AST, env: dict, path: Path):
        """``node``'s value if it is made of constants, known names, ``__file__`` and path
        operations (``Path``, ``resolve``, ``parent``, ``parents[k]``, ``/``, ``str``,
        ``os.path``'s ``dirname``, ``abspath`` and ``join``); else :data:`UNKNOWN`."""
        v = self.value
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return env.get(node.id, UNKNOWN)
        if isinstance(node, (ast.Tuple, ast.List)):
            items = [v(e, env, path) for e in node.elts]
            return UNKNOWN if any(i is UNKNOWN for i in items) else tuple(items)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            left, right = v(node.left, env, path), v(node.right, env, path)
            if isinstance(left, Path) and isinstance(right, str):
                return left / right
            return UNKNOWN
        if isinstance(node, ast.Attribute):
            base = v(node.value, env, path)
            if isinstance(base, Path) and node.attr == "parent":
                return base.parent
            if isinstance(base, Path) and node.attr == "parents":
                return ("parents", base)
            return UNKNOWN
        if isinstance(node, ast.Subscript):
            base = v(node.value, env, path)
            index = node.slice
            if (isinstance(base, tuple) and base[:1] == ("parents",)
                    and isinstance(index, ast.Constant) and isinstance(index.value, int)):
                parents = base[1].parents
                return parents[index.value] if index.value < len(parents) else UNKNOWN
            return UNKNOWN
        if isinstance(node, ast.Call):
            name = _call_name(node.func)
            args = [v(a, env, path) for a in node.args]
            if name in ("Path", "pathlib.Path", "PurePath") and len(args) == 1:
                return Path(args[0]) if isinstance(args[0], (str, Path)) else UNKNOWN
            if name in ("str", "os.fspath") and len(args) == 1:
                return args[0] if isinstance(args[0], (str, Path)) else UNKNOWN
            if isinstance(node.func, ast.Attribute) and node.func.attr in ("resolve", "absolute"):
                base = v(node.func.value, env, path)
                return base if isinstance(base, Path) else UNKNOWN
            if name in ("os.path.dirname", "os.path.abspath", "os.path.realpath") and args:
                if not isinstance(args[0], (str, Path)):
                    return UNKNOWN
                p = Path(args[0])
                return str(p.parent if name.endswith("dirname") else p)
            if name == "os.path.join" and args and all(isinstance(a, (str, Path)) for a in args):
                return os.path.join(*map(str, args))
            if name.endswith("lesson_dir") and len(args) == 1 and isinstance(args[0], str):
                return self.repo / "solutions" / args[0]
            return UNKNOWN
        return UNKNOWN

    # --- where a file's imports lead -------------------------------------------------------

    def search_path(self, path: Path) -> list[Path]:
        """The folders a bare ``import name`` of ``path`` is looked up in, in order."""
        if path in self._dirs:
            return self._dirs[path]
        dirs = [path.parent]
        env = self.env(path)
        for node in self.nodes(path):
            dirs += self._sys_path_edit(node, env, path)
        dirs.append(self.repo)
        self._dirs[path] = list(dict.fromkeys(Path(os.path.normpath(d)) for d in dirs))
        return self._dirs[path]

    def _sys_path_edit(self, node: ast.AST, env: dict, path: Path) -> list[Path]:
        """The folders one statement adds to ``sys.path`` (a ``for`` over known values is
        unrolled), or ``use_lesson("NN_name")``'s lesson folder."""
        found = []
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            values = self.value(node.iter, env, path)
            if isinstance(values, tuple):
                for item in values:
                    inner = {**env, node.target.id: item}
                    for stmt in node.body:
                        for sub in ast.walk(stmt):
                            if isinstance(sub, (ast.Call, ast.Assign)):
                                found += self._sys_path_edit(sub, inner, path)
            return found
        values = []
        if isinstance(node, ast.Call):
            name = _call_name(node.func)
            if name in ("sys.path.insert",) and len(node.args) == 2:
                values = [self.value(node.args[1], env, path)]
            elif name == "sys.path.append" and len(node.args) == 1:
                values = [self.value(node.args[0], env, path)]
            elif name == "sys.path.extend" and len(node.args) == 1:
                values = list(_flat(self.value(node.args[0], env, path)))
            elif name.endswith("use_lesson") and node.args:
                lesson = self.value(node.args[0], env, path)
                values = [self.repo / "solutions" / lesson] if isinstance(lesson, str) else []
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Subscript) and _call_name(t.value) == "sys.path"
                for t in node.targets):
            values = list(_flat(self.value(node.value, env, path)))
        for value in values:
            if isinstance(value, (str, Path)) and Path(value).is_absolute():
                found.append(Path(value))
        return found

    def module_files(self, dotted: str, path: Path,
                     dirs: list[Path] | None = None) -> list[Path]:
        """The files ``import dotted`` runs from ``path``: each package's ``__init__.py`` on
        the way, then the module. Empty when it is not a module of the tree."""
        parts = dotted.split(".")
        for base in dirs if dirs is not None else self.search_path(path):
            found = self._walk(base, parts)
            if found is not None:
                return found
        return []

    def _walk(self, base: Path, parts: list[str]) -> list[Path] | None:
        """The files of ``parts`` (a dotted name) under ``base``, or None when not there."""
        key = (base, *parts)
        if key not in self._walked:
            self._walked[key] = self._walk_uncached(base, parts)
        return self._walked[key]

    def _walk_uncached(self, base: Path, parts: list[str]) -> list[Path] | None:
        if base not in self._dir_set:
            return None
        files, here = [], base
        for i, part in enumerate(parts):
            package, module = here / part, here / f"{part}.py"
            if package in self._dir_set and (i < len(parts) - 1 or module not in self._file_set):
                if package / "__init__.py" in self._file_set:
                    files.append(package / "__init__.py")
                elif i == len(parts) - 1:  # a namespace package: nothing runs
                    return files or None
                here = package
            elif module in self._file_set and i == len(parts) - 1:
                return files + [module]
            else:
                return None
        return files

    def edges_of(self, path: Path) -> list[Edge]:
        env, dirs = self.env(path), self.search_path(path)
        edges: list[Edge] = []

        def add(targets, line):
            edges.extend(Edge(t, line) for t in targets)

        for node in self.nodes(path):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(self.module_files(alias.name, path, dirs), node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = path.parent
                    for _ in range(node.level - 1):
                        base = base.parent
                    parts = node.module.split(".") if node.module else []
                    found = self._walk(base, parts) if parts else []
                    if found is None:
                        continue
                    add(found, node.lineno)
                    here = (base / Path(*parts)) if parts else base
                    for alias in node.names:
                        add([here / f"{alias.name}.py"] if (
                            here / f"{alias.name}.py") in self._file_set else [], node.lineno)
                    continue
                found = self.module_files(node.module, path, dirs)
                add(found, node.lineno)
                for alias in node.names:  # `from package import module`
                    sub = self.module_files(f"{node.module}.{alias.name}", path, dirs)
                    add(sub[len(found):] if sub[:len(found)] == found else [], node.lineno)
            elif isinstance(node, ast.Call):
                add(self._call_import(node, env, path, dirs), node.lineno)
        # a module's own packages are imported before it: their __init__ is no edge of its
        return [e for e in edges if e.target != path and e.target in self._file_set
                and not (e.target.name == "__init__.py" and e.target.parent in path.parents)]

    def _call_import(self, node: ast.Call, env: dict, path: Path, dirs) -> list[Path]:
        name = _call_name(node.func)
        args = [self.value(a, env, path) for a in node.args[:2]]
        if name in ("importlib.import_module", "import_module", "__import__") and args and (
                isinstance(args[0], str)) and not (len(node.args) > 1 and name != "__import__"):
            return self.module_files(args[0], path, dirs)
        if len(args) == 2 and all(isinstance(a, str) for a in args) and "/" not in args[1]:
            lesson = self.repo / "solutions" / args[0]
            if lesson in self.lessons:
                for candidate in (lesson / f"{args[1]}.py", lesson / "figures" / f"{args[1]}.py"):
                    if candidate in self._file_set:
                        return [candidate]
        return []

    # --- circles ---------------------------------------------------------------------------

    def cycles(self) -> list[list[Edge]]:
        """One circle per group of files that import each other (a strongly connected
        component): its edges in order, starting at the group's first file."""
        graph = {p: sorted({e.target for e in es}) for p, es in self.edges.items()}
        found = []
        for group in _strongly_connected(graph):
            if len(group) < 2:
                continue
            members = set(group)
            start = min(group)
            found.append(self._circle_through(start, members))
        return found

    def _circle_through(self, start: Path, members: set[Path]) -> list[Edge]:
        """The shortest way from ``start`` back to itself inside ``members`` (breadth first)."""
        came: dict[Path, tuple[Path, Edge]] = {}
        queue, seen = [start], {start}
        while queue:
            node = queue.pop(0)
            for edge in sorted(self.edges[node], key=lambda e: (str(e.target), e.line)):
                if edge.target not in members:
                    continue
                if edge.target == start:
                    path = [(node, edge)]
                    while node != start:
                        node, prev_edge = came[node]
                        path.append((node, prev_edge))
                    return [Edge(src, e.line) for src, e in reversed(path)]
                if edge.target not in seen:
                    seen.add(edge.target)
                    came[edge.target] = (node, edge)
                    queue.append(edge.target)
        raise AssertionError(f"no circle through {start}")  # a component always has one

    def describe(self, circle: list[Edge]) -> str:
        """``a.py:12 -> b.py:40 -> a.py``: each file with the line of its import of the next."""
        rel = [f"{e.target.relative_to(self.repo)}:{e.line}" for e in circle]
        return " -> ".join(rel + [str(circle[0].target.relative_to(self.repo))])


_KINDS = (ast.Import, ast.ImportFrom, ast.Call, ast.Assign, ast.For)


def _call_name(node: ast.AST) -> str:
    """``a.b.c`` for the expression ``a.b.c`` (names and attributes only), else ``""``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _flat(value):
    if isinstance(value, tuple):
        for item in value:
            yield from _flat(item)
    elif value is not UNKNOWN:
        yield value


def _strongly_connected(graph: dict[Path, list[Path]]) -> list[list[Path]]:
    """Tarjan's algorithm, without recursion."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    on_stack: set[Path] = set()
    stack: list[Path] = []
    groups = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    groups.append(group)
    return groups


# --- the tests -------------------------------------------------------------------------------

def test_no_module_of_the_course_imports_itself_in_a_circle():
    graph = ImportGraph()
    # the walk sees the course: lessons reach dpt, tests reach lessons through their loader
    tops = {(src.relative_to(graph.repo).parts[0], e.target.relative_to(graph.repo).parts[0])
            for src, edges in graph.edges.items() for e in edges}
    assert {("solutions", "dpt"), ("tests", "solutions"), ("benchmarks", "solutions")} <= tops, (
        f"the walk found no import from lessons into dpt, or from tests or benchmarks into "
        f"lessons: it no longer reads the course's imports ({sorted(tops)})")
    circles = sorted(graph.describe(c) for c in graph.cycles())
    assert not circles, (
        f"{len(circles)} import circle(s), each file with the line of its import of the next:\n"
        + "\n".join("  " + c for c in circles)
        + "\nA lesson's file must not import what imports it: plumbing that records or runs "
          "the student's code takes it as an argument or wraps it from outside.")


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_walk_follows_the_course_s_ways_of_importing(tmp_path):
    """Each idiom the course uses to reach another file is followed: a sibling by bare name
    (lazily too), a package module, a relative import, a folder added to sys.path through a
    name (imported from another module too), a loop and ``sys.path[:0]``, a lesson opened by a
    notebook, a lesson module named to a loader (from a test, a benchmark or another lesson),
    and ``import_module``; the standard library, a benchmark's bare name of a lesson module
    and a file's import of itself are not edges; a test file that nothing imports is not
    read."""
    _write(tmp_path, {
        "solutions/01_a/one.py": "import dpt\nimport os\nimport one\nfrom two import f\n",
        "solutions/03_c/later.py": ("from dpt.lessons import load\n"
                                    'f = load("01_a", "two", __file__).f\n'),
        "solutions/01_a/two.py": "def f():\n    import three\n",
        "solutions/01_a/three.py": ("import sys\nfrom pathlib import Path\n"
                                    "HERE = Path(__file__).resolve().parent\n"
                                    'sys.path.append(str(HERE.parent / "02_b"))\n'
                                    "import other\n"),
        "solutions/02_b/other.py": ("import sys\nfrom pathlib import Path\n"
                                    'for _l in ("01_a",):\n'
                                    "    sys.path.append(str(Path(__file__).resolve()"
                                    ".parents[1] / _l))\nimport one\n"),
        "solutions/02_b/tutorial.py": ('from dpt.notebook import use_lesson\nuse_lesson("02_b")'
                                       "\nimport other\n"),
        "dpt/__init__.py": "",
        "dpt/notebook.py": "",
        "dpt/lessons.py": "",
        "dpt/x.py": "from . import y\n",
        "dpt/y.py": "from .z import g\n",
        "dpt/z.py": "import dpt.x\n",
        "tests/__init__.py": "",
        "tests/lessons.py": "from pathlib import Path\nREPO = Path(__file__).resolve().parent.parent\n",
        "tests/l01/rank_fns.py": ('from tests.lessons import load\nLESSON = "01_a"\n'
                                  'def fn():\n    load(LESSON, "two")\n'),
        "tests/l01/test_a.py": "import broken syntax, never read\n",
        "benchmarks/__init__.py": "",
        "benchmarks/methods_a.py": ('from dpt.lessons import load\nimport one\n'
                                    'def m():\n    load("01_a", "two", "solutions").f()\n'),
        "benchmarks/m.py": ("import sys\nfrom tests.lessons import REPO\n"
                            'sys.path[:0] = [str(REPO / "tools")]\nimport tool\n'),
        "tools/tool.py": 'import importlib\nimportlib.import_module("benchmarks.m")\n',
    })
    graph = ImportGraph(tmp_path)

    def targets(name):
        return sorted(str(e.target.relative_to(graph.repo)) for e in graph.edges[
            (graph.repo / name).resolve()])

    assert targets("solutions/01_a/one.py") == ["dpt/__init__.py", "solutions/01_a/two.py"]
    assert targets("solutions/03_c/later.py") == [
        "dpt/__init__.py", "dpt/lessons.py", "solutions/01_a/two.py"]
    assert targets("benchmarks/methods_a.py") == [
        "dpt/__init__.py", "dpt/lessons.py", "solutions/01_a/two.py"]
    assert targets("solutions/01_a/two.py") == ["solutions/01_a/three.py"]
    assert targets("solutions/01_a/three.py") == ["solutions/02_b/other.py"]
    assert targets("solutions/02_b/other.py") == ["solutions/01_a/one.py"]
    assert targets("solutions/02_b/tutorial.py") == [
        "dpt/__init__.py", "dpt/notebook.py", "solutions/02_b/other.py"]
    assert targets("dpt/x.py") == ["dpt/y.py"]
    assert targets("dpt/y.py") == ["dpt/z.py"]
    assert targets("dpt/z.py") == ["dpt/x.py"]
    assert targets("tests/l01/rank_fns.py") == ["solutions/01_a/two.py", "tests/lessons.py"]
    assert targets("benchmarks/m.py") == ["tests/__init__.py", "tests/lessons.py",
                                          "tools/tool.py"]
    assert targets("tools/tool.py") == ["benchmarks/__init__.py", "benchmarks/m.py"]
    assert (tmp_path / "tests/l01/test_a.py").resolve() not in graph.edges
    described = sorted(graph.describe(c) for c in graph.cycles())
    assert described == [
        "benchmarks/m.py:4 -> tools/tool.py:2 -> benchmarks/m.py",
        "dpt/x.py:1 -> dpt/y.py:1 -> dpt/z.py:1 -> dpt/x.py",
        "solutions/01_a/one.py:4 -> solutions/01_a/two.py:2 -> solutions/01_a/three.py:5 -> "
        "solutions/02_b/other.py:5 -> solutions/01_a/one.py",
    ], described
