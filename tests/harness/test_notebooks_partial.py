"""A student with part of a lesson done: each notebook runs to the end, every cell doing all
it can, and saying what it skipped.

Each ``with needs_tasks("05.2", "05.3"):`` block of a notebook names the tasks it uses. The
trees under test are built here from solutions/: in a lesson, the tasks up to some point are
solved, every later one is the stub that raises ``NotImplementedError("Task NN.K: ...")``.
From the blocks' own declarations each notebook gets the shortest such prefixes that unlock
each block, and runs once per prefix, up to the last cell that prefix unlocks: every block
then runs once with just its own tasks done, and must not skip. With no task done at all the
notebooks run, to the end, against the untouched ``exercises/``; with every task done,
tests/harness/test_notebooks.py runs them against solutions/.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from functools import cache
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.lessons import REPO

sys.path.insert(0, str(REPO / "tools"))
import make_exercises as gen  # noqa: E402

NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SKIP_LINE = re.compile(r"skipped: this cell needs (Task \d\d\.\d+[a-z]?)")
CELL_LIMIT_S = 600  # a cell that runs this long is stuck
REPORT = "BLOCKS "
REPORT_CELL = f"import json as _j, dpt.notebook as _n\nprint({REPORT!r} + _j.dumps(_n.BLOCKS))"


def _order(task: str) -> tuple:
    major, minor, letter = re.fullmatch(r"(\d\d)\.(\d+)([a-z]?)", task).groups()
    return int(major), int(minor), letter


@cache
def lesson_tasks(lesson: str) -> tuple[str, ...]:
    """The tasks of a lesson's files in solutions/, in order (carried ones included)."""
    found = set()
    for py in (REPO / "solutions" / lesson).glob("*.py"):
        found.update(gen.strip_solutions(py.read_text(), str(py))[1])
    return tuple(sorted(found, key=_order))


def needs_calls(source: str) -> list[tuple[int, list | None]]:
    """Each ``needs_tasks(...)`` call of a cell: (line, its task ids), or (line, None) when an
    argument is not a literal string."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "needs_tasks":
            literal = all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                          for a in node.args) and all(
                k.arg in ("earlier", "reference", "show") for k in node.keywords)
            calls.append((node.lineno, [a.value.removeprefix("Task ") for a in node.args]
                          if literal else None))
    return calls


@cache
def code_cells(path: Path) -> tuple[str, ...]:
    nb = nbformat.read(path, as_version=4)
    return tuple(c.source for c in nb.cells if c.cell_type == "code")


def unlocking_prefixes(path: Path) -> dict[int, int]:
    """{k: the last code cell with a block that needs tasks[k]}: for each k, the blocks whose
    last task is tasks[k] run first when the lesson's first k + 1 tasks are done. Without the
    empty and the full prefix (the untouched tree and solutions/ run those)."""
    tasks = lesson_tasks(path.stem)
    last_cell = {}
    for i, source in enumerate(code_cells(path)):
        for _, named in needs_calls(source):
            if named:
                k = max(tasks.index(t) for t in named)
                if k < len(tasks) - 1:
                    last_cell[k] = i
    return dict(sorted(last_cell.items()))


def _names(source: str) -> tuple[set[str], set[str], bool] | None:
    """(names a cell binds, names it reads from earlier cells, whether it binds only imports
    and definitions), or None when it is not plain Python (a magic).

    A name the cell reads before it binds it (``model = model.to(device)``) comes from an
    earlier cell; a loop's or a comprehension's variables, a ``with ... as`` name and a
    function's parameters are its own."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    own = set()
    for node in ast.walk(tree):
        targets = ([node.target] if isinstance(node, (ast.comprehension, ast.For)) else
                   [i.optional_vars for i in node.items if i.optional_vars]
                   if isinstance(node, ast.With) else [])
        for target in targets:
            own.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        if isinstance(node, ast.arg):
            own.add(node.arg)
    def own_nodes(stmt):  # a statement's expressions, not the statements nested in it
        todo = list(ast.iter_child_nodes(stmt))
        while todo:
            node = todo.pop()
            if not isinstance(node, ast.stmt):
                yield node
                todo.extend(ast.iter_child_nodes(node))

    bound, read, assigned = set(), set(), False
    # statement by statement in the order they appear; within one the right side is read first
    for stmt in sorted((n for n in ast.walk(tree) if isinstance(n, ast.stmt)),
                       key=lambda n: (n.lineno, n.col_offset)):
        loads, stores = set(), set()
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            stores.update((a.asname or a.name).split(".")[0] for a in stmt.names)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stores.add(stmt.name)
        for node in own_nodes(stmt):
            if isinstance(node, ast.Name):
                (loads if isinstance(node.ctx, ast.Load) else stores).add(node.id)
                assigned |= not isinstance(node.ctx, ast.Load)
        read |= loads - bound - own
        bound |= stores
    return bound, read, not assigned


def cells_for(sources: list[str], targets: set[int]) -> list[int]:
    """The cells to run, in order, for the ``targets`` to run as in the whole notebook: the
    targets; the cells that bind a name a kept cell reads (the latest binding before it, and
    what that one reads, transitively); the setup before the first ``needs_tasks`` block
    (cells that only import and call, such as ``use_lesson``); cells that are not plain
    Python (a magic).

    A prefix run then leaves out the parts of a lesson its blocks do not read: lesson 10's
    hang clinic no longer retraces part 1 for every prefix. What a target reads through a
    file, not a name, is not followed: the run then fails loudly (a ``FileNotFoundError``, or
    a skip of a block whose tasks are done), so a missed dependency cannot pass unseen.
    """
    parsed = [_names(s) for s in sources]
    first_block = min((i for i, (s, p) in enumerate(zip(sources, parsed))
                       if p is not None and needs_calls(s)), default=len(sources))
    keep = set(targets) | {i for i, p in enumerate(parsed)
                           if p is None or (i < first_block and p[2])}
    todo = sorted(keep)
    while todo:
        i = todo.pop()
        if parsed[i] is None:
            continue
        for name in parsed[i][1]:
            for j in range(i - 1, -1, -1):
                if parsed[j] is not None and name in parsed[j][0]:
                    if j not in keep:
                        keep.add(j)
                        todo.append(j)
                    break
    return sorted(i for i in keep if i <= max(targets))


def _keep(text: str, solved: set[str]) -> str:
    """``text`` with every solution block of a task outside ``solved`` stubbed, as
    make_exercises stubs it."""
    out, inside, keeping = [], False, False
    for line in text.splitlines(keepends=True):
        m = gen.BEGIN.match(line)
        if m:
            inside, keeping = True, m["task"] in solved
            if not keeping:
                hint = m["hint"].replace("\\", "\\\\").replace('"', '\\"')
                message = (gen.carried_stub(m["task"]) if gen.COPY_HINT.fullmatch(m["hint"])
                           else f'Task {m["task"]}: {hint}')
                out.append(f'{m["indent"]}raise NotImplementedError("{message}")\n')
            continue
        if gen.END.match(line):
            inside = keeping = False
            continue
        if not inside or keeping:
            out.append(line)
    return "".join(out)


def build_tree(root: Path, lesson: str, solved: set[str]) -> Path:
    """A lesson tree under ``root`` holding ``lesson`` with only the ``solved`` tasks solved;
    the other lessons solved (a lesson may reuse an earlier one's code: 09 uses 08's)."""
    tree = root / "tree"
    shutil.copytree(REPO / "solutions", tree, ignore=shutil.ignore_patterns("__pycache__"))
    for py in (tree / lesson).glob("*.py"):
        if py.name != gen.NOTEBOOK_SOURCE:
            py.write_text(_keep(py.read_text(), solved))
    return tree


def run_notebook(path: Path, tree: Path, monkeypatch, only: list[int] | None = None):
    """Run the notebook's code cells (those in ``only``, else all) against ``tree``; return
    each cell's printed text ("" for a cell not run) and what every ``needs_tasks`` block
    did."""
    monkeypatch.setenv("DPT_TARGET", str(tree))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    sources = code_cells(path)
    run = list(range(len(sources))) if only is None else only
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in [*(sources[i] for i in run), REPORT_CELL]]
    NotebookClient(nb, timeout=CELL_LIMIT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    ran = ["".join(out.get("text", "") for out in cell.get("outputs", [])
                   if out.get("output_type") == "stream") for cell in nb.cells]
    report = ran.pop().split(REPORT, 1)[1]
    texts = [""] * len(sources)
    for i, text in zip(run, ran):
        texts[i] = text
    return texts, json.loads(report)


def check_blocks(lesson: str, solved: set[str], texts: list[str], blocks: list[dict]) -> None:
    """No block whose tasks are all done skipped (but for GPUs this machine lacks), and no
    skip names a task that is done or belongs to a later lesson."""
    done = {f"Task {t}" for t in solved}
    for i, text in enumerate(texts):
        for task in SKIP_LINE.findall(text):
            assert task not in done, f"code cell {i} skipped {task}, which is done:\n{text}"
            assert task[5:7] <= lesson[:2], f"code cell {i} skipped a later lesson's {task}"
    wrong = [b for b in blocks if b["skipped"] and "GPU" not in b["skipped"]
             and set(b["tasks"]) <= done]
    shown = "\n".join(t for t in texts if "skipped:" in t)
    assert not wrong, (f"blocks whose tasks are all done ({sorted(solved)}) were skipped: "
                       f"{wrong}. A block must name every task it uses, those of the cells "
                       f"whose results it reads included. The skips:\n{shown}")


# ------------------------------------------------------------------ what the notebooks declare

@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_block_names_tasks_of_its_lesson(path):
    tasks = lesson_tasks(path.stem)
    for i, source in enumerate(code_cells(path)):
        for line, named in needs_calls(source):
            where = f"{path.name}, code cell {i}, line {line}"
            assert named is not None, (
                f"{where}: needs_tasks takes the task numbers as literal strings, "
                'needs_tasks("05.2", "05.3"), so that the tests can read them')
            unknown = [t for t in named if t not in tasks]
            assert not unknown, (f"{where}: needs_tasks names {unknown}, which are not tasks of "
                                 f"{path.stem} ({', '.join(tasks) or 'none'})")


def test_the_prefixes_unlock_something_in_the_notebooks_with_tasks():
    # the declarations are read: a notebook whose blocks name nothing would test nothing here
    with_prefixes = [p.stem for p in NOTEBOOKS if unlocking_prefixes(p)]
    assert {"01_single_device", "02_data_parallel", "05_ddp_from_scratch"} <= set(with_prefixes)
    k = lesson_tasks("05_ddp_from_scratch").index
    # naive and overlapped DDP are compared and drawn before bucketing exists
    assert {k("05.3"), k("05.5")} <= set(unlocking_prefixes(REPO / "notebooks" /
                                                            "05_ddp_from_scratch.ipynb"))


def test_a_prefix_runs_what_its_blocks_read_and_the_setup_not_the_other_parts():
    sources = [
        "from dpt.notebook import use_lesson\nuse_lesson('10')",  # 0: setup: imports, calls
        "import traces as tr\nimport os",                     # 1: imports: setup
        "ranks = tr.run_traces()",                             # 2: part 1's expensive run
        "with needs_tasks('10.1'):\n    events = tr.read(ranks)",  # 3: part 1
        "%matplotlib inline",                                  # 4: not Python: kept
        "import hang_clinic as hc",                            # 5: part 4
        "cases = [c for c in hc.CASES]",                       # 6 (c is its own)
        "print(hc.demo())",                                    # 7: a demo nobody reads
        "with needs_tasks('10.11'):\n    print(hc.run(cases))",  # 8: the target
        "with needs_tasks('10.12'):\n    print(hc.run(cases))",  # 9: after the target
        "c = 1",                                               # 10
    ]
    assert cells_for(sources, {8}) == [0, 1, 4, 5, 6, 8]  # 1: imports only, before any block
    assert cells_for(sources, {3}) == [0, 1, 2, 3]
    # a name bound again is read from its latest binding, and what that one reads follows
    assert cells_for(["a = 1", "b = 2", "a = b", "print(a)"], {3}) == [1, 2, 3]
    # read before bound: from the earlier cell; a loop's variable bound before it is read
    assert cells_for(["m = 1", "m = m + 1", "for m in range(2):\n    print(m)"], {1, 2}) == [0, 1, 2]
    assert cells_for(["m = 1", "for m in range(2):\n    print(m)"], {1}) == [1]


def test_a_built_tree_has_exactly_its_prefix_solved(tmp_path):
    lesson = "06_mixed_precision"  # its tasks include ones carried from lessons 01 and 03
    tasks = lesson_tasks(lesson)
    solved = set(tasks[:tasks.index("06.1") + 1])
    tree = build_tree(tmp_path, lesson, solved)
    text = "".join(p.read_text() for p in (tree / lesson).glob("*.py"))
    stubs = set(re.findall(r'NotImplementedError\("Task (\d\d\.\d+[a-z]?)', text))
    assert stubs == set(tasks) - solved, (sorted(stubs), sorted(solved))


# ------------------------------------------------------------------ the notebooks, run

PREFIX_CASES = [(path, k, upto) for path in NOTEBOOKS
                for k, upto in unlocking_prefixes(path).items()]


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path, k, upto", PREFIX_CASES,
                         ids=[f"{p.stem}-upto-{lesson_tasks(p.stem)[k]}"
                              for p, k, _ in PREFIX_CASES])
def test_each_block_runs_with_just_its_own_tasks_done(path, k, upto, tmp_path, monkeypatch):
    lesson = path.stem
    solved = set(lesson_tasks(lesson)[:k + 1])
    last = lesson_tasks(lesson)[k]
    sources = code_cells(path)
    targets = {i for i, source in enumerate(sources) for _, named in needs_calls(source)
               if named and max(named, key=_order) == last}
    assert targets and max(targets) == upto
    texts, blocks = run_notebook(path, build_tree(tmp_path, lesson, solved), monkeypatch,
                                 cells_for(list(sources), targets))
    check_blocks(lesson, solved, texts, blocks)
    newly = [b for b in blocks
             if b["tasks"] and max((t.removeprefix("Task ") for t in b["tasks"]), key=_order) == last]
    assert newly, f"no block that needs Task {last} ran"


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_to_the_end_on_the_untouched_exercises(path, monkeypatch):
    """No task done: cells that need none run, the others skip in one line each. (Notebook
    01 stopped at its loss plot: `maximum size for tensor at dimension 0 is 0 but size is
    20`, the empty history of a training that was skipped.)"""
    tree = REPO / "exercises"
    texts, blocks = run_notebook(path, tree, monkeypatch)
    check_blocks(path.stem, set(), texts, blocks)
    if lesson_tasks(path.stem):
        assert any(b["skipped"] for b in blocks), "nothing was skipped with no task done"


# ------------------------------------------------------------------ needs_tasks itself

def test_needs_tasks_skips_a_pending_task_and_what_depends_on_it(monkeypatch, capsys):
    import dpt.notebook as nbk

    monkeypatch.setattr(nbk, "_SKIPPED", [])
    monkeypatch.setattr(nbk, "BLOCKS", [])
    with nbk.needs_tasks():
        raise NotImplementedError("Task 05.3: register the hooks")
    with nbk.needs_tasks():  # a rank's traceback, as run_distributed or mp.spawn report it
        raise RuntimeError('rank 1 failed:\n...\nNotImplementedError: Task 05.4: buckets')
    with nbk.needs_tasks():  # two ranks' tracebacks interleaved in one log (seen under load)
        raise RuntimeError('the run ended before its first snapshot:\n  raise Not'
                           'ImplementedError("Task 04.1: read")\nNotImplementedErrorNotImpl'
                           'ementedError: : Task 04.1: read the variablesTask 04.1: read the')
    with nbk.needs_tasks():
        undefined_name  # noqa: B018, F821 - what a skipped cell would have defined
    lines = capsys.readouterr().out.strip().splitlines()
    assert [SKIP_LINE.search(ln).group(1) for ln in lines] == ["Task 05.3", "Task 05.4",
                                                             "Task 04.1", "Task 05.3"]
    assert [b["skipped"] for b in nbk.BLOCKS] == ["Task 05.3", "Task 05.4", "Task 04.1",
                                                 "Task 05.3"]
    # A message that only mentions a task, with no stub's NotImplementedError, is a real error.
    with pytest.raises(RuntimeError), nbk.needs_tasks():
        raise RuntimeError("Task 05.3: the loss is nan after 3 steps")
    with pytest.raises(ValueError), nbk.needs_tasks():
        raise ValueError("a real bug is not hidden")


def test_before_any_skip_a_name_error_is_a_real_error(monkeypatch):
    import dpt.notebook as nbk

    monkeypatch.setattr(nbk, "_SKIPPED", [])
    with pytest.raises(NameError), nbk.needs_tasks():
        undefined_name  # noqa: B018, F821


def test_a_block_that_names_a_skipped_task_is_skipped_whatever_it_raises(monkeypatch, capsys):
    """Notebook 01's loss plot: the training cell skipped Task 01.1 and left an empty history,
    and the plot stopped the notebook with `RuntimeError: maximum size for tensor at dimension
    0 is 0 but size is 20`. A block that names the skipped task is skipped with it."""
    import torch

    import dpt.notebook as nbk

    monkeypatch.setattr(nbk, "_SKIPPED", [])
    monkeypatch.setattr(nbk, "BLOCKS", [])
    history = []
    with nbk.needs_tasks("01.1"):
        raise NotImplementedError("Task 01.1: one optimization step")
    with nbk.needs_tasks("01.1"):
        torch.tensor(history).unfold(0, 20, 1)
    out = capsys.readouterr().out
    assert out.count("skipped: this cell needs Task 01.1") == 2, out
    with pytest.raises(RuntimeError), nbk.needs_tasks("01.2"):  # it names another task
        torch.tensor(history).unfold(0, 20, 1)
    # solved and re-run: the task is done now, and its blocks' errors are errors again
    with nbk.needs_tasks("01.1"):
        history.extend([1.0] * 20)
    with pytest.raises(RuntimeError), nbk.needs_tasks("01.1"):
        torch.tensor(history).unfold(0, 40, 1)


@pytest.mark.parametrize("bad", ["5.2", "Task 05", "05.2 05.3", 52])
def test_needs_tasks_refuses_a_task_it_cannot_read(bad):
    from dpt.notebook import needs_tasks

    with pytest.raises(ValueError, match=r"^error: needs_tasks\(.*like needs_tasks\(\"05.2\""):
        with needs_tasks(bad):
            pass


def test_scripts_started_from_a_notebook_do_not_inherit_a_launch(monkeypatch):
    # After a ddp_notebook cell the kernel holds these; a script inheriting LOCAL_RANK waits
    # for ranks that nobody starts (notebook 07's Fabric run hung that way).
    from dpt.notebook import script_env

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "12345")
    env = script_env(OMP_NUM_THREADS="1")
    assert "LOCAL_RANK" not in env and "MASTER_PORT" not in env
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == __import__("os").environ["PATH"]


def _gpus(monkeypatch, n: int) -> None:
    """This process sees ``n`` CUDA GPUs (0: none), as far as the notebook helpers ask."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_a_cell_that_needs_more_gpus_is_skipped_in_one_line(monkeypatch, capsys):
    import dpt.notebook as nbk

    monkeypatch.setattr(nbk, "_SKIPPED", [])
    ran = []
    for have in (0, 1, 2):
        _gpus(monkeypatch, have)
        with nbk.needs_tasks():
            nbk.needs_gpus(2)
            ran.append(have)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == ["skipped: this cell needs 2 GPUs, this machine has none",
                     "skipped: this cell needs 2 GPUs, this machine has 1"]
    assert ran == [2], "only the machine with 2 GPUs runs the rest of the cell"
    with nbk.needs_tasks():  # what the skipped cell would have made is missing: skipped too
        undefined_name  # noqa: B018, F821
    assert capsys.readouterr().out.startswith("skipped: this cell needs 2 GPUs (it uses")


def test_the_fork_cell_forks_only_while_cuda_is_untouched(monkeypatch):
    # Notebook 07's ddp_notebook cell: a fork after CUDA was initialised in the kernel fails in
    # every child ("Cannot re-initialize CUDA in forked subprocess"); the cell must see it.
    import torch

    from dpt.notebook import fork_blocker

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert fork_blocker() is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    why = fork_blocker()
    assert why and "CUDA" in why and "restart the kernel" in why


@pytest.mark.parametrize("gpus, share, forced, expected, lightning", [
    (0, "1", "auto", "cpu", "cpu"),     # no GPU: the variable changes nothing
    (1, "", "auto", "cpu", "cpu"),      # Colab: 2 ranks, 1 GPU, NCCL needs one each
    (1, "1", "auto", "cuda", "cpu"),    # ranks share the GPU with gloo; Lightning cannot
    (2, "", "auto", "cuda", "cuda"),    # a GPU per rank
    (2, "", "gloo", "cpu", "cpu"),      # the suite keeps its ranks on the CPU
    (8, "", "auto", "cuda", "cuda"),
])
def test_ranks_device_follows_the_gpus_the_share_mode_and_the_forced_backend(
        monkeypatch, gpus, share, forced, expected, lightning):
    from dpt.notebook import ranks_device

    _gpus(monkeypatch, gpus)
    monkeypatch.setenv("DPT_SHARE_GPU", share)
    monkeypatch.setenv("DPT_TEST_BACKEND", forced)
    assert ranks_device(2) == expected
    assert ranks_device(2, share=False) == lightning
