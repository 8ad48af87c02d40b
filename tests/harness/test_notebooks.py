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
