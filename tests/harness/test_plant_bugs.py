"""The planted-bug catalogues (``tests/lNN_name/planted_bugs.py``) stay true to the solutions.

The full run (``make plant-bugs``) plants each bug and runs its tests (about 17 minutes on two
idle cores), so it is a tool, not part of the suite. These checks are fast: every edit still
applies once inside the block or definition it names and touches code, not comments; every
file and test it names exists; ids are unique and name their task; the anchoring itself
finds what it should (and refuses a stale entry); the verdicts are read correctly; and one
bug goes through the whole pipeline.
"""

from __future__ import annotations

import importlib
import re
import sys

import pytest

from tests import planted
from tests.planted import Bug
from tools import plant_bugs as pb

REPO = pb.REPO
ID = re.compile(r"(\d\d)\.\d+[a-z]?-[a-z0-9]+(-[a-z0-9]+)*")


def test_every_lesson_catalogue_is_collected_and_holds_its_own_lesson():
    wrong, seen = [], 0
    for path in pb.catalogues():
        module = importlib.import_module(f"tests.{path.parent.name}.planted_bugs")
        lesson = path.parent.name[1:3]
        seen += len(module.BUGS)
        wrong += [f"{path.relative_to(REPO)}: {b.id} edits {b.file}, lesson {b.lesson}'s file"
                  for b in module.BUGS if b.lesson != lesson]
    assert seen == len(pb.BUGS) and seen > 0
    assert not wrong, "\n".join(wrong)


def test_every_bug_still_applies_inside_its_block_or_definition_and_touches_code():
    bad = []
    for bug in pb.BUGS:
        path = pb.SOLUTIONS / bug.file
        if not path.is_file():
            bad.append(f"{bug.id}: solutions/{bug.file} does not exist")
            continue
        bad += planted.problems(bug, path.read_text())
    assert not bad, ("these planted bugs no longer fit the solutions (see tests/planted.py); "
                     "update their 'where' or 'find' in tests/lNN_*/planted_bugs.py:\n"
                     + "\n".join(bad))


def test_every_bug_names_tests_that_exist():
    missing = []
    for bug in pb.BUGS:
        if not bug.tests:
            missing.append(f"{bug.id} names no test")
        for node in bug.tests:
            path, _, name = node.partition("::")
            if not (REPO / path).is_file():
                missing.append(f"{bug.id}: {path} does not exist")
            elif not re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), re.M):
                missing.append(f"{bug.id}: {node} does not exist (a test was renamed?)")
    assert not missing, "\n".join(missing)


def _task_marker(source: str, name: str) -> str | None:
    """The ``@pytest.mark.task("NN.M")`` right above ``def name(``, if there is one."""
    lines = source.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(f"def {name}("))
    while i > 0 and lines[i - 1].startswith(("@", " ", ")")):
        i -= 1
        found = re.match(r'@pytest\.mark\.task\("([0-9.]+[a-z]?)"\)', lines[i])
        if found:
            return found.group(1)
    return None


def test_every_bug_is_checked_by_tests_of_its_own_task():
    """A graded test puts reference code in place of the other tasks (lesson 05 does), so a
    bug named against another task's test would pass there whatever it breaks."""
    wrong = []
    for bug in pb.BUGS:
        if bug.task.endswith(".0"):  # code around the tasks: any test may catch it
            continue
        for node in bug.tests:
            path, _, name = node.partition("::")
            marker = _task_marker((REPO / path).read_text(), name)
            if marker is not None and marker != bug.task:
                wrong.append(f"{bug.id}: {name} grades task {marker}")
    assert not wrong, "\n".join(wrong)


def test_bug_ids_are_unique_and_name_their_lesson_and_task():
    ids = [b.id for b in pb.BUGS]
    assert sorted({i for i in ids if ids.count(i) > 1}) == []
    for b in pb.BUGS:
        found = ID.fullmatch(b.id)
        assert found, f"{b.id}: ids read NN.K-short-name"
        assert found.group(1) == b.lesson, f"{b.id} edits {b.file}, another lesson"
        assert b.why, f"{b.id} does not say what the mistake is"
        for where, _, _ in b.edits():
            if planted.TASK.fullmatch(where):
                assert where == b.task, f"{b.id} edits block {where}: its id starts {where}-"


SOURCE = '''\
import torch


LIMIT = 3  # the same as the limit below


class Trainer:
    def step(self, x):
        """One step."""
        # BEGIN SOLUTION 01.1: the step
        y = x * 2  # the limit
        return y
        # END SOLUTION

    def limit(self):
        return LIMIT


def main():
    # BEGIN SOLUTION 01.2: the first half
    a = 1
    # END SOLUTION
    b = 2
    # BEGIN SOLUTION 01.2: the second half
    c = a + b
    # END SOLUTION
    return c
'''


def _bug(where, find, replace="pass", **kw):
    return Bug("01.1-x", "01_x/x.py", where=where, find=find, replace=replace,
               tests=("t::t",), why="w", **kw)


def test_an_edit_is_found_inside_its_block_definition_or_the_module_only():
    assert "y = x * 3" in planted.apply(_bug("01.1", "y = x * 2", "y = x * 3"), SOURCE)
    # "LIMIT" occurs three times in the file: once in each span named here
    assert "LIMIT = 4" in planted.apply(_bug("<module>", "LIMIT = 3", "LIMIT = 4"), SOURCE)
    assert "return 4" in planted.apply(_bug("Trainer.limit", "LIMIT", "4"), SOURCE)
    # a task's blocks in one file are one span: the text must be in exactly one of them
    assert "c = a - b" in planted.apply(_bug("01.2", "a + b", "a - b"), SOURCE)
    with pytest.raises(planted.PlantError, match="occurs 0 times in '01.1'"):
        planted.apply(_bug("01.1", "return LIMIT"), SOURCE)  # outside the block
    with pytest.raises(planted.PlantError, match="occurs 2 times in 'Trainer'"):
        planted.apply(_bug("Trainer", "return"), SOURCE)
    with pytest.raises(planted.PlantError, match="has no definition 'Trainer.stop'"):
        planted.apply(_bug("Trainer.stop", "return"), SOURCE)
    with pytest.raises(planted.PlantError, match="has no solution block '01.3'"):
        planted.apply(_bug("01.3", "return"), SOURCE)
    # several edits are found in the original text, so a swap is two edits
    swap = _bug("main", "a = 1", "a = 2", more=(("main", "b = 2", "b = 1"),))
    assert "a = 2" in planted.apply(swap, SOURCE) and "b = 1" in planted.apply(swap, SOURCE)


def test_a_stale_entry_or_one_anchored_to_comment_text_is_refused():
    assert planted.problems(_bug("01.1", "y = x * 2", "y = x * 3"), SOURCE) == []
    stale = planted.problems(_bug("01.1", "y = x * 4", "y = x * 3"), SOURCE)
    assert stale and "occurs 0 times" in stale[0]
    only_comment = planted.problems(_bug("01.1", "# the limit", "# no limit"), SOURCE)
    assert only_comment and "only comments" in only_comment[0]
    with_comment = planted.problems(_bug("01.1", "2  # the limit", "3"), SOURCE)
    assert with_comment and "includes comment text" in with_comment[0]
    marker = planted.problems(_bug("main", "    a = 1\n    # END SOLUTION\n", "    a = 2\n"),
                              SOURCE)
    assert marker and "includes comment text '# END SOLUTION'" in marker[0]
    other_task = planted.problems(_bug("01.2", "a = 1", "a = 2"), SOURCE)
    assert other_task == ["01.1-x: edits block 01.2, so its id must start 01.2-"]
    no_change = planted.problems(_bug("01.1", "x * 2", "x*2"), SOURCE)
    assert no_change == ["01.1-x: the edit changes no code"]


def test_the_verdicts_distinguish_a_hole_a_timeout_and_the_wrong_message():
    bug = Bug("05.3-x", "05_x/y.py", where="05.3", find="a", replace="b", tests=("t::t",),
              expect=r"missing divide")
    assert pb.verdict(bug, 0, "1 passed")[0] == "SURVIVED"
    assert pb.verdict(bug, 1, "E   AssertionError: ... missing divide by world size\n"
                      "FAILED t::t")[0] == "caught"
    assert pb.verdict(bug, 1, "E   AssertionError: shapes differ\nFAILED t::t")[0] == \
        "WRONG REASON"
    assert pb.verdict(bug, 1, "E   Failed: Timeout >300.0s\nFAILED t::t")[0] == "WRONG REASON"
    assert pb.verdict(bug, 4, "ERROR: file or directory not found")[0] == "ERROR"
    plain = Bug("01.1-x", "01_x/y.py", where="01.1", find="a", replace="b", tests=("t::t",))
    assert pb.verdict(plain, 1, "E   assert 1 == 2\nFAILED t::t") == ("caught", "assert 1 == 2")
    assert pb.verdict(plain, 1, "E   Failed: Timeout >300.0s\nFAILED t::t")[0] == "WRONG REASON"
    assert pb.verdict(plain, 1, "E   RankFailure: rank 0 of 3 hung and was stopped")[0] == \
        "WRONG REASON"
    hang_ok = Bug("05.1-x", "05_x/y.py", where="05.1", find="a", replace="b", tests=("t::t",),
                  expect=r"hung and was stopped")
    assert pb.verdict(hang_ok, 1, "E   RankFailure: rank 0 of 3 hung and was stopped")[0] == \
        "caught"


def test_a_stale_edit_is_reported_not_run():
    bug = Bug("01.1-gone", "01_single_device/single_device.py", where="01.1",
              find="no such text", replace="x",
              tests=("tests/l01_single_device/test_single_device.py::t",))
    result = pb.run_one(bug, sys.executable, 60)
    assert result["verdict"] == "STALE" and "occurs 0 times in '01.1'" in result["detail"]


@pytest.mark.timeout(240)
def test_one_planted_bug_goes_through_the_whole_pipeline():
    """A fast bug (pure arithmetic, one process) is planted, tested and caught."""
    bug = next(b for b in pb.BUGS if b.id == "08.1-grads-sharded-at-stage-1")
    result = pb.run_one(bug, sys.executable, 200)
    assert result["verdict"] == "caught", result
