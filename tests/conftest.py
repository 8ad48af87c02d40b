"""Pytest plumbing: ``--target`` picks the lesson tree, ``--grade`` prints a score table."""

from __future__ import annotations

import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    group = parser.getgroup("course")
    group.addoption("--target", default=None,
                    help="lesson tree to test: solutions (default), exercises, or any path "
                         "with the same layout")
    group.addoption("--grade", action="store_true",
                    help="print a score table per lesson and task, and exit 0")
    group.addoption("--grade-json", default=None, help="also write the scores as JSON here")


def _resolve_target(value: str | None) -> Path:
    value = value or os.environ.get("DPT_TARGET") or "solutions"
    path = Path(value)
    if not path.is_absolute():
        path = (Path.cwd() / path) if (Path.cwd() / path).is_dir() else (REPO / path)
    return path.resolve()


def pytest_configure(config):
    target = _resolve_target(config.getoption("--target"))
    if not target.is_dir():
        raise pytest.UsageError(f"--target {target} is not a folder")
    os.environ["DPT_TARGET"] = str(target)
    # Every lesson folder goes on sys.path now, before any rank process is started, so that
    # fork-server children import lesson modules from the same tree.
    for lesson in sorted(p for p in target.iterdir() if p.is_dir() and p.name[:2].isdigit()):
        if str(lesson) not in sys.path:
            sys.path.insert(0, str(lesson))
    config.stash[_SCORES] = defaultdict(lambda: {"passed": 0, "total": 0, "first_error": ""})


_SCORES = pytest.StashKey[dict]()


def pytest_report_header(config):
    return f"lesson tree (--target): {os.environ['DPT_TARGET']}"


def pytest_collection_modifyitems(config, items):
    graded, other = [], []
    for item in items:
        marker = item.get_closest_marker("task")
        if marker is not None:
            item.user_properties.append(("task", marker.args[0]))
            graded.append(item)
        else:
            other.append(item)
    if config.getoption("--grade") and other:  # grading runs the task tests only
        config.hook.pytest_deselected(items=other)
        items[:] = graded


def _first_error(report) -> str:
    """The line a student should read first: a task's own message when there is one."""
    text = getattr(report, "longreprtext", "") or ""
    m = re.search(r"NotImplementedError: (Task [^\n]+)", text)
    if m:
        return "NotImplementedError: " + m.group(1)[:150]
    for line in text.splitlines():
        if line.startswith("E "):
            return line[1:].strip()[:160]
    return text.strip().splitlines()[-1][:160] if text.strip() else ""


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    task = dict(report.user_properties).get("task")
    if task is None:
        return
    scores = _config.stash[_SCORES]
    if report.when == "call" or (report.when == "setup" and not report.passed):
        entry = scores[task]
        entry["total"] += 1
        if report.passed or report.skipped:
            entry["passed"] += 1
            if report.skipped:
                entry.setdefault("skipped", 0)
                entry["skipped"] += 1
        elif not entry["first_error"]:
            entry["first_error"] = _first_error(report)


_config = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    global _config
    _config = session.config


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not config.getoption("--grade"):
        return
    scores = config.stash[_SCORES]
    tr = terminalreporter
    tr.section(f"grade: {os.environ['DPT_TARGET']}")
    by_lesson = defaultdict(list)
    for task in sorted(scores):
        by_lesson[task.split(".")[0]].append(task)
    tr.write_line(f"{'lesson':<8}{'task':<10}{'tests':>9}  result")
    grand = [0, 0]
    for lesson, tasks in sorted(by_lesson.items()):
        done = sum(scores[t]["passed"] == scores[t]["total"] for t in tasks)
        for t in tasks:
            s = scores[t]
            ok = s["passed"] == s["total"]
            note = "pass" if ok else f"FAIL  {s['first_error']}"
            tr.write_line(f"{lesson:<8}{t:<10}{s['passed']:>4}/{s['total']:<4}  {note}")
        tr.write_line(f"{lesson:<8}{'score':<10}{done:>4}/{len(tasks):<4}  tasks complete")
        grand[0] += done
        grand[1] += len(tasks)
    tr.write_line(f"{'total':<8}{'':<10}{grand[0]:>4}/{grand[1]:<4}  tasks complete")
    path = config.getoption("--grade-json")
    if path:
        Path(path).write_text(json.dumps({"target": os.environ["DPT_TARGET"],
                                          "tasks": dict(scores)}, indent=2))


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("--grade") and exitstatus == pytest.ExitCode.TESTS_FAILED:
        session.exitstatus = pytest.ExitCode.OK
