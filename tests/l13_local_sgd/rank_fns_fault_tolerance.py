"""Run in each replica of lesson 13's supervisor before it trains (``supervise(setup=...)``):
put the reference answers of the tasks a test does not grade in place of the student's, so
a stub in one of 13.11-13.13 fails that task's tests only."""

from __future__ import annotations

import os

LESSON = "13_local_sgd"


def use_references(target: str, tasks: list[str]) -> None:
    """In a replica: read lesson code from ``target`` and put the references of ``tasks``."""
    os.environ["DPT_TARGET"] = target  # the fork server predates the test's environment
    if tasks:
        from tests.references import put

        put(LESSON, tasks)
