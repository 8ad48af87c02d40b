"""The class grader (tools/grade_class.py): a folder of submissions in, a gradebook out.

The slow test grades a demo class (tools/class_demo.py) from a throwaway copy of the course,
so that the hostile `escape` submission aims at that copy, never at this checkout: honest,
stub, half-done, zipped and tarred submissions, and the hostile and broken ones (an infinite
loop at import, os._exit, a bounded fork bomb, a memory hog, a deadlocked collective, writes
and deletes outside its folder, a syntax error, a missing lesson, a patched test runner).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
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


def test_the_gradebook_and_the_reports_list_tasks_in_task_order(tmp_path):
    """Lesson 09 has tasks 09.1-09.23: a text sort made the columns 09.1, 09.10, ..., 09.2."""
    ids = ["09.10", "09.2", "09.1", "09.11", "09.3"]
    course = gc.Course(REPO, {"09": "09_fsdp"}, {"09": "tests/l09_fsdp"},
                       {"09": {f"t::{t}": t for t in ids}})
    want = ["09.1", "09.2", "09.3", "09.10", "09.11"]
    assert course.tasks("09") == want
    long_reason = " ".join(f"reason{i}" for i in range(40))
    entries = {t: dict(gc.new_entry(), failed=1, total=1, first_error=long_reason) for t in ids}
    result = gc.SubmissionResult(gc.Submission("ann", tmp_path),
                                 {"09": gc._finish(entries, {}, [], 1.0)})
    gc.write_gradebook(tmp_path / "book.csv", course, [result])
    header = (tmp_path / "book.csv").read_text().splitlines()[0].split(",")
    assert header[1:6] == want, header
    assert [t["number"] for t in gc.gradescope_results(course, result, None)["tests"]] == want
    text = gc.feedback_text(course, result)
    rows = [line.split()[1] for line in text.splitlines() if line.startswith("09      09.")]
    assert rows == want, text
    assert all(len(line) <= 100 for line in text.splitlines()), "a feedback line is too long"
    assert long_reason in " ".join(text.split()), "a reason was cut in the feedback"


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
    "import_loop": ("0", "0", "(stuck at zero_accounting.py line"),  # via fsdp2_train.py
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


@pytest.mark.tools
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
        feedback = " ".join((out / "feedback" / f"{name}.txt").read_text().split())
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


# --- what real machines do to the grader ---------------------------------------------------

IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def _submission(dest: Path, tree: str, lessons: tuple[str, ...]) -> Path:
    for lesson in lessons:
        shutil.copytree(REPO / tree / lesson, dest / lesson, ignore=IGNORE)
    return dest


def _shared_folder(path: Path) -> Path:
    """A folder the sandbox's own uid can write to (it keeps read and search everywhere)."""
    path.mkdir()
    path.chmod(0o777)
    return path


def _grade(subs: Path, out: Path, *extra: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.grade_class", str(subs), "--out",
                           str(out), "--jobs", "2", "--no-progress", *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _probe_args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"jobs": 1, "import_timeout": 2.0, "mem_gb": 8.0, "nproc": 512,
                                 "keep": False, "allow_network": False, **kw})


def test_the_import_probe_blames_a_module_that_hangs_or_exits_at_import(tmp_path):
    lessons = {"01": "01_single_device", "03": "03_ddp_spawn"}
    root = tmp_path / "sub"
    (root / lessons["01"]).mkdir(parents=True)
    (root / lessons["03"]).mkdir(parents=True)
    (root / lessons["01"] / "helpers.py").write_text("X = 1\n")
    (root / lessons["01"] / "broken.py").write_text("def f(:\n")  # the tests report this one
    (root / lessons["01"] / "single_device.py").write_text(
        "import time\n\nimport helpers\n\nwhile helpers.X:  # never returns\n"
        "    time.sleep(0.05)\n")
    (root / lessons["03"] / "ddp_spawn.py").write_text("import os\n\nos._exit(3)\n")
    args = _probe_args()
    course = gc.Course(REPO, lessons, {n: f"tests/l{v}" for n, v in lessons.items()})
    box = gc.Sandbox(course, gc.probe_isolation(args), args)
    sub = gc.Submission("sub", root, {n: root / v for n, v in lessons.items()})
    uid = box.uids.get()
    hang = box.probe_imports(sub, "01", uid)
    assert re.search(r"importing single_device\.py did not finish in \d+ s \(stuck at "
                     r"single_device\.py line [56]\): a loop at import time\?", hang.problem), hang
    limit = gc.import_limit(args.import_timeout)
    assert hang.seconds < limit * gc.WARM_FACTOR + 60, hang
    died = box.probe_imports(sub, "03", uid)
    assert died.problem == ("importing ddp_spawn.py ended the process (exit status 3): "
                            "os._exit or a crash at import time?"), died
    (root / lessons["01"] / "single_device.py").write_text("import helpers\n")
    assert box.probe_imports(sub, "01", uid).problem == ""  # SyntaxError: the tests say so


LOOP_AT_IMPORT = "\nimport time as _t\n\nwhile True:  # never returns\n    _t.sleep(0.05)\n"
EXIT_AT_IMPORT = "\nimport os as _os\n\n_os._exit(3)\n"


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(660)
def test_a_lesson_that_hangs_or_exits_at_import_costs_seconds_not_every_test_timeout(tmp_path):
    """Before the import probe, the hanging lesson 01 cost each of its tests' 300 s timeout in
    turn, up to the 1200 s lesson limit (a class of three took over 28 minutes on 2 cores)."""
    lessons = ("01_single_device", "03_ddp_spawn")
    subs = tmp_path / "subs"
    _submission(subs / "solutions", "solutions", lessons)
    _submission(subs / "untouched", "exercises", lessons)
    hostile = _submission(subs / "hostile", "solutions", lessons)
    for path, extra in ((hostile / lessons[0] / "single_device.py", LOOP_AT_IMPORT),
                        (hostile / lessons[1] / "ddp_spawn.py", EXIT_AT_IMPORT)):
        path.write_text(path.read_text() + extra)
    out = tmp_path / "out"
    proc = _grade(subs, out, "--lessons", "01,03", "--tasks", "01.1,03.1", "--test-timeout",
                  "300", "--lesson-timeout", "1200", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["submission"]: r for r in
            csv.DictReader((out / "gradebook.csv").read_text().splitlines())}
    assert {n: (r["01.1"], r["03.1"]) for n, r in rows.items()} == {
        "solutions": ("1", "1"), "untouched": ("0", "0"), "hostile": ("0", "0")}
    # the feedback wraps long lines at word boundaries: read it as one line
    feedback = " ".join((out / "feedback" / "hostile.txt").read_text().split())
    assert re.search(r"01\.1: importing single_device\.py did not finish in \d+ s \(stuck at "
                     r"single_device\.py line \d+\): a loop at import time\?", feedback), feedback
    assert ("03.1: importing ddp_spawn.py ended the process (exit status 3): os._exit or a "
            "crash at import time?") in feedback, feedback
    assert "its tests were not run" in rows["hostile"]["notes"], rows["hostile"]
    assert "importing" not in (out / "feedback" / "untouched.txt").read_text()
    summary = json.loads((out / "summary.json").read_text())
    # Both lessons together: under half of what lesson 01 alone cost before (1200 s), even
    # with the import limit stretched for a loaded machine (the load per core, 8 times at most).
    assert summary["submissions"]["hostile"]["seconds"] < 600, summary["submissions"]


IDENTITY_REPORT = """

# --- added by the test: as if this uid had no passwd entry, then what torch & co. look up ----
import getpass as _getpass  # noqa: E402
import json as _json  # noqa: E402
import os as _os  # noqa: E402
import pwd as _pwd  # noqa: E402


def _no_entry(uid):
    raise KeyError(f"getpwuid(): uid not found: {{uid}}")


_pwd.getpwuid = _no_entry


def _writable(path):
    _os.makedirs(path, exist_ok=True)
    with open(_os.path.join(path, "written-by-the-lesson.txt"), "w") as f:
        f.write("ok")
    return path


def _inductor_cache():
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # another torch: nothing to check here
        return "n/a"
    return _writable(cache_dir())


def _matplotlib_config():
    try:
        import matplotlib
    except ImportError:
        return "n/a"
    return _writable(matplotlib.get_configdir())


_found = {{}}
for _key, _look_up in (("user", _getpass.getuser),
                       ("home", lambda: _writable(_os.path.expanduser("~"))),
                       ("inductor", _inductor_cache), ("matplotlib", _matplotlib_config)):
    try:
        _found[_key] = _look_up()
    except Exception as _exc:  # noqa: BLE001
        _found[_key] = f"failed: {{type(_exc).__name__}}: {{_exc}}"
with open(_os.path.join({reports!r}, f"{{_os.getpid()}}.json"), "w") as _f:
    _json.dump(_found, _f)
"""


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sandboxed_uid_without_a_passwd_entry_has_a_name_a_home_and_caches(tmp_path):
    """On a GPU machine torch looks the user up (its compiler's cache folder): the sandbox's
    uid has no passwd entry, so lesson 08 died with KeyError: 'getpwuid(): uid not found'."""
    reports = _shared_folder(tmp_path / "reports")
    sub = _submission(tmp_path / "subs" / "ann", "solutions", ("01_single_device",))
    module = sub / "01_single_device" / "single_device.py"
    module.write_text(module.read_text() + IDENTITY_REPORT.format(reports=str(reports)))
    out = tmp_path / "out"
    proc = _grade(tmp_path / "subs", out, "--lessons", "01", "--tasks", "01.1", timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = [json.loads(p.read_text()) for p in reports.glob("*.json")]
    assert found, "the lesson module was never imported: " + proc.stderr[-2000:]
    for report in found:
        assert not any(str(v).startswith("failed") for v in report.values()), report
        assert report["user"], report
        for key in ("home", "inductor", "matplotlib"):  # inside the grader's temporary copy
            assert report[key] == "n/a" or "/dpt-grade-" in report[key], (key, report)
    row = next(csv.DictReader((out / "gradebook.csv").read_text().splitlines()))
    assert row["01.1"] == "1", (row, (out / "feedback" / "ann.txt").read_text())


SLEEPY_LESSON = '''"""Every test that uses this module sleeps, with a child that sleeps too."""
import os
import subprocess
import time


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    subprocess.Popen(["sleep", "300"])
    open(os.path.join({marks!r}, f"sleeping-{{os.getpid()}}"), "w").close()
    time.sleep(300)
    raise AttributeError(name)
'''


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, start time) of every process this machine shows."""
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            found[int(entry.name)] = (int(fields[1]), fields[0], fields[19])
    return found


def _descendants(root: int) -> dict[int, str]:
    """pid -> start time of every process below ``root``."""
    procs = _processes()
    out, todo = {}, [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, _, started) in procs.items():
            if ppid == parent and pid not in out:
                out[pid] = started
                todo.append(pid)
    return out


def _alive(pids: dict[int, str]) -> list[str]:
    procs = _processes()
    alive = []
    for pid, started in pids.items():
        if pid in procs and procs[pid][2] == started and procs[pid][1] != "Z":
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    alive.append(f"{pid}: " + f.read().replace(b"\0", b" ").decode()[:100])
            except OSError:
                pass
    return alive


def _as_in_a_terminal() -> None:
    """The grader as a user starts it: Ctrl-C (SIGINT) and SIGTERM at their defaults. A suite
    started in the background by a script (`tools/stress_suite.sh &`) inherits SIGINT
    ignored, and the grader, by design, keeps a signal its parent ignores (SIGHUP under nohup)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_stopping_the_grader_stops_every_sandbox_it_started(tmp_path, signum):
    if signum == signal.SIGKILL and sandbox.probe()["pidns"] != "ok":
        pytest.skip("without a PID namespace a sandbox outlives a grader killed by SIGKILL")
    marks = _shared_folder(tmp_path / "marks")
    sub = tmp_path / "subs" / "sleepy" / "01_single_device"
    sub.mkdir(parents=True)
    (sub / "single_device.py").write_text(SLEEPY_LESSON.format(marks=str(marks)))
    out = tmp_path / "out"
    temp = tmp_path / "tmp"  # where the grader makes its temporary copies
    temp.mkdir()
    with open(tmp_path / "grader.log", "wb") as log:
        grader = subprocess.Popen(
            [sys.executable, "-m", "tools.grade_class", str(tmp_path / "subs"), "--out",
             str(out), "--lessons", "01", "--tasks", "01.1", "--jobs", "1", "--no-progress"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, TMPDIR=str(temp)), preexec_fn=_as_in_a_terminal)
    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 300
        while not list(marks.iterdir()):
            assert grader.poll() is None, (tmp_path / "grader.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no test of the lesson ever started"
            time.sleep(0.5)
        started = _descendants(grader.pid)
        assert len(started) >= 3, started  # the sandbox, pytest, the lesson's sleeping child
        grader.send_signal(signum)
        try:
            rc = grader.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the grader did not end within 60 s of {signum.name}")
        assert rc != 0
        deadline = time.monotonic() + 15
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _alive(started), (f"still running 15 s after the grader's {signum.name}",
                                     _alive(started))
        assert not (out / "gradebook.csv").exists()
        if signum != signal.SIGKILL:  # it cleaned up after itself
            assert not list(temp.iterdir()), list(temp.iterdir())
    finally:
        if grader.poll() is None:
            os.killpg(grader.pid, signal.SIGKILL)
            grader.wait()
        procs = _processes()
        for pid, when in started.items():  # what a failed run left behind
            if pid in procs and procs[pid][2] == when:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def test_the_graders_copy_carries_the_students_earlier_answers(tmp_path):
    """As `make grade` does, the grader brings a student's lesson 01 answers into lesson 03's
    carried copies: a student who never ran `make carry` is graded on their own lesson 01 code,
    not failed on the carried stubs."""
    lessons = {"01": "01_single_device", "03": "03_ddp_spawn"}
    root = tmp_path / "sub"
    shutil.copytree(REPO / "solutions" / lessons["01"], root / lessons["01"])  # 01 done
    shutil.copytree(REPO / "exercises" / lessons["03"], root / lessons["03"])  # 03 untouched
    stub = "Task 01.1: your answer from lesson 01"
    assert stub in (root / lessons["03"] / "ddp_spawn.py").read_text()
    args = _probe_args()
    course = gc.Course(REPO, lessons, {n: f"tests/l{v}" for n, v in lessons.items()})
    box = gc.Sandbox(course, gc.probe_isolation(args), args)
    sub = gc.Submission("sub", root, {n: root / v for n, v in lessons.items()})
    tmp, _work, target = box._copy(sub, "03", None)
    try:
        graded = (target / lessons["03"] / "ddp_spawn.py").read_text()
        assert stub not in graded, "the grader's copy of lesson 03 still has the carried stub"
        assert "loss.backward()" in graded, "lesson 01's _run_batch did not reach lesson 03"
        assert stub in (root / lessons["03"] / "ddp_spawn.py").read_text(), (
            "the grader changed the submission itself, not its copy")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
