"""What a notebook's first cell calls: pick the lesson tree and put the lesson on sys.path
(and the repository root, where the `benchmarks` package is).

Students run ``notebooks/NN_*.ipynb`` against their own ``exercises/``. The tests run the same
notebook against another tree by setting ``DPT_TARGET`` (``solutions`` or a path).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

from dpt.data import REPO_ROOT
from dpt.lessons import tree_of


def use_lesson(lesson: str, default_tree: str = "exercises") -> Path:
    folder = tree_of(os.environ.get("DPT_TARGET", default_tree)) / lesson
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist; set DPT_TARGET to a lesson tree")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    if str(REPO_ROOT) not in sys.path:  # the course's `benchmarks` package (lesson 14 reads it)
        sys.path.append(str(REPO_ROOT))
    os.environ.setdefault("TQDM_MININTERVAL", "5")
    _autoreload()
    print(f"lesson code from: {folder.relative_to(REPO_ROOT) if folder.is_relative_to(REPO_ROOT) else folder}")
    return folder


def _autoreload() -> bool:
    """In Jupyter, re-import edited lesson files before every cell (IPython's autoreload).

    Without it the kernel keeps the module it imported first, so a fixed exercise still raises
    its old NotImplementedError in the notebook while rank processes already run the new code.
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or "autoreload" in getattr(shell, "_dpt_done", ()):
        return False
    shell.run_line_magic("load_ext", "autoreload")
    shell.run_line_magic("autoreload", "2")
    shell._dpt_done = {"autoreload"}
    return True


TASK = re.compile(r"NotImplementedError: (Task \d\d\.\d+[a-z]?)|^(Task \d\d\.\d+[a-z]?)")
# A stub's own message, "Task NN.K: what to do", wherever it sits in the text.
STUB_MESSAGE = re.compile(r"(Task \d\d\.\d+[a-z]?): ")


def pending_task(exc: BaseException) -> str | None:
    """'Task NN.K' when ``exc`` is a task's NotImplementedError, or carries one in its text
    (a rank's traceback, reported by run_distributed, mp.spawn or Lightning's launcher).

    Two ranks that fail at once write their tracebacks into one log, and their last lines can
    interleave ("NotImplementedErrorNotImplementedError: : Task 04.1: ..."). So a text that
    names NotImplementedError anywhere also counts when it holds a stub's message."""
    text = str(exc)
    m = TASK.search(text)
    if m is not None:
        if isinstance(exc, NotImplementedError):
            return m.group(1) or m.group(2)
        if m.group(1):
            return m.group(1)
    if "NotImplementedError" in text:
        stub = STUB_MESSAGE.search(text)
        if stub is not None:
            return stub.group(1)
    return None


def task_message(exc: NotImplementedError) -> str:
    """The message of ``exc`` when it is a task not done yet, for a rank to send back in place
    of its result (so that the other methods of a comparison still run); any other
    NotImplementedError is raised again."""
    if pending_task(exc) is None:
        raise exc
    return str(exc)


_SKIPPED: list[str] = []  # tasks a cell of this kernel found not done yet, in order
# What a cell raises when an earlier, skipped cell did not make what it uses: a variable, a
# dict entry, a list item, or a file (a checkpoint a skipped run would have written).
DEPENDENT = (NameError, KeyError, IndexError, FileNotFoundError)


LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")


def script_env(**extra: str) -> dict[str, str]:
    """The kernel's environment for a script started from a notebook, without launch variables.

    A cell that trained with several processes inside the kernel (Lightning's ``ddp_notebook``,
    say) leaves ``LOCAL_RANK``, ``MASTER_PORT`` and friends in ``os.environ``. A script that
    inherits them believes a launcher started it as one rank of a group, and waits forever for
    the others. Start scripts with ``env=script_env()``.
    """
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(extra)
    return env


def check_run(proc, what: str = "the script") -> None:
    """Raise if a script run with ``subprocess`` failed, with the end of its output.

    Inside ``needs_tasks()`` a failure caused by a task not done yet (its traceback names it)
    becomes a ``skipped:`` line; any other failure shows what the script printed.
    """
    if proc.returncode != 0:
        out = ((proc.stdout or "") + (proc.stderr or ""))[-3000:]
        raise RuntimeError(f"{what} exited with {proc.returncode}:\n{out}")


# The lesson benchmarks (benchmarks/bench_lNN_*.py) write here; git ignores it.
BENCH_RUNS = REPO_ROOT / "benchmarks" / "runs" / "lessons"
# Their committed results, measured on the course's 2-core CPU: shown until you have your own.
BENCH_REFERENCE = REPO_ROOT / "benchmarks" / "reference" / "lessons"


def bench_result(name: str) -> Path:
    """A lesson benchmark's result file (``"l06_precision.json"``), after a line saying whose.

    Yours from ``benchmarks/runs/lessons/`` once you have run the lesson's benchmark script,
    until then the committed reference from ``benchmarks/reference/lessons/``.
    ``DPT_BENCH_SHOW=reference`` shows the reference even when you have your own (the website
    does). Raises FileNotFoundError, naming both places, when neither has it.
    """
    mine, reference = BENCH_RUNS / name, BENCH_REFERENCE / name
    if os.environ.get("DPT_BENCH_SHOW") != "reference" and mine.is_file():
        print(f"{name}: your run, {_shown(mine)}")
        return mine
    if not reference.is_file():
        raise FileNotFoundError(f"{name} is in neither {BENCH_RUNS} nor {BENCH_REFERENCE}")
    stem = Path(name).stem
    scripts = [p for p in sorted((REPO_ROOT / "benchmarks").glob("bench_*.py"))
               if stem.startswith(p.stem.removeprefix("bench_"))]
    how = f"`python {_shown(scripts[0])}` measures yours" if scripts else "yours goes to " + str(
        _shown(BENCH_RUNS))
    print(f"{name}: the committed reference, measured on the course's 2-core CPU; {how}")
    return reference


def _shown(path: Path) -> Path:
    return path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path


def dataset_label(name: str) -> str:
    """How a title or a printed line names dataset ``name``: "fashion-mnist" -> "Fashion-MNIST".

    Take ``name`` from what the run was given (its ``--dataset``, the data module's
    ``dataset``), so that a label says what ran."""
    from dpt.data import dataset_info

    dataset_info(name)  # an unknown name is a ValueError naming the choices
    return "-".join(w.upper() if w == "mnist" else w.capitalize() for w in name.split("-"))


class MissingGPUs(Exception):
    """A notebook cell needs more GPUs than this machine has (see :func:`needs_gpus`)."""

    def __init__(self, needed: int, have: int):
        self.needed = needed
        super().__init__(f"skipped: this cell needs {gpus_text(needed)}, this machine has "
                         f"{have or 'none'}")


def gpus_text(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def gpu_count() -> int:
    """CUDA GPUs this kernel can use: 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int) -> None:
    """Stop a cell that needs ``n`` GPUs on a machine with fewer.

    Inside ``with needs_tasks():`` the cell then prints one line, ``skipped: this cell needs
    2 GPUs, this machine has 1``, and the notebook goes on; a later cell that uses what the
    skipped cell would have made is skipped too.
    """
    have = gpu_count()
    if have < n:
        raise MissingGPUs(n, have)


def ranks_device(n: int, *, share: bool = True) -> str:
    """The ``--device`` for a script a notebook starts with ``n`` ranks: ``"cuda"`` or ``"cpu"``.

    The GPUs when there is one per rank (NCCL); ``DPT_TEST_BACKEND=gloo`` keeps the ranks on
    the CPU. (Ranks started by ``run_distributed(backend="auto")`` share too few GPUs on their
    own: ``dpt.ranks.placement`` says where those compute.) With ``DPT_SHARE_GPU=1``
    the ranks share the GPUs (gloo), when ``share`` allows it: Lightning and Fabric put NCCL
    on CUDA, which refuses two ranks on one GPU, so pass ``share=False`` for them.
    Otherwise the CPU, with gloo.
    """
    from dpt.device import shares_gpu

    have = gpu_count()
    if have == 0:
        return "cpu"
    if share and shares_gpu():
        return "cuda"
    forced = os.environ.get("DPT_TEST_BACKEND", "auto")
    return "cuda" if have >= n and forced in ("", "auto", "nccl") else "cpu"


def fork_blocker() -> str | None:
    """Why this kernel must not fork ranks now, or None when it may.

    Lightning's ``ddp_notebook`` forks the kernel. CUDA does not survive a fork: once anything
    in the kernel initialised it (a tensor on the GPU, or a Lightning ``fit`` on a GPU machine,
    even with ``accelerator="cpu"``: it saves the CUDA random state around its sanity check),
    a forked rank that touches CUDA fails with "Cannot re-initialize CUDA in forked
    subprocess", and only a kernel restart undoes it.
    """
    import torch

    if torch.cuda.is_initialized():
        return ("CUDA is already initialised in this kernel, and a forked process cannot use "
                "it: restart the kernel and run this cell before any other training cell")
    return None


TASK_ID = re.compile(r"\d\d\.\d+[a-z]?")
# What every ``needs_tasks`` block of this kernel did, in order: the tasks it names, and the
# reason it was skipped ("Task 05.6", "2 GPUs") or None when it ran to the end.
BLOCKS: list[dict] = []


def _task_names(tasks: tuple[str, ...]) -> list[str]:
    names = []
    for task in tasks:
        bare = task.removeprefix("Task ") if isinstance(task, str) else task
        if not isinstance(bare, str) or not TASK_ID.fullmatch(bare):
            raise ValueError(f"error: needs_tasks({task!r}): name a task by its number, "
                             "like needs_tasks(\"05.2\", \"05.3\")")
        names.append(f"Task {bare}")
    return names


@contextlib.contextmanager
def needs_tasks(*tasks: str, earlier: tuple[str, ...] = (), reference: str | None = None,
                show=None):
    """Run a block of a notebook cell; when it reaches a task not done yet, say which one and
    move on.

    ``with needs_tasks("05.2", "05.3"): ...`` names the tasks the block uses: those its code
    calls, and those of the earlier cells whose results it reads. It lets a student with half
    a lesson done run the notebook to the end: blocks whose tasks are done show their results,
    the others print ``skipped: this cell needs Task NN.K`` instead of a traceback. One block
    per method compared keeps a cell useful before its last task is done.

    A later block that uses what a skipped block would have made is skipped too, naming that
    task: any error of a block that names a task already found not done here, or a NameError,
    KeyError, IndexError or FileNotFoundError after any skip. Before any skip those errors are
    raised as usual. A block that runs to the end marks its tasks done again, so a cell re-run
    after you solved the task starts afresh.

    ``earlier=("08.1",)`` names the tasks of earlier lessons the block runs (lesson 09's table
    calls lesson 08's ``predict_bytes``). When one of them is not done, the block shows
    ``reference`` instead, a file of the course's reference run in
    ``benchmarks/reference/lessons/``, after one line saying so: an image is displayed, a
    ``.json`` or ``.txt`` printed, or ``show(path)`` does it. Without ``reference`` the block
    is skipped, naming the task, as for the lesson's own.
    """
    wanted = _task_names(tasks)
    before = _task_names((earlier,) if isinstance(earlier, str) else tuple(earlier))
    if reference is not None and not before:
        raise ValueError("error: needs_tasks(reference=...) is shown in place of an earlier "
                         "lesson's task: name them, earlier=(\"08.1\",)")
    record = {"tasks": wanted, "skipped": None}
    if before:
        record.update(earlier=before, reference=None)
    BLOCKS.append(record)
    try:
        yield
    except MissingGPUs as exc:
        record["skipped"] = gpus_text(exc.needed)
        _SKIPPED.append(record["skipped"])
        print(exc)
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is a pending task
        task = pending_task(exc)
        if task is None and _SKIPPED:
            # what an earlier skipped block would have made is missing, or is half made (an
            # empty history, a model nobody trained)
            earlier = [t for t in wanted if t in _SKIPPED]
            if earlier or isinstance(exc, DEPENDENT):
                record["skipped"] = (earlier or _SKIPPED)[0]
                print(f"skipped: this cell needs {record['skipped']} (it uses what an earlier "
                      f"skipped cell makes: {type(exc).__name__}: {str(exc)[:200]})")
                return
        if task is None:
            raise
        if task not in _SKIPPED:
            _SKIPPED.append(task)
        if task in before and reference is not None:
            record["reference"] = show_reference(task, reference, show)
            return
        record["skipped"] = task
        print(f"skipped: this cell needs {task}, which is not done yet. Solve it in your "
              "exercises/ folder, then re-run this cell.")
    else:
        for task in wanted + before:
            while task in _SKIPPED:
                _SKIPPED.remove(task)


def show_reference(task: str, name: str, show=None) -> str:
    """Show the committed reference result ``name`` in place of what ``task``, an earlier
    lesson's task not done in this tree, would have made; one line says so. Returns the path
    shown, from the repository root."""
    path = BENCH_REFERENCE / name
    if not path.is_file():
        raise FileNotFoundError(f"the reference {name} is not in {_shown(BENCH_REFERENCE)}")
    print(f"{task} is not done in your tree: showing the course's reference run "
          f"({_shown(path)})")
    if show is not None:
        show(path)
    elif path.suffix in (".png", ".jpg", ".svg"):
        from IPython.display import SVG, Image, display

        display(SVG(filename=str(path)) if path.suffix == ".svg" else Image(filename=str(path)))
    elif path.suffix == ".json":
        import json

        print(json.dumps(json.loads(path.read_text()), indent=1))
    else:
        print(path.read_text().rstrip())
    return str(_shown(path))
