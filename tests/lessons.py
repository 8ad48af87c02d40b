"""The one seam between the tests and a lesson tree (solutions/, exercises/, a student's copy).

Tests never import lesson code directly: they call :func:`load`, which is
:func:`dpt.lessons.load` on the tree ``pytest --target PATH`` chose (``$DPT_TARGET``). It
leaves the lesson's folder on ``sys.path``, so rank processes started later import the same
modules by name.
"""

from __future__ import annotations

import os
from pathlib import Path

from dpt import lessons

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
    return lessons.load(lesson, module, target())


def script(lesson: str, name: str) -> Path:
    return lesson_dir(lesson) / name
