"""How graded tests add up to task scores and points: one place for `make grade` and the
class grader (`tools/grade_class.py`: the gradebook, the feedback files, Gradescope's
results.json). Plain Python, no torch, so the grader can import it cheaply.
"""

from __future__ import annotations

# Points per task. A task not listed here is worth DEFAULT_POINTS. Change a task's weight here
# and every report follows: `make grade`'s table, the gradebook CSV and Gradescope's file.
DEFAULT_POINTS = 1.0
POINTS: dict[str, float] = {
    # "05.9": 2.0,  # e.g. the bucketed DDP counts double
}


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
