"""The class grader (tools/grade_class.py): a folder of submissions in, a gradebook out.

The slow test grades a demo class (tools/class_demo.py) from a throwaway copy of the course,
so that the hostile `escape` submission aims at that copy, never at this checkout: honest,
stub, half-done, zipped and tarred submissions, and the hostile and broken ones (an infinite
loop at import, os._exit, a bounded fork bomb, a memory hog, a deadlocked collective, writes
and deletes outside its folder, a syntax error, a missing lesson, a patched test runner).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests import scoring
from tests.lessons import REPO
from tools import grade_class as gc
from tools import sandbox


def _course_lessons() -> dict[str, str]:
    return {"01": "01_single_device", "08": "08_sharding"}


def test_lessons_are_found_in_an_exercises_tree_and_in_a_clone(tmp_path):
    flat = tmp_path / "flat"
    (flat / "08_sharding").mkdir(parents=True)
    (flat / "01_single_device").mkdir()
    assert set(gc.find_lessons(flat, _course_lessons())) == {"01", "08"}
    clone = tmp_path / "clone" / "course-main"
    for tree in ("solutions", "exercises"):
        (clone / tree / "08_sharding").mkdir(parents=True)
    (clone / "tests" / "08_sharding").mkdir(parents=True)  # never the submission's tests/
    found = gc.find_lessons(tmp_path / "clone", _course_lessons())
    assert found == {"08": clone / "exercises" / "08_sharding"}


def test_archives_unpack_safely(tmp_path):
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("../outside.py", "x = 1\n")
    with pytest.raises(gc.GradeError, match="leaves the archive"):
        gc.unpack(bad, tmp_path / "bad")
    assert not (tmp_path / "outside.py").exists()
    src = tmp_path / "src" / "08_sharding"
    src.mkdir(parents=True)
    (src / "zero_accounting.py").write_text("x = 1\n")
    (src / "link.py").symlink_to("/etc/hostname")
    good = tmp_path / "good.tar.gz"
    with tarfile.open(good, "w:gz") as tf:
        tf.add(src, arcname="me/08_sharding")
    out = gc.unpack(good, tmp_path / "good")
    assert (out / "me" / "08_sharding" / "zero_accounting.py").read_text() == "x = 1\n"
    assert not (out / "me" / "08_sharding" / "link.py").exists()


def test_configuration_files_of_a_submission_are_never_copied(tmp_path):
    src = tmp_path / "08_sharding"
    (src / "sub").mkdir(parents=True)
    for name in ("conftest.py", "pytest.ini", "pyproject.toml", "setup.cfg", "ok.py",
                 "sub/conftest.py", "sub/ok.py", "evil.pth"):
        (src / name).write_text("")
    (src / "link").symlink_to(tmp_path)
    gc.copy_lesson_tree(src, tmp_path / "copy", [10**6])
    copied = sorted(str(p.relative_to(tmp_path / "copy")) for p in
                    (tmp_path / "copy").rglob("*"))
    assert copied == ["ok.py", "sub", "sub/ok.py"]


def _attempt(journal, tasks, tests):
    return gc.Attempt(0, 1.0, journal, {"tasks": tasks, "tests": tests}, "")


def test_a_result_file_that_disagrees_with_the_reports_is_caught():
    expected = {"t::a": "08.1", "t::b": "08.1"}
    journal = [{"nodeid": n, "task": "08.1", "when": w, "outcome": o}
               for n in expected for w, o in (("setup", "passed"), ("call", "failed"),
                                              ("teardown", "passed"))]
    honest = {"08.1": {"passed": 0, "failed": 2, "skipped": 0, "total": 2}}
    assert gc.cross_check(_attempt(journal, honest, expected), expected, [], set(expected)) == ""
    forged = {"08.1": {"passed": 2, "failed": 0, "skipped": 0, "total": 2}}
    assert "differ" in gc.cross_check(_attempt(journal, forged, expected), expected, [],
                                      set(expected))
    fewer = {"t::a": "08.1"}
    assert "other tests" in gc.cross_check(_attempt(journal[:3], honest, fewer), expected, [],
                                           {"t::a"})


def test_points_feed_the_gradebook_and_gradescope(tmp_path, monkeypatch):
    monkeypatch.setitem(scoring.POINTS, "08.2", 3.0)
    course = gc.Course(REPO, {"08": "08_sharding"}, {"08": "tests/l08_sharding"},
                       {"08": {"t::a": "08.1", "t::b": "08.2"}})
    entry = dict(gc.new_entry(), passed=1, total=1)
    failed = dict(gc.new_entry(), failed=1, total=1, first_error="AssertionError: no")
    lesson = gc._finish({"08.1": failed, "08.2": entry}, {}, [], 2.0)
    result = gc.SubmissionResult(gc.Submission("ann", tmp_path), {"08": lesson})
    gc.write_gradebook(tmp_path / "book.csv", course, [result])
    row = next(csv.DictReader((tmp_path / "book.csv").read_text().splitlines()))
    assert (row["08.1"], row["08.2"], row["total"], row["max"]) == ("0", "3", "3", "4")
    gs = gc.gradescope_results(course, result, None)
    assert gs["score"] == 3.0
    assert [(t["name"], t["score"], t["max_score"]) for t in gs["tests"]] == [
        ("Task 08.1", 0.0, 1.0), ("Task 08.2", 3.0, 3.0)]
    assert "AssertionError: no" in gs["tests"][0]["output"]
    text = gc.feedback_text(course, result)
    assert "08.1: AssertionError: no" in text and "3/4" in text


def test_the_sandbox_cuts_the_network_where_the_machine_allows_it():
    found = sandbox.probe()
    if found["net"] != "ok":
        pytest.skip(f"no network namespace here: {found['net']}")
    code = ("import socket\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"  # loopback works
            "try:\n    socket.create_connection(('192.0.2.1', 9), timeout=2)\n"
            "except OSError as e:\n    print('refused', e.errno)\n")
    proc = subprocess.run([sys.executable, sandbox.__file__, "--net", "none", "--",
                           sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused")


# --- the whole class, from a throwaway copy of the course ---------------------------------

EXPECTED = {  # submission: (08.1, 08.2, what the notes or feedback must say)
    "solutions": ("1", "1", ""),
    "untouched": ("0", "0", "NotImplementedError: Task 08.1"),
    "half_done": ("1", "1", ""),
    "import_loop": ("0", "1", "Timeout"),
    "os_exit": ("0", "1", "died (exit status 3)"),
    "fork_bomb": ("0", "1", "BlockingIOError"),
    "memory_hog": ("0", "1", "Cannot allocate memory"),
    "deadlock": ("0", "1", "Timeout"),
    "escape": ("1", "1", ""),
    "syntax_error": ("0", "1", "SyntaxError"),
    "missing_lesson": ("0", "0", "08_sharding/ is missing"),
    "tamper": ("0", "0", "tampered"),
}


def _throwaway_course(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for part in ("tools", "tests", "dpt"):
        shutil.copytree(REPO / part, dest / part, ignore=ignore)
    shutil.copyfile(REPO / "pyproject.toml", dest / "pyproject.toml")
    for tree in ("solutions", "exercises"):
        for lesson in ("01_single_device", "08_sharding"):
            shutil.copytree(REPO / tree / lesson, dest / tree / lesson, ignore=ignore)
    (dest / "data").mkdir()
    return dest


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if "__pycache__" not in p.parts)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_demo_class_grades_in_one_command(tmp_path):
    course = _throwaway_course(tmp_path / "course")
    subs = tmp_path / "subs"
    env = dict(os.environ, PYTHONPATH=str(course))
    subprocess.run([sys.executable, "-m", "tools.class_demo", str(subs)], cwd=course,
                   env=env, check=True, capture_output=True, timeout=120)
    before = {part: _listing(course / part) for part in ("tests", "dpt", "tools")}
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.grade_class", str(subs), "--out", str(out),
         "--lessons", "08", "--tasks", "08.1,08.2", "--jobs", "2", "--test-timeout", "15",
         "--lesson-timeout", "200", "--mem-gb", "6", "--nproc", "64", "--no-progress"],
        cwd=course, env=env, capture_output=True, text=True, timeout=1150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["submission"]: r for r in csv.DictReader((out / "gradebook.csv").read_text().splitlines())}
    assert set(rows) == set(EXPECTED)
    for name, (t1, t2, says) in EXPECTED.items():
        row = rows[name]
        feedback = (out / "feedback" / f"{name}.txt").read_text()
        assert (row["08.1"], row["08.2"]) == (t1, t2), (name, row, feedback)
        assert row["total"] == str(int(t1) + int(t2)) and row["max"] == "2"
        assert says in row["notes"] + feedback, (name, row["notes"], feedback)
        gs = json.loads((out / "gradescope" / name / "results.json").read_text())
        assert gs["score"] == int(t1) + int(t2)
    # The escape attempt changed nothing of the course the grader used.
    isolation = json.loads((out / "summary.json").read_text())["isolation"]
    protected = any(n.startswith("files: read-only") for n in isolation) or any(
        "own unprivileged uid" in n for n in isolation)
    if protected:
        assert not (course / "ESCAPED.txt").exists()
        assert {part: _listing(course / part) for part in before} == before
