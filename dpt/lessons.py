"""The one way to reach a lesson's code from outside it: :func:`load`.

A lesson imports its own siblings by name (Python puts a script's folder first on
``sys.path``). Everything else (a later lesson that builds on an earlier one, the tests, the
benchmarks, the notebooks, the tools) calls :func:`load`, which finds the lesson in one lesson
tree (``solutions/``, ``exercises/`` or a student's copy) and imports the module under its own
name. Its folder stays on ``sys.path``, so that rank processes started afterwards (they get
the parent's ``sys.path``) unpickle the lesson's functions from the same files.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent  # as dpt.data's, without importing torch
LESSON = re.compile(r"\d\d_\w+")


def tree_of(tree: str | Path | None = None) -> Path:
    """The lesson tree ``tree`` names, as an absolute path.

    ``None``: ``$DPT_TARGET`` (what ``pytest --target`` and the notebooks' tests set), else
    ``solutions/``. A name or relative path is taken from the repository root. A lesson's
    file (its ``__file__``) names the tree that lesson sits in: a lesson of ``exercises/``
    builds on ``exercises/08_sharding``, not on the solutions.
    """
    if tree is None:
        tree = os.environ.get("DPT_TARGET") or "solutions"
    path = Path(tree)
    path = (path if path.is_absolute() else REPO_ROOT / path).resolve()
    if path.is_file():  # a lesson's file (perhaps in its figures/): the nearest lesson folder
        lesson = next((p for p in path.parents if LESSON.fullmatch(p.name)), None)
        if lesson is None:
            raise ValueError(f"error: {path} is not inside a lesson folder (NN_name)")
        return lesson.parent
    return path


def load(lesson: str, module: str, tree: str | Path | None = None) -> ModuleType:
    """Import ``module`` from ``<tree>/<lesson>/`` (``tree`` as :func:`tree_of` reads it).

    ``load("08_sharding", "zero_accounting", __file__)`` in a lesson file gives lesson 08's
    module from the lesson's own tree. Raises ImportError when a module of that name was
    already imported from another folder (another tree, or another lesson's file of the same
    name), FileNotFoundError when the lesson or the module is not there.
    """
    folder = tree_of(tree) / lesson
    if not (folder / f"{module}.py").is_file():
        what = "lesson folder" if not folder.is_dir() else f"{module}.py in"
        raise FileNotFoundError(f"error: no {what} {folder}: is the lesson tree complete?")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    mod = importlib.import_module(module)
    origin = Path(mod.__file__).resolve().parent
    if origin != folder:
        raise ImportError(f"error: {module} was already imported from {origin}, not from "
                          f"{folder}: two lesson trees (or two lessons) in one process")
    return mod
