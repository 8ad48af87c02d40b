"""What a notebook's first cell calls: pick the lesson tree and put the lesson on sys.path.

Students run ``notebooks/NN_*.ipynb`` against their own ``exercises/``. The tests run the same
notebook against another tree by setting ``DPT_TARGET`` (``solutions`` or a path).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dpt.data import REPO_ROOT


def use_lesson(lesson: str, default_tree: str = "exercises") -> Path:
    tree = Path(os.environ.get("DPT_TARGET", default_tree))
    if not tree.is_absolute():
        tree = REPO_ROOT / tree
    folder = tree / lesson
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} does not exist; set DPT_TARGET to a lesson tree")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    os.environ.setdefault("TQDM_MININTERVAL", "5")
    print(f"lesson code from: {folder.relative_to(REPO_ROOT) if folder.is_relative_to(REPO_ROOT) else folder}")
    return folder
