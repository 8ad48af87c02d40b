"""How graded tests add up to task scores and points: one place for `make grade` and the
class grader (`tools/grade_class.py`: the gradebook, the feedback files, Gradescope's
results.json). Plain Python, no torch, so the grader can import it cheaply.
"""

from __future__ import annotations

import re
import textwrap

# Points per task. A task not listed here is worth DEFAULT_POINTS. Change a task's weight here
# and every report follows: `make grade`'s table, the gradebook CSV and Gradescope's file.
DEFAULT_POINTS = 1.0
POINTS: dict[str, float] = {
    # "05.9": 2.0,  # e.g. the bucketed DDP counts double
}


def task_order(task: str) -> tuple:
    """Sort key of a task id: 09.2 before 09.10 (a string sort puts 09.10 first)."""
    m = re.fullmatch(r"(\d+)\.(\d+)([a-z]?)", task)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else (10**9, 0, task)


def points_for(task: str) -> float:
    return float(POINTS.get(task, DEFAULT_POINTS))


def new_entry() -> dict:
    return {"passed": 0, "failed": 0, "skipped": 0, "total": 0, "first_error": "",
            "skip_reason": ""}


def record(entry: dict, when: str, outcome: str, message: str = "") -> None:
    """Count one pytest report (``when``: setup/call/teardown; ``outcome``: passed/failed/skipped).

    Each graded test counts once: passed, failed (in setup, call or teardown) or skipped. A
    skipped test is neither passed nor failed: it is left out of the score and shown apart.
    """
    if when == "setup" and outcome == "skipped":
        entry["skipped"] += 1
        entry["total"] += 1
        entry["skip_reason"] = entry["skip_reason"] or message
    elif when == "setup" and outcome == "failed":
        entry["failed"] += 1
        entry["total"] += 1
        entry["first_error"] = entry["first_error"] or message
    elif when == "call":
        entry["total"] += 1
        if outcome == "passed":
            entry["passed"] += 1
        elif outcome == "skipped":  # pytest.skip() inside the test
            entry["skipped"] += 1
            entry["skip_reason"] = entry["skip_reason"] or message
        else:
            entry["failed"] += 1
            entry["first_error"] = entry["first_error"] or message
    elif when == "teardown" and outcome == "failed":
        entry["failed"] += 1
        entry["first_error"] = entry["first_error"] or message


def task_state(entry: dict) -> str:
    """``pass`` (every graded test passed), ``fail`` (any failed), or ``skipped`` (none ran)."""
    if entry["failed"]:
        return "fail"
    if entry["passed"] == 0:
        return "skipped"
    return "pass"


# --- what a student reads after the table: one line per unfinished task ---------------------

# A task's stub, as the failure's text shows it: "NotImplementedError: Task 05.6: <hint>".
# Two ranks failing at once can interleave their last lines ("NotImplementedError: : Task ..."),
# hence the repeated ": ". The stub's source line, `raise NotImplementedError("Task ...")`,
# does not match: only the raised message counts.
STUB = re.compile(r"NotImplementedError(?:: )+Task (\d\d\.\d+[a-z]?): ?([^\n]*)")
# A notebook cell run by a test says so instead of raising (dpt.notebook.needs_tasks).
CELL_SKIPPED = re.compile(r"skipped: this cell needs Task (\d\d\.\d+[a-z]?)\b")


def stub_in(text: str) -> tuple[str, str] | None:
    """``(task, hint)`` of the first task stub a failure's text shows as raised, else None.
    (The hint is empty when a notebook cell skipped for the task: it does not repeat it.)"""
    m = STUB.search(text or "")
    if m is not None:
        return m.group(1), m.group(2).strip()
    m = CELL_SKIPPED.search(text or "")
    return (m.group(1), "") if m is not None else None


def failure_kind(task: str, when: str, text: str) -> tuple[str, str, str]:
    """What one failing report of a test of ``task`` says about the student's work.

    ``("stub", task, hint)``: it stopped at the task's own stub (not started);
    ``("needs", other, hint)``: it stopped at another task's stub, one this task builds on;
    ``("error", "", "")``: it failed in the test's setup or teardown, not at a stub;
    ``("failed", "", "")``: any other failure: the student's code ran and was wrong.
    """
    stub = stub_in(text)
    if stub is not None:
        return ("stub" if stub[0] == task else "needs", *stub)
    return ("error" if when in ("setup", "teardown") else "failed"), "", ""


def task_progress(task: str, kinds: list[tuple[str, str, str]]) -> tuple[str, str]:
    """One failing task's state from its failures' kinds (``failure_kind``):

    ``("not started", hint)`` when every failure stopped at a stub, one of them its own;
    ``("waiting", "Task X: hint")`` when every failure stopped at other tasks' stubs;
    ``("started", "")`` when any failure is the student's code running and failing.
    """
    if not kinds or any(kind not in ("stub", "needs") for kind, _, _ in kinds):
        return "started", ""
    own = [hint for kind, _, hint in kinds if kind == "stub"]
    if own:
        return "not started", max(own, key=bool) or "its stub is still there"
    others = [(t, hint) for kind, t, hint in kinds if kind == "needs"]
    task, hint = max(others, key=lambda other: bool(other[1]))
    return "waiting", f"Task {task}" + (f": {hint}" if hint else "")


def task_line(task: str, state: str, detail: str) -> str:
    """The line a student reads for an unfinished task (no traceback)."""
    if state == "not started":
        return f"{task:<6}not started: {detail}"
    if state == "waiting":
        return f"{task:<6}waits for another task: its tests stop at {detail}"
    return f"{task:<6}started, failing (see below)"


def error_line(nodeid: str, when: str, message: str) -> str:
    """One of pytest's "errors" (a failure outside the test's body), said in one line."""
    where = "collecting" if when == "collect" else f"in {when} of"
    return f"error {where} {nodeid}: {message or 'no message'}"


# --- fitting messages to the report's width ----------------------------------------------

# The longest message a report keeps (a failing test's first line can be a huge repr): longer
# ones are shortened at a word boundary, and say so.
MESSAGE_LIMIT = 1000
SHORTENED = " [... shortened; pytest -v shows it whole]"


def shorten_message(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` on one line (runs of whitespace made one space), kept whole up to ``limit``
    characters; a longer one ends at the last word boundary that fits, marked as shortened.
    Never cut inside a word."""
    flat = " ".join((text or "").split())
    if len(flat) <= limit:
        return flat
    head = flat[:limit - len(SHORTENED) + 1]
    if " " in head:
        head = head[:head.rfind(" ")]
    else:  # one long first word: kept whole
        head = flat.split(" ")[0]
    return head.rstrip() + (SHORTENED if len(head) < len(flat) else "")


def wrap_line(prefix: str, text: str, width: int = 80, indent: int | None = None) -> list[str]:
    """``prefix + text`` as lines of at most ``width`` characters, broken between words (never
    inside one: a word longer than the line stays whole), each line after the first indented
    by ``indent`` spaces (by default, under the text's first character)."""
    pad = " " * (len(prefix) if indent is None else indent)
    lines = textwrap.wrap(text or "", width=max(width, len(prefix) + 20),
                          initial_indent=prefix, subsequent_indent=pad,
                          break_long_words=False, break_on_hyphens=False)
    return lines or [prefix.rstrip()]
