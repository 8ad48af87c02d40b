"""The suite's closing time table: where a run's test time went, lesson by lesson and the
machinery's share, and a line naming any lesson whose tests take over the budget."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import LESSON_BUDGET_S, NOTEBOOK_ROW, time_table
from tests.lessons import REPO


def test_the_table_splits_lessons_from_machinery_and_names_a_slow_lesson():
    times = {"harness": [10, 300.0], "l01_single_device": [5, 60.0],
             "l09_fsdp": [7, LESSON_BUDGET_S + 40.0], NOTEBOOK_ROW: [2, 50.0]}
    lines = time_table(times)
    total = 300 + 60 + LESSON_BUDGET_S + 40 + 50
    assert lines[0].endswith(f"{total:.0f} s in all):")
    row = next(ln for ln in lines if "harness" in ln)
    assert f"{100 * 300 / total:5.1f}%" in row and "   10 tests" in row
    share = 100 * (60 + LESSON_BUDGET_S + 40) / total
    assert f"lessons' own tests {share:.0f}%, their notebooks {100 * 50 / total:.0f}%, " \
           f"machinery and others {100 - share - 100 * 50 / total:.0f}%" in "\n".join(lines)
    slow = [ln for ln in lines if ln.startswith("slow lesson:")]
    assert len(slow) == 1 and "tests/l09_fsdp" in slow[0], lines


@pytest.mark.timeout(120)
def test_a_run_over_two_folders_ends_with_the_table():
    tests = ["tests/harness/test_time_table.py::test_the_table_splits_lessons_from_machinery_and_"
             "names_a_slow_lesson", "tests/l01_single_device"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-n", "0",
                          "-p", "no:cacheprovider", tests[0], f"{tests[1]}/test_single_device.py",
                          "-k", "slow_lesson or short_last_batch"],
                         cwd=REPO, capture_output=True, text=True, timeout=110).stdout
    assert "test time by folder" in out, out[-2000:]
    assert "  harness " in out and "  l01_single_device " in out, out[-2000:]
