"""Every lesson notebook runs top to bottom against the target tree.

How long a notebook takes is measured, not asserted: the time is printed (and kept as a test
property) so a slow notebook shows, while a loaded machine cannot fail a correct notebook. The
limits below only stop a notebook that hangs.
"""

import os
import time

import nbformat
import pytest
from nbclient import NotebookClient

from tests.lessons import REPO, target

NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CELL_LIMIT_S = 600  # a cell that runs this long is stuck (the slowest takes ~1 min when idle)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, monkeypatch, record_property):
    monkeypatch.setenv("DPT_TARGET", str(target()))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel draws inline
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_LIMIT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.monotonic()
    client.execute()
    elapsed = time.monotonic() - start
    record_property("seconds", round(elapsed, 1))
    print(f"{path.name}: {elapsed:.0f} s")
    images = sum("image/png" in out.get("data", {}) for cell in nb.cells
                 if cell.cell_type == "code" for out in cell.get("outputs", []))
    assert images >= 1, f"{path.name} drew no plot"
    assert os.environ["DPT_TARGET"]


# ------------------------------------------------ a GPU machine, faked inside the kernel

# Run as a cell right after a notebook's setup cell: the kernel then sees one CUDA GPU, and
# CUDA behaves as it does across a fork. On a GPU machine a training step on the CPU
# initialises CUDA: torch's optimizers ask torch.accelerator.current_stream() whether a CUDA
# graph is being captured, and Lightning's fit saves the CUDA random state
# (torch.cuda.get_rng_state_all). A process forked after that fails on its first such call.
FAKE_ONE_GPU = '''
import os

import torch

_cuda = {"initialised": False, "forked_after_init": False}


def _fake_cuda_init():
    if _cuda["forked_after_init"]:
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
                           "multiprocessing, you must use the 'spawn' start method")
    _cuda["initialised"] = True


class _FakeStream:
    def is_capturing(self):
        return False


def _fake_current_stream(device=None):
    _fake_cuda_init()
    return _FakeStream()


def _fake_rng_state_all():
    _fake_cuda_init()
    return []


def _fake_after_fork_in_child():
    _cuda["forked_after_init"], _cuda["initialised"] = _cuda["initialised"], False


torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.is_initialized = lambda: _cuda["initialised"]
torch.cuda.get_rng_state_all = _fake_rng_state_all
torch.cuda.set_rng_state_all = lambda states: None
torch.accelerator.current_stream = _fake_current_stream
os.register_at_fork(after_in_child=_fake_after_fork_in_child)
print("faked: one CUDA GPU")
'''
NOTEBOOK_DIR = REPO / "notebooks"
TASK_SKIPPED = "skipped: this cell needs Task"


def _code_cells(name: str) -> list:
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    return [c for c in nb.cells if c.cell_type == "code"]


def _run_cells(cells: list, monkeypatch) -> list[str]:
    """Run ``cells`` in a fresh kernel against the target tree; each cell's printed text."""
    monkeypatch.setenv("DPT_TARGET", str(target()))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) if isinstance(c, str) else
                nbformat.v4.new_code_cell(c.source) for c in cells]
    NotebookClient(nb, timeout=CELL_LIMIT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK_DIR)}}).execute()
    texts = ["".join(out.get("text", "") for out in cell.get("outputs", [])
                     if out.get("output_type") == "stream") for cell in nb.cells]
    if any(TASK_SKIPPED in text for text in texts):
        pytest.skip("the tree under test has tasks to do: these cells skip")
    return texts


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_notebook_07_forks_before_cuda_is_initialised_and_falls_back_after(monkeypatch):
    """On a GPU machine a Lightning fit initialises CUDA in the kernel (even on the CPU), and
    ddp_notebook forks the kernel: its ranks then died ("Cannot re-initialize CUDA in forked
    subprocess"). The fork cell must run before any other fit, and when CUDA is initialised
    anyway (the cell run again) take a route without a fork."""
    code = _code_cells("07_lightning.ipynb")
    fits = [c for c in code if ".fit(" in c.source]  # the cells that train in the kernel
    fork = [c for c in fits if "ddp_notebook" in c.source]
    assert len(fork) == 1 and len(fits) >= 2, "notebook 07 has a fork cell and another fit"
    texts = _run_cells([code[0], FAKE_ONE_GPU, *fits, fork[0]], monkeypatch)
    first_fork = texts[2 + fits.index(fork[0])]
    assert "ddp_notebook, 2 processes:" in first_fork, first_fork
    again = texts[-1]
    assert "restart the kernel" in again and "ddp, 2 processes:" in again, again


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_notebook_08_lightning_fsdp_cell_skips_in_one_line_on_one_gpu(monkeypatch):
    # It asked Lightning for GPUs [0, 1] on a one-GPU machine and stopped the notebook.
    code = _code_cells("08_sharding.ipynb")
    (cell,) = [c for c in code if "lightning_fsdp_trainer" in c.source]
    texts = _run_cells([code[0], FAKE_ONE_GPU, cell], monkeypatch)
    assert texts[-1].strip() == "skipped: this cell needs 2 GPUs, this machine has 1"


# ------------------------------------------------ what the notebooks draw, and how they label it

def _figure_module(lesson: str, name: str):
    """A lesson's figure module from the tree under test (it needs no task of the lesson)."""
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    import draw_figures

    return draw_figures.load(target() / lesson / "figures" / f"{name}.py")


@pytest.mark.tools  # a partly done tree, as test_notebooks_partial.py: make check-tools
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lesson_05_compares_and_times_each_wrapper_whose_tasks_are_done(tmp_path):
    """With tasks 05.1-05.5 done, notebook 05 printed `skipped: this cell needs Task 05.6` for
    the comparison with one process and for the timeline: one missing wrapper stopped them
    all. Each wrapper is now run, or reports its own missing task."""
    import json
    import subprocess
    import sys

    from tests.harness.test_notebooks_partial import build_tree, lesson_tasks

    lesson = "05_ddp_from_scratch"
    tasks = lesson_tasks(lesson)
    tree = build_tree(tmp_path, lesson, set(tasks[:tasks.index("05.5") + 1]))
    code = f"""
import json
import torch
from dpt.lessons import load
from dpt.ranks import run_distributed
scratch_demo = load({lesson!r}, "scratch_demo", {str(tree)!r})
x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
states = run_distributed(scratch_demo.compare_rank, world_size=2, args=(x, y, 2), timeout=120,
                         echo=False)
timeline = run_distributed(scratch_demo.timeline_rank, world_size=2, timeout=120, echo=False,
                           kwargs=dict(width=32, depth=2, steps=3, warmup=1, bucket_cap_mb=0.001))
print("RESULT " + json.dumps({{
    "compare": {{n: v if isinstance(v, str) else "trained" for n, v in states[0].items()}},
    "timeline": {{n: v if isinstance(v, str) else v["step_ms"] for n, v in timeline[0]["runs"].items()}}}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=280, cwd=REPO)
    assert proc.returncode == 0 and "RESULT " in proc.stdout, (
        "one wrapper's missing task (05.6) stopped the comparison of the others:\n"
        + (proc.stdout + proc.stderr)[-2500:])
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    compare, timeline = result["compare"], result["timeline"]
    for name in ("naive", "overlap", "torch DDP"):
        assert compare[name] == "trained", (name, compare[name])
    for name in ("naive", "overlap"):
        assert isinstance(timeline[name], list) and len(timeline[name]) == 3, (
            f"{name}: the timeline keeps the median of the 3 steps asked for: {timeline[name]}")
    for found in (compare["bucketed"], compare["bucketed, grads as views"], timeline["bucketed"]):
        assert found.startswith("Task 05.6"), found


def _timeline_run(done: float) -> dict:
    """One measured step, made up: backward to done/2, the all-reduces, then the step."""
    half = done / 2
    return {"backward": [0.0, half], "sync": [half, done - 5], "step": [done - 5, done],
            "layers": [{"name": "fc2", "ready": half / 2}, {"name": "fc1", "ready": half}],
            "allreduce": [{"launch": half, "done": done - 5, "bytes": 4096, "async": False}],
            "step_ms": [done - 9, done, done + 30]}


def _measured(**runs) -> dict:
    cfg = {"world_size": 2, "backend": "gloo", "threads_per_rank": 1, "batch": 8, "width": 32,
           "depth": 2, "bucket_cap_mb": 1.0, "grad_mb": 0.01, "steps": 3, "warmup": 1,
           "interleaved": True}
    return {"config": cfg, "ranks": [{"rank": 0, "runs": runs}]}


def test_the_timeline_says_how_many_steps_it_took_the_median_of():
    bt = _figure_module("05_ddp_from_scratch", "backward_timeline")
    fig = bt.draw(_measured(naive=_timeline_run(80), bucketed=_timeline_run(60)))
    title = fig._suptitle.get_text()
    assert "median" in title and "of 3" in title, (
        f"a measured picture shows the median of several runs and says how many: {title!r}")


def test_the_timeline_leaves_out_a_wrapper_whose_task_is_not_done():
    bt = _figure_module("05_ddp_from_scratch", "backward_timeline")
    fig = bt.draw(_measured(naive=_timeline_run(80), overlap="Task 05.4: hooks",
                            bucketed=_timeline_run(60)))
    assert len(fig.axes) == 2, "the wrapper that reached a task not done yet is left out"
    with pytest.raises(NotImplementedError, match="Task 05.2"):  # nothing measured at all
        bt.draw(_measured(naive="Task 05.2: broadcast", overlap="Task 05.2: broadcast",
                          bucketed="Task 05.2: broadcast"))


def test_the_timeline_says_so_when_a_run_contradicts_the_lesson():
    # One measurement drew naive DDP done at 80 ms and bucketed at 88 ms, under a README that
    # says bucketed finishes sooner, and nothing on the page said the run was off.
    bt = _figure_module("05_ddp_from_scratch", "backward_timeline")
    reversed_ = _measured(naive=_timeline_run(80), overlap=_timeline_run(70),
                          bucketed=_timeline_run(88))
    lines = bt.contradictions(reversed_)
    assert len(lines) == 1 and "bucketed was not faster than naive" in lines[0], lines
    assert "re-run" in lines[0]
    agreed = _measured(naive=_timeline_run(142), overlap=_timeline_run(120),
                       bucketed=_timeline_run(79))
    assert bt.contradictions(agreed) == []


def test_notebook_08_draws_the_zero_stages_from_the_lesson_s_accounting():
    """Every bar of the picture is a number of predict_bytes (task 08.1): a fake accounting
    with numbers of its own must come out bar for bar."""
    zs = _figure_module("08_sharding", "zero_stages")
    from tests.lessons import load

    stages = load("08_sharding", "zero_accounting").STAGES
    kinds = ("params", "grads", "optimizer")

    def fake(num_params, world_size, stage, **_):
        step = 1 + stages.index(stage) if world_size > 1 else 0
        row = {k: num_params * (3 + i) / (1 + step) for i, k in enumerate(kinds)}
        return {**row, "total": sum(row.values())}

    n, world = 1000, 3
    fig = zs.draw(n, world_size=world, predict=fake)
    bars = {p.get_gid(): p for ax in fig.axes for p in ax.patches if p.get_gid()}
    assert len(bars) == len(stages) * world * len(kinds), sorted(bars)
    for stage in stages:
        held = fake(n, world, stage)
        for rank in range(world):
            for kind in kinds:
                bar = bars[f"{stage}/{rank}/{kind}"]
                assert bar.get_width() == pytest.approx(held[kind]), (stage, rank, kind)
                whole = fake(n, 1, "ddp")[kind]
                start = rank * held[kind] if held[kind] < whole else 0.0
                assert bar.get_x() == pytest.approx(start), (stage, rank, kind)


TITLE_CALLS = {"title", "suptitle", "set_title", "xlabel", "ylabel", "set_xlabel", "set_ylabel",
               "text", "legend", "set"}


def _label_strings(source: str):
    """The literal text of every plot title or label a tutorial writes."""
    import ast

    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        parts = (list(node.args) if name in TITLE_CALLS else []) + [
            k.value for k in node.keywords if k.arg in ("title", "label", "xlabel", "ylabel")]
        for part in parts:
            for leaf in ast.walk(part):
                if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str):
                    yield node.lineno, leaf.value


@pytest.mark.parametrize("tutorial", sorted((REPO / "solutions").glob("[0-9][0-9]_*/tutorial.py")),
                         ids=lambda p: p.parent.name)
def test_plot_labels_take_the_dataset_from_what_ran(tutorial):
    # Notebook 01 trained on MNIST (the default when it is there) and titled the plot
    # "ConvNet on Fashion-MNIST".
    written = [(line, text) for line, text in _label_strings(tutorial.read_text())
               if "mnist" in text.lower()]
    assert not written, (
        f"{tutorial.parent.name}/tutorial.py names a dataset in a plot label: {written}; take "
        "it from the run's own arguments, dpt.notebook.dataset_label(DATASET)")
