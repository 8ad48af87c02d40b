"""The planted-bug catalogue (tools/plant_bugs.py) stays true to the solutions and the tests.

The full run plants each bug and runs its tests (about 10 minutes on two idle cores), so it is a tool, not part
of the suite. These checks are fast: every edit still applies exactly once, every test it
names exists, the verdicts are read correctly, and one bug goes through the whole pipeline.
"""

from __future__ import annotations

import re
import sys

import pytest

from tools import plant_bugs as pb

REPO = pb.REPO


def test_every_bug_still_applies_to_the_solutions_once(tmp_path):
    stale = []
    for bug in pb.BUGS:
        tree = tmp_path / bug.id / "solutions"
        (tree / bug.file).parent.mkdir(parents=True)
        (tree / bug.file).write_text((pb.SOLUTIONS / bug.file).read_text())
        problem = pb.apply(bug, tree)
        if problem or (tree / bug.file).read_text() == (pb.SOLUTIONS / bug.file).read_text():
            stale.append(f"{bug.id}: {problem or 'the edit changes nothing'}")
    assert not stale, ("the solutions changed, so these planted bugs no longer apply; update "
                       "their 'find' text in tools/plant_bugs.py:\n" + "\n".join(stale))


def test_every_bug_names_tests_that_exist():
    missing = []
    for bug in pb.BUGS:
        if not bug.tests:
            missing.append(f"{bug.id} names no test")
        for node in bug.tests:
            path, _, name = node.partition("::")
            if not re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), re.M):
                missing.append(f"{bug.id}: {node} does not exist (a test was renamed?)")
    assert not missing, "\n".join(missing)


def _task_marker(source: str, name: str) -> str | None:
    """The ``@pytest.mark.task("NN.M")`` right above ``def name(``, if there is one."""
    lines = source.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(f"def {name}("))
    while i > 0 and lines[i - 1].startswith(("@", " ", ")")):
        i -= 1
        found = re.match(r'@pytest\.mark\.task\("([0-9.]+)"\)', lines[i])
        if found:
            return found.group(1)
    return None


def test_every_bug_is_checked_by_tests_of_its_own_task():
    """A graded test puts reference code in place of the other tasks (lesson 05 does), so a
    bug named against another task's test would pass there whatever it breaks."""
    wrong = []
    for bug in pb.BUGS:
        task = bug.id.split("-")[0]
        if task.endswith(".0"):  # code around the tasks: any test may catch it
            continue
        for node in bug.tests:
            path, _, name = node.partition("::")
            marker = _task_marker((REPO / path).read_text(), name)
            if marker is not None and marker != task:
                wrong.append(f"{bug.id}: {name} grades task {marker}")
    assert not wrong, "\n".join(wrong)


def test_bug_ids_are_unique_and_name_their_task():
    ids = [b.id for b in pb.BUGS]
    assert len(ids) == len(set(ids))
    for b in pb.BUGS:
        assert re.fullmatch(r"0[1-8]\.\d+-[a-z0-9-]+", b.id), b.id
        assert b.id[:2] == b.lesson, f"{b.id} edits {b.file}, another lesson"
        assert b.why, f"{b.id} does not say what the mistake is"


def test_the_verdicts_distinguish_a_hole_a_timeout_and_the_wrong_message():
    bug = pb.Bug("05.3-x", "05_x/y.py", "a", "b", ("t::t",), expect=r"missing divide")
    assert pb.verdict(bug, 0, "1 passed")[0] == "SURVIVED"
    assert pb.verdict(bug, 1, "E   AssertionError: ... missing divide by world size\n"
                      "FAILED t::t")[0] == "caught"
    assert pb.verdict(bug, 1, "E   AssertionError: shapes differ\nFAILED t::t")[0] == \
        "WRONG REASON"
    assert pb.verdict(bug, 1, "E   Failed: Timeout >300.0s\nFAILED t::t")[0] == "WRONG REASON"
    assert pb.verdict(bug, 4, "ERROR: file or directory not found")[0] == "ERROR"
    plain = pb.Bug("01.1-x", "01_x/y.py", "a", "b", ("t::t",))
    assert pb.verdict(plain, 1, "E   assert 1 == 2\nFAILED t::t") == ("caught", "assert 1 == 2")
    assert pb.verdict(plain, 1, "E   Failed: Timeout >300.0s\nFAILED t::t")[0] == "WRONG REASON"
    assert pb.verdict(plain, 1, "E   RankFailure: rank 0 of 3 hung and was stopped")[0] == \
        "WRONG REASON"
    hang_ok = pb.Bug("05.1-x", "05_x/y.py", "a", "b", ("t::t",), expect=r"hung and was stopped")
    assert pb.verdict(hang_ok, 1, "E   RankFailure: rank 0 of 3 hung and was stopped")[0] == \
        "caught"


def test_a_stale_edit_is_reported_not_run(tmp_path):
    bug = pb.Bug("01.1-gone", "01_single_device/single_device.py", "no such text", "x",
                 ("tests/l01_single_device/test_single_device.py::t",))
    assert pb.run_one(bug, sys.executable, 60)["verdict"] == "STALE"


@pytest.mark.timeout(240)
def test_one_planted_bug_goes_through_the_whole_pipeline():
    """A fast bug (pure arithmetic, one process) is planted, tested and caught."""
    bug = next(b for b in pb.BUGS if b.id == "08.1-grads-sharded-at-stage-1")
    result = pb.run_one(bug, sys.executable, 200)
    assert result["verdict"] == "caught", result
