"""Pytest plumbing: ``--target`` picks the lesson tree, ``--grade`` prints a score table."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from dpt.notebook import pending_task
from tests.dependencies import lesson_needs
from tests.scoring import (  # noqa: F401 (re-export)
    error_line,
    failure_kind,
    new_entry,
    points_for,
    record,
    shorten_message,
    stub_in,
    task_line,
    task_order,
    task_progress,
    task_state,
    wrap_line,
)

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    group = parser.getgroup("course")
    group.addoption("--target", default=None,
                    help="lesson tree to test: solutions (default), exercises, or any path "
                         "with the same layout")
    group.addoption("--grade", action="store_true",
                    help="print a score table per lesson and task, and exit 0")
    group.addoption("--grade-json", default=None, help="also write the scores as JSON here")
    group.addoption("--grade-tasks", default=None,
                    help="with --grade: run only these tasks' tests, e.g. 08.1,08.2")
    group.addoption("--grade-log", default=None,
                    help="append one JSON line per test start and report here, as they happen "
                         "(the class grader reads it when a test process dies)")


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
    # The suite's rank functions and the lesson code they call run on the CPU with gloo on
    # every machine (dpt.dist.rank_device follows the backend), so a GPU box gives the same
    # results as a laptop. The GPU tests (tests/gpu, `make gpu-check`) ask for NCCL by name.
    os.environ.setdefault("DPT_TEST_BACKEND", "gloo")
    # One intra-op thread per test process: `-n 2` runs two processes on two cores, and a
    # loaded machine turns OpenMP's spinning threads into waits of minutes (a 3 s test took
    # over 300 s with default threads under a CPU hog). Ranks get theirs from run_distributed.
    threads = int(os.environ.get("DPT_TEST_THREADS", "1"))
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    config.stash[_SCORES] = defaultdict(new_entry)
    config.stash[_FAILURES] = []
    config.stash[_COLLECTED] = {}
    config.stash[_TEST_IDS] = {}
    config.stash[_PENDING] = {}
    if config.getoption("--grade") and config.option.verbose <= 0:
        # What a student reads (pytest_terminal_summary below): the score table first, one line
        # per task not started, then the failures of the tasks started: tracebacks for one
        # lesson (`make grade LESSON=03`), one line per failing test for the whole course.
        # No short summary repeating every failure, nor the libraries' deprecation warnings.
        # `-v` shows everything as pytest does, after the table.
        config.option.reportchars = ""
        config.option.disable_warnings = True
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:  # it may have read the options already
            reporter.reportchars = ""
        if not _one_lesson(config):  # the tracebacks are not even kept
            config.option.tbstyle = "no"


def _one_lesson(config) -> bool:
    """True when the command line selects tests of a single lesson folder."""
    lessons = set()
    for arg in config.args:
        parts = Path(str(arg).split("::")[0]).resolve().parts
        found = [part for part in parts if re.fullmatch(r"l\d\d_\w+", part)]
        if not found:
            return False
        lessons.add(found[0])
    return len(lessons) == 1


class _Failure(NamedTuple):
    """One failing report: a test's setup, call or teardown, or a file's collection."""
    nodeid: str
    task: str | None
    when: str
    why: str  # the line to read first (_first_error)
    kind: tuple[str, str, str]  # scoring.failure_kind
    report: object


_SCORES = pytest.StashKey[dict]()
_FAILURES = pytest.StashKey[list]()
_COLLECTED = pytest.StashKey[dict]()
_TEST_IDS = pytest.StashKey[dict]()
_PENDING = pytest.StashKey[dict]()  # unmarked tests skipped for a task not done: task -> count
_TIMES = pytest.StashKey[dict]()  # tests/<folder> -> [tests, seconds of setup+call+teardown]
LESSON_BUDGET_S = 120  # a lesson whose tests take longer is named at the end of the run
# The lesson notebooks run as a student runs them: their own row of the time table, apart
# from the machinery (the rest of tests/harness).
NOTEBOOK_TESTS = "tests/harness/test_notebooks.py::"
NOTEBOOK_ROW = "notebooks"


def pytest_report_header(config):
    return f"lesson tree (--target): {os.environ['DPT_TARGET']}"


def _tree_note() -> str:
    """Which tree was tested, said so that a green run on the answers is not taken for yours."""
    target = Path(os.environ["DPT_TARGET"])
    if target == (REPO / "solutions").resolve():
        return ("tested: solutions/ (the reference answers), not your code; "
                "grade yours with `make grade` or `pytest --target exercises --grade`")
    return f"tested: {target}"


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test gets back the environment it started with, whatever it set.

    Code under test may set variables in this process: ``dpt.dist.setup`` sets ``LOCAL_RANK``
    and ``MASTER_ADDR`` as torchrun would, lesson 03's launcher ``MASTER_PORT``. Left behind,
    ``LOCAL_RANK`` makes every later Lightning ``ddp`` script in the same test process believe a
    launcher started it, and wait forever for a rank 1 it never starts (seen in a stress run:
    two lesson-07 tests hung on rank 0, depending on which tests had run before them).
    """
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


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
    wanted = config.getoption("--grade-tasks")
    if config.getoption("--grade") and wanted:
        wanted = {t.strip() for t in wanted.split(",") if t.strip()}
        keep = [i for i in items if dict(i.user_properties).get("task") in wanted]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def pytest_collection_finish(session):
    """Count the graded tests per task that will run (after -m/-k deselection)."""
    collected = session.config.stash[_COLLECTED]
    for item in session.items:
        task = dict(item.user_properties).get("task")
        if task is not None:
            collected[task] = collected.get(task, 0) + 1
            session.config.stash[_TEST_IDS][item.nodeid] = task


def _log(config, **line) -> None:
    path = config.getoption("--grade-log")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()


def pytest_runtest_logstart(nodeid, location):
    if _config is not None:
        _log(_config, start=nodeid)


def _first_error(report) -> str:
    """The line a student should read first: a task's own message when there is one."""
    text = getattr(report, "longreprtext", "") or ""
    m = re.search(r"NotImplementedError: (Task [^\n]+)", text)
    if m:
        return "NotImplementedError: " + m.group(1).strip()
    # A syntax error's first E line is `File "...", line N`: its `SyntaxError: ...` line says more
    m = re.search(r"^E\s+((?:SyntaxError|IndentationError|TabError)\b[^\n]*)", text, re.M)
    if m:
        return shorten_message(m.group(1))
    for line in text.splitlines():
        if line.startswith("E "):
            return shorten_message(line[1:])
    return shorten_message(text.strip().splitlines()[-1]) if text.strip() else ""


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


_NEEDS = "needs"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """An unmarked test that stops at a task's stub is skipped, saying which task it needs.

    Task-marked tests are the score, and a stub fails them. Unmarked tests check the given code
    and whole lessons; on a student's tree some cannot run until a task is done (lesson 04's
    epoch loop needs task 03.4's line), and a failure there would blame the given code for a
    task the student has not reached. The stub's own NotImplementedError ("Task NN.K: ...", in
    this process or in a rank's traceback) turns the failure into a skip that names the task.
    Any other failure stays a failure, and so does every failure on ``solutions/`` (which has no
    stubs) and in the harness's tests (which run the stubs on purpose).
    """
    outcome = yield
    report = outcome.get_result()
    if (not report.failed or call.excinfo is None or report.when == "teardown"
            or item.get_closest_marker("task") is not None
            or not re.fullmatch(r"l\d\d_\w+", item.path.parent.name)  # lesson tests only
            or Path(os.environ["DPT_TARGET"]) == (REPO / "solutions").resolve()):
        return  # (the harness's tests read stubs' messages on purpose; solutions/ has none)
    task = pending_task(call.excinfo.value)
    if task is None:
        return
    report.outcome = "skipped"
    report.longrepr = (str(item.path), (item.location[1] or 0) + 1,
                       f"Skipped: {_NEEDS} {task}, not done yet in this tree (the test stopped "
                       "at its NotImplementedError; not scored)")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """Count each graded test once: passed, failed (in setup, call or teardown) or skipped.

    A skipped test is neither passed nor failed: it is left out of the score and shown apart.
    """
    parts = report.nodeid.split("/")
    if len(parts) > 2 and parts[0] == "tests":
        folder = NOTEBOOK_ROW if report.nodeid.startswith(NOTEBOOK_TESTS) else parts[1]
        spent = _config.stash.setdefault(_TIMES, {}).setdefault(folder, [0, 0.0])
        spent[0] += report.when == "call"
        spent[1] += report.duration
    task = dict(report.user_properties).get("task")
    if report.skipped and task is None:  # counted here, where pytest -n's reports arrive too
        m = re.match(rf"{_NEEDS} (Task \d\d\.\d+[a-z]?), not done yet", _skip_reason(report))
        if m:
            pending = _config.stash[_PENDING]
            pending[m.group(1)] = pending.get(m.group(1), 0) + 1
    if report.failed:
        text = getattr(report, "longreprtext", "") or ""
        _config.stash[_FAILURES].append(_Failure(
            report.nodeid, task, report.when, _first_error(report) or f"failed in {report.when}",
            failure_kind(task or "", report.when, text), report))
    if task is None:
        return
    message = (_skip_reason(report) if report.skipped
               else _first_error(report) if report.failed else "")
    record(_config.stash[_SCORES][task], report.when, report.outcome, message)
    _log(_config, nodeid=report.nodeid, task=task, when=report.when, outcome=report.outcome,
         message=message)


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(report, config):
    """With --grade, a test whose setup stopped at a task's stub counts as failed, as the tests
    that stop at the stub in their own body do. (A fixture may run the student's code once for
    several tests, as lesson 04's ``resumed`` does; pytest would call each an "error", which
    tells a student nothing.) The score counts it as failed either way (scoring.record)."""
    if (config.getoption("--grade") and report.when == "setup" and report.failed
            and stub_in(getattr(report, "longreprtext", "") or "") is not None):
        return "failed", "F", "FAILED"
    return None


def _is_error(f: _Failure) -> bool:
    """What pytest counts as an "error": a failure in collection, in teardown, or in setup
    (unless the setup stopped at a task's stub: see pytest_report_teststatus)."""
    return f.when in ("collect", "teardown") or (
        f.when == "setup" and f.kind[0] not in ("stub", "needs"))


def pytest_collectreport(report):
    """A test file that cannot be imported is one of pytest's "errors": the grade names it."""
    if report.failed and _config is not None:
        _config.stash[_FAILURES].append(_Failure(
            report.nodeid, None, "collect", _first_error(report) or "could not be collected",
            ("error", "", ""), report))


_config = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    global _config
    _config = session.config


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """With --grade, what a student reads first: the score table, then one line per task not
    started, then the failures of the tasks started. This wrapper's first half runs before the
    terminal reporter's own sections (FAILURES, ERRORS, warnings), which it then leaves out
    unless -v asks for them."""
    tr = terminalreporter
    if config.getoption("--grade"):
        _grade_report(tr, config)
    try:
        return (yield)
    finally:
        if not config.getoption("--grade"):
            pending = config.stash[_PENDING]
            if pending:
                tr.write_line(f"skipped {sum(pending.values())} unmarked test(s) that need a "
                              "task not done yet: "
                              + ", ".join(f"{t} ({n})" for t, n in sorted(pending.items(), key=lambda kv: task_order(kv[0]))))
            times = config.stash.get(_TIMES, {})
            if len(times) > 1:  # a run over several folders: where its time went
                for line in time_table(times):
                    tr.write_line(line)
            tr.write_line(_tree_note())


def time_table(times: dict[str, list], budget_s: float = LESSON_BUDGET_S) -> list[str]:
    """Where the run's test time went: one line per lesson's tests, the lesson notebooks run
    top to bottom, the machinery's (the rest of tests/harness) and the GPU tests, with their
    share; then one line per lesson over ``budget_s`` (test seconds, summed over the
    workers)."""
    total = sum(s for _, s in times.values()) or 1.0
    lessons = {k: v for k, v in times.items() if re.fullmatch(r"l\d\d_\w+", k)}
    lines = [f"test time by folder (seconds summed over workers; {total:.0f} s in all):"]
    for name, (count, seconds) in sorted(times.items()):
        lines.append(f"  {name:<24} {count:5d} tests {seconds:8.1f} s {100 * seconds / total:5.1f}%")
    lesson_s = sum(s for _, s in lessons.values())
    notebook_s = times.get(NOTEBOOK_ROW, (0, 0.0))[1]
    lines.append(f"  lessons' own tests {100 * lesson_s / total:.0f}%, their notebooks "
                 f"{100 * notebook_s / total:.0f}%, machinery and others "
                 f"{100 - 100 * (lesson_s + notebook_s) / total:.0f}%")
    lines += [f"slow lesson: tests/{name} took {seconds:.0f} s, over the {budget_s:.0f} s a "
              "lesson's tests may take (tests/conftest.py LESSON_BUDGET_S)"
              for name, (_, seconds) in sorted(lessons.items()) if seconds > budget_s]
    return lines


def _grade_report(tr, config) -> None:
    scores = config.stash[_SCORES]
    failures = config.stash[_FAILURES]
    kinds = defaultdict(list)
    for f in failures:
        if f.task is not None:
            kinds[f.task].append(f.kind)
    progress = {task: task_progress(task, k) for task, k in kinds.items()}
    _write_json(config, scores)
    _write_table(tr, scores, progress)
    todo = [(t, *progress[t]) for t in sorted(progress, key=task_order) if progress[t][0] != "started"]
    if todo:
        tr.section("tasks to do (one line each, with its hint)", sep="-")
        for task, state, detail in todo:
            _write_wrapped(tr, "", task_line(task, state, detail), indent=6)
    errors = [f for f in failures if _is_error(f)]
    if errors:
        tr.section(f"{len(errors)} error(s): failures outside a test's body", sep="-")
        for f in errors:
            _write_wrapped(tr, "", error_line(f.nodeid, f.when, f.why), indent=4)
    started = [f for f in failures
               if f.task is None or progress.get(f.task, ("started", ""))[0] == "started"]
    if config.option.verbose > 0:
        return  # pytest's own sections follow, every traceback as usual
    if config.option.tbstyle == "no":  # the whole course: one line per failing test
        lines = [f for f in started if not _is_error(f)]  # (errors have their line above)
        if lines:
            tr.section("failing tests of the tasks you started (one line each; -v for "
                       "tracebacks)", sep="-")
            for f in lines:
                _write_wrapped(tr, "", f"{f.nodeid}: {f.why}", indent=4)
        return
    if started:
        tr.section("failing tests of the tasks you started")
        for f in started:
            where = "" if f.when == "call" else f" ({f.when})"
            tr.write_sep("_", f.nodeid + where, red=True, bold=True)
            f.report.toterminal(tr._tw)
            for name, content in getattr(f.report, "sections", []):
                if name.startswith("Captured"):
                    tr.write_sep("-", name)
                    tr.write_line(content.rstrip("\n"))
    config.option.tbstyle = "no"  # printed above: pytest's FAILURES would repeat them all


def _write_table(tr, scores, progress) -> None:
    tr.section(f"grade: {os.environ['DPT_TARGET']}")
    by_lesson = defaultdict(list)
    for task in sorted(scores, key=task_order):
        by_lesson[task.split(".")[0]].append(task)
    tr.write_line(f"{'lesson':<8}{'task':<10}{'tests':>9}  result")
    grand, grand_points, skipped_tasks, skipped_tests = [0, 0], [0.0, 0.0], [], 0
    for lesson, tasks in sorted(by_lesson.items()):
        done = graded = 0
        for t in tasks:
            s = scores[t]
            state = task_state(s)
            skipped_tests += s["skipped"]
            ran = s["passed"] + s["failed"]
            extra = f" (+{s['skipped']} skipped)" if s["skipped"] else ""
            if state == "skipped":
                skipped_tasks.append(t)
                note = f"SKIPPED  {s['skip_reason']}"
            elif state == "pass":
                note = "pass" + extra
            else:
                how, detail = progress.get(t, ("started", ""))
                note = f"FAIL{extra}  " + (
                    "not started" if how == "not started"
                    else f"waits for {detail.split(':')[0]}" if how == "waiting"
                    else s["first_error"])
            if state != "skipped":
                graded += 1
                done += state == "pass"
            _write_wrapped(tr, f"{lesson:<8}{t:<10}{s['passed']:>4}/{ran:<4}  ", note)
        got = sum(points_for(t) for t in tasks if task_state(scores[t]) == "pass")
        out_of = sum(points_for(t) for t in tasks if task_state(scores[t]) != "skipped")
        tr.write_line(f"{lesson:<8}{'score':<10}{done:>4}/{graded:<4}  tasks complete, "
                      f"{got:g}/{out_of:g} points")
        needs = lesson_needs(lesson, Path(os.environ["DPT_TARGET"]))
        if needs:  # the earlier lessons' tasks this one runs (tests/dependencies.py)
            _write_wrapped(tr, f"{lesson:<8}{'needs':<10}", needs, indent=18)
        grand[0] += done
        grand[1] += graded
        grand_points[0] += got
        grand_points[1] += out_of
    tr.write_line(f"{'total':<8}{'':<10}{grand[0]:>4}/{grand[1]:<4}  tasks complete, "
                  f"{grand_points[0]:g}/{grand_points[1]:g} points")
    if skipped_tests:
        reasons = sorted({scores[t]["skip_reason"] for t in scores if scores[t]["skip_reason"]})
        _write_wrapped(tr, "", f"score incomplete: {skipped_tests} test(s) skipped, left out of "
                       "the score" + (f" ({len(skipped_tasks)} task(s) not graded at all)"
                                      if skipped_tasks else "") + "; why: " + "; ".join(reasons),
                       indent=4)


def _write_wrapped(tr, prefix: str, text: str, indent: int | None = None) -> None:
    """``prefix + text`` wrapped to the terminal's width between words, never cut: a long
    message goes on under its column (``indent`` spaces, by default the prefix's width)."""
    for line in wrap_line(prefix, text, tr._tw.fullwidth - 1, indent):
        tr.write_line(line)


def _write_json(config, scores) -> None:
    path = config.getoption("--grade-json")
    if path:
        skipped_tests = sum(v["skipped"] for v in scores.values())
        Path(path).write_text(json.dumps({
            "target": os.environ["DPT_TARGET"],
            "tasks": {t: dict(v, state=task_state(v), points=points_for(t))
                      for t, v in scores.items()},
            "collected": config.stash[_COLLECTED],
            "tests": config.stash[_TEST_IDS],
            "complete": not skipped_tests}, indent=2))


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("--grade") and exitstatus == pytest.ExitCode.TESTS_FAILED:
        session.exitstatus = pytest.ExitCode.OK
