"""The one seam between the tests and a lesson tree (solutions/, exercises/, a student's copy).

Tests never import lesson code directly: they call :func:`load`. ``pytest --target PATH``
chooses the tree; conftest puts every lesson folder of that tree on ``sys.path`` before any
test runs, so rank processes started later can import the same modules by name.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def target() -> Path:
    return Path(os.environ.get("DPT_TARGET", REPO / "solutions")).resolve()


def lesson_dir(lesson: str) -> Path:
    path = target() / lesson
    if not path.is_dir():
        raise FileNotFoundError(f"lesson folder {path} is missing from the target tree")
    return path


def load(lesson: str, module: str):
    """Import ``module`` from ``<target>/<lesson>/``."""
    mod = importlib.import_module(module)
    origin = Path(mod.__file__).resolve()
    if origin.parent != lesson_dir(lesson):
        raise ImportError(f"{module} was imported from {origin}, not from {lesson_dir(lesson)}: "
                          "two lessons use the same module name")
    return mod


def script(lesson: str, name: str) -> Path:
    return lesson_dir(lesson) / name
