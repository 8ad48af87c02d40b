"""The generator of exercises/ and notebooks/, and the drift between them and solutions/."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from dpt.notebook import pending_task
from tests.lessons import REPO

sys.path.insert(0, str(REPO / "tools"))
import make_exercises as gen  # noqa: E402

SOLUTION = '''def f(x):
    y = 1
    # BEGIN SOLUTION 09.1: double "x"
    return 2 * x
    # END SOLUTION
'''


def test_a_block_becomes_a_raise_at_its_indentation():
    text, tasks = gen.strip_solutions(SOLUTION)
    assert tasks == ["09.1"]
    assert '    raise NotImplementedError("Task 09.1: double \\"x\\"")\n' in text
    assert "2 * x" not in text and "y = 1" in text
    namespace = {}
    exec(text, namespace)
    with pytest.raises(NotImplementedError, match='Task 09.1: double "x"'):
        namespace["f"](1)


@pytest.mark.parametrize("bad", [
    "# BEGIN SOLUTION 09.1: a\nx = 1\n",                  # never closed
    "x = 1\n# END SOLUTION\n",                             # END without BEGIN
    "# BEGIN SOLUTION 09.1: a\n# BEGIN SOLUTION 09.2: b\n# END SOLUTION\n",
    "# BEGIN SOLUTION: no task id\n# END SOLUTION\n",      # malformed
])
def test_broken_markers_are_refused(bad):
    with pytest.raises(gen.MarkerError):
        gen.strip_solutions(bad)


def test_committed_exercises_and_notebooks_are_up_to_date():
    stale = gen.stale(REPO)
    assert not stale, ("exercises/ or notebooks/ are stale; run `make exercises` and commit:\n"
                       + "\n".join(stale))


def test_the_trees_are_parallel_and_module_names_unique():
    sol, ex = REPO / "solutions", REPO / "exercises"
    lessons = sorted(p.name for p in sol.iterdir() if p.is_dir())
    assert lessons and lessons == sorted(p.name for p in ex.iterdir() if p.is_dir())
    seen = {}
    for lesson in lessons:
        assert re.fullmatch(r"\d\d_[a-z0-9_]+", lesson), lesson
        for py in (sol / lesson).glob("*.py"):
            if py.name == gen.NOTEBOOK_SOURCE:
                continue
            assert py.stem not in seen, f"{py.stem}.py is in {seen.get(py.stem)} and {lesson}"
            seen[py.stem] = lesson


def test_every_task_has_tests_and_every_test_task_exists():
    tasks = set()
    for py in (REPO / "solutions").rglob("*.py"):
        tasks |= set(gen.strip_solutions(py.read_text(), str(py))[1])
    marked = set()
    for py in (REPO / "tests").rglob("test_*.py"):
        marked |= set(re.findall(r"mark\.task\(\"(\d\d\.\d+[a-z]?)\"\)", py.read_text()))
    assert tasks - marked == set(), f"tasks with no test: {sorted(tasks - marked)}"
    assert marked - tasks == set(), f"tests for tasks that do not exist: {sorted(marked - tasks)}"


# What a student reads after `make grade` on a fresh tree: one line per failing test and the
# score table. The untouched exercises, where every graded test fails, print the most. Beyond
# those lines, this many more (progress dots, headers, totals) at most: no tracebacks, no
# warnings summary.
GRADE_OVERHEAD = 40


def _grade_exercises(tmp_path, env=None):
    out = tmp_path / "grade.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--target", str(REPO / "exercises"), "--grade",
         "--grade-json", str(out), "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-m", "not slow", "--timeout", "120", str(REPO / "tests")],
        capture_output=True, text=True, timeout=1200, cwd=REPO,
        env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_stubs_fail_each_with_their_own_task_message(tmp_path):
    """`make grade` on the untouched exercises: every task fails, naming itself, and the
    whole report stays short enough to read (one line per failing test, then the table)."""
    result, stdout = _grade_exercises(tmp_path)
    scores = result["tasks"]
    assert scores, "no task was graded"
    for task, s in scores.items():
        assert s["state"] == "fail", f"task {task} is {s['state']} on its stub: {s}"
        assert f"Task {task}" in s["first_error"], f"task {task} failed with: {s['first_error']}"
    lines = stdout.splitlines()
    failing = sum(s["failed"] for s in scores.values())
    lessons = {task.split(".")[0] for task in scores}
    budget = failing + len(scores) + len(lessons) + GRADE_OVERHEAD
    assert len(lines) <= budget, (
        f"grading the untouched exercises printed {len(lines)} lines, more than one per failing "
        f"test ({failing}), one per task ({len(scores)}) and lesson ({len(lessons)}), and "
        f"{GRADE_OVERHEAD} more: "
        "a student scrolls through all of it; first lines:\n" + "\n".join(lines[:40]))


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(1300)
def test_without_data_the_stubs_still_score_nothing_and_the_grade_says_it_is_incomplete(
        tmp_path):
    """Data missing: skipped tests count neither way, no stub scores, and the grade says why."""
    empty = tmp_path / "no-data"
    empty.mkdir()
    result, stdout = _grade_exercises(tmp_path, env={
        "DPT_DATA": str(empty), "DPT_DEBIAN_DIR": str(empty), "DPT_OFFLINE": "1"})
    scores = result["tasks"]
    assert scores, "no task was graded"
    for task, s in scores.items():
        assert s["state"] != "pass", f"task {task} passes on its stub without data: {s}"
        assert s["passed"] == 0, f"task {task}: {s['passed']} test(s) pass on the stub: {s}"
    skipped = sum(s["skipped"] for s in scores.values())
    assert skipped > 0, "no test needed the data: this test no longer checks anything"
    assert result["complete"] is False
    assert "score incomplete" in stdout and "make data" in stdout, stdout[-2000:]



_L04 = "tests/l04_ddp_torchrun/test_ddp_torchrun.py::"
_UNMARKED = _L04 + "test_without_torchrun_the_script_says_how_to_launch"  # needs task 04.1
_MARKED = _L04 + "test_torchrun_env_defaults_and_reads_os_environ"  # task 04.1 itself


def _run_on(tree, *node_ids):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--target", str(tree), "-q", "-rs", "-p", "no:randomly",
         "-p", "no:cacheprovider", "-p", "no:xdist", *node_ids],
        capture_output=True, text=True, timeout=240, cwd=REPO)


@pytest.mark.timeout(300)
def test_an_unmarked_test_stopped_by_a_stub_is_skipped_and_names_the_task(tmp_path):
    """On a student's tree an unmarked test that reaches a stub says which task it needs; a
    task's own test still fails on it, and any other error in an unmarked test still fails."""
    proc = _run_on(REPO / "exercises", _UNMARKED, _MARKED)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 failed, 1 skipped" in out, out[-3000:]
    assert "needs Task 04.1, not done yet" in out, out[-3000:]
    assert "skipped 1 unmarked test(s) that need a task not done yet: Task 04.1 (1)" in out
    # the same stub raising another error than NotImplementedError is a real failure
    tree = tmp_path / "exercises"
    shutil.copytree(REPO / "exercises", tree, ignore=shutil.ignore_patterns("__pycache__"))
    lesson = tree / "04_ddp_torchrun" / "ddp_torchrun.py"
    text = lesson.read_text()
    stub = 'raise NotImplementedError("Task 04.1: '
    assert text.count(stub) == 1, "task 04.1's stub changed: update this test"
    lesson.write_text(text.replace(stub, 'raise RuntimeError("Task 04.1: '))
    proc = _run_on(tree, _UNMARKED)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 failed" in out and "skipped" not in out, out[-3000:]


def test_lesson_paths_point_at_the_students_tree():
    text = "python solutions/06_mixed_precision/amp_train.py; see ../solutions/x and my_solutions/01_a"
    assert gen.to_exercises_paths(text) == (
        "python exercises/06_mixed_precision/amp_train.py; see ../solutions/x and my_solutions/01_a")


def test_no_command_in_the_students_tree_runs_the_solutions():
    """Commands in exercises/ and notebooks/ run the student's code, never solutions/."""
    pointing = re.compile(r"(?<![\w.-])solutions/[\w.*{]")
    hits = []
    for tree in (REPO / "exercises", REPO / "notebooks"):
        for path in sorted(tree.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for lineno, line in enumerate(text.splitlines(), 1):
                if pointing.search(line):
                    hits.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()[:100]}")
    assert not hits, ("the student's tree points at solutions/ (it would run the reference "
                      "answers, not the student's code):\n" + "\n".join(hits[:20]))


# ------------------------------------------------- lessons as diffs (01 -> 03 -> 04, 03 -> 06)

# The most lines of code one lesson may change in the previous lesson's main file: "about 80",
# what a reader takes in as one step (PyTorch's DDP tutorial series grows by 40 and 59 lines).
# gen.code_lines_changed counts lines added plus lines removed, and leaves out blank lines,
# comment-only lines (solution markers included) and docstrings: prose may grow freely.
# Lessons 01, 03, 04 and 06 write their data, model, optimizer, training and evaluation out in
# the same train_and_evaluate (lesson 03 carries lesson 01's), so a step changes only how the
# processes start and join, and what is new (01 -> 03 about 65 lines, 03 -> 06 about 40).
CHANGE_BUDGET = 85
# One step is allowed more: 03 -> 04 (about 95 lines) replaces the launch with torchrun's
# variables and the checkpoint with a snapshot (every rank's random state, the sampler's seed).
LARGER_STEPS = {"04_ddp_torchrun/ddp_torchrun.py": 100}


def test_code_lines_changed_counts_code_only():
    before = 'def f(x):\n    """Double x."""\n    return 2 * x\n'
    after = ('def f(x):\n    """Double x, then add one.\n\n    More words.\n    """\n'
             '    # a comment\n\n    y = 2 * x\n    return y + 1\n')
    assert gen.code_lines_changed(before, before) == 0
    assert gen.code_lines_changed(before, after) == 3  # -return 2 * x, +y = 2 * x, +return y + 1


@pytest.mark.parametrize("before, after", gen.GROWTH, ids=lambda p: p.split("_")[0])
def test_each_lesson_grows_its_parents_main_file_within_the_budget(before, after):
    sol = REPO / "solutions"
    a, b = sol / before, sol / after
    changed = gen.code_lines_changed(a.read_text(), b.read_text())
    budget = LARGER_STEPS.get(after, CHANGE_BUDGET)
    assert changed <= budget, (
        f"{b.relative_to(sol)} changes {changed} lines of code of {a.relative_to(sol)} "
        f"(budget {budget}): move plumbing into dpt/, or keep the shapes the same")
    assert (b.parent / gen.CHANGES).read_text() == gen.changes_diff(a, b), (
        "CHANGES.diff is stale: run `make exercises`")


# ------------------------------------------------------------- carried code (one source each)

PARENT = '''class T:
    def step(self):
        """One step."""
        # BEGIN SOLUTION 09.1: take one step
        return 1
        # END SOLUTION

    def other(self):
        return "parent"


@decorated
def save(x):
    return x + 1
'''

CHILD = '''class T:
    # CARRIED FROM 09_parent (generated: edit it there, then `make exercises`)
    def step(self):
        return "stale"

    def other(self):
        return "child"


# CARRIED FROM 09_parent (generated: edit it there, then `make exercises`)
def save(x):
    return x


def extra():
    return 0
'''


def test_carried_definitions_are_the_parents_with_copy_your_answer_hints():
    out = gen.carry(PARENT, CHILD, "09_parent")
    assert "stale" not in out and "return x + 1" in out and "@decorated" in out
    assert "# BEGIN SOLUTION 09.1: copy your answer from lesson 09\n" in out
    assert "take one step" not in out
    assert out.count("# END SOLUTION") == 1, "the END marker closing the body is carried once"
    assert 'return "child"' in out and "def extra" in out, "unmarked code is the child's own"
    assert gen.carry(PARENT, out, "09_parent") == out  # regenerating changes nothing


@pytest.mark.parametrize("child, why", [
    (CHILD.replace("09_parent", "08_other", 1), "parent in GROWTH"),
    (CHILD.replace("def step", "x = 1\n\n    def step"), "right above a def"),
    (CHILD.replace("def save", "def saved"), "no saved"),
])
def test_bad_carried_markers_are_refused(child, why):
    with pytest.raises(gen.MarkerError, match=why):
        gen.carry(PARENT, child, "09_parent")


def test_every_growing_lesson_carries_code_and_its_copies_match_their_source():
    """solutions/ holds each carried function once, in the lesson that introduced it."""
    texts = gen.carried_texts(REPO / "solutions")
    assert set(texts) == {REPO / "solutions" / child for _, child in gen.GROWTH}
    for path, text in texts.items():
        assert gen.CARRIED.search(text), f"{path.name} carries nothing: is the marker gone?"
        assert path.read_text() == text, (
            f"{path.relative_to(REPO)}: carried code was edited here; edit it in the lesson "
            "it comes from and run `make exercises`")


# ---------------------------------- `make carry`: the student's own answers in the carried copies

_CARRIED_NAMES = ("Trainer._run_batch", "save_checkpoint", "load_checkpoint")  # lesson 01's tasks
_MAIN_01 = "01_single_device/single_device.py"


def _carry_tool():
    """tools/carry_answers.py, imported here so that its absence fails these tests only."""
    import carry_answers
    return carry_answers


def _student_tree(tmp_path, fill_01=True):
    """A student's course folder without solutions/: tools/ (the two scripts the command
    needs) and a copy of exercises/, with lesson 01's tasks answered as solutions/ does."""
    root = tmp_path / "course"
    shutil.copytree(REPO / "exercises", root / "exercises",
                    ignore=shutil.ignore_patterns(*gen.SKIP_DIRS))
    (root / "tools").mkdir()
    for name in ("carry_answers.py", "make_exercises.py"):
        if (REPO / "tools" / name).is_file():
            shutil.copy(REPO / "tools" / name, root / "tools" / name)
    if fill_01:
        _answer(root / "exercises" / _MAIN_01, REPO / "solutions" / _MAIN_01)
    return root


def _answer(exercise, solution):
    """Replace each stub of ``exercise`` with the body of the same task's solution block."""
    blocks, body = [], None
    for line in solution.read_text().splitlines(keepends=True):
        if (m := gen.BEGIN.match(line)):
            body = (m["task"], [])
        elif gen.END.match(line):
            blocks.append(body)
            body = None
        elif body is not None:
            body[1].append(line)
    stub = re.compile(r'^\s*raise NotImplementedError\("(Task \d\d\.\d+[a-z]?)')
    out = []
    for line in exercise.read_text().splitlines(keepends=True):
        m = stub.match(line)
        if m:
            task, lines = blocks.pop(0)
            assert m[1] == f"Task {task}", f"{exercise.name}: stubs and solution blocks disagree"
            out.extend(lines)
        else:
            out.append(line)
    assert not blocks, f"{exercise.name}: solution blocks left over: {blocks}"
    exercise.write_text("".join(out))


def _definition(path, name):
    text = path.read_text()
    node = gen._definitions(text)[name]
    lines = text.splitlines(keepends=True)
    return "".join(lines[slice(*gen._span(lines, node))])


def _snapshot(tree):
    return {p: p.read_bytes() for p in sorted(tree.rglob("*")) if p.is_file()}


def test_carried_stubs_say_that_make_carry_brings_the_answer():
    """In exercises/ a carried copy's stub names its lesson and `make carry`; its marker holds
    the fingerprint that lets `make carry` tell a copy the student edited by hand."""
    for _, child in gen.GROWTH:
        path = REPO / "exercises" / child
        text = path.read_text()
        lesson = path.parent.name[:2]
        stubs = re.findall(r'NotImplementedError\("Task (\d\d)\.\d+[a-z]?(.*)"\)', text)
        carried = [(nn, rest) for nn, rest in stubs if nn != lesson]
        assert carried, f"{child}: no carried stub left to check"
        for nn, rest in carried:
            assert rest.startswith(f": your answer from lesson {nn}; run `make carry`"), (
                f"{child}: a carried stub reads 'Task {nn}.K{rest}': it must say that "
                "`make carry` brings the student's answer from that lesson")
        markers = [line for line in text.splitlines() if line.strip().startswith("# from lesson")]
        assert markers and all(re.search(r"\[carry [0-9a-f]{8}\]$", m) for m in markers), (
            f"{child}: every '# from lesson' line needs its [carry <fingerprint>]: {markers}")
    # a carried stub stays a stub to the harness, even in two ranks' interleaved tracebacks
    stub = gen.carried_stub("01.1")
    assert pending_task(NotImplementedError(stub)) == "Task 01.1"
    assert pending_task(RuntimeError(f"NotImplementedErrorNotImplementedError: : {stub}")) == (
        "Task 01.1")


@pytest.mark.tools  # make carry run whole in a student's tree: make check-tools
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_make_carry_puts_the_students_lesson_01_answers_into_lesson_03(tmp_path):
    """In a student's tree with no solutions/, one command copies their lesson-01 answers into
    every carried copy (03, then 04 and 06 from 03), and lesson 03's tests of that code pass."""
    root = _student_tree(tmp_path)
    tree = root / "exercises"
    assert not (root / "solutions").exists()
    proc = subprocess.run([sys.executable, str(root / "tools" / "carry_answers.py")],
                          capture_output=True, text=True, timeout=60, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    answers = {name: _definition(tree / _MAIN_01, name) for name in _CARRIED_NAMES}
    for name, answer in answers.items():
        assert "NotImplementedError" not in answer, f"lesson 01's {name} is still a stub"
    for _, child in gen.GROWTH:
        carried = {c[2] for c in gen.carried_copies((tree / child).read_text())} & set(answers)
        assert carried >= {"save_checkpoint", "load_checkpoint"}, f"{child} carries {carried}"
        for name in carried:
            assert _definition(tree / child, name) == answers[name], (
                f"{child}: {name} is not the student's lesson-01 answer after make carry:\n"
                + proc.stdout)
    assert "03_ddp_spawn/ddp_spawn.py: Trainer._run_batch" in proc.stdout, proc.stdout
    # lesson 03's own tasks are not done: lessons 04 and 06 carry them as stubs
    dataloader = _definition(tree / "04_ddp_torchrun/ddp_torchrun.py", "prepare_dataloader")
    assert "Task 03.3: your answer from lesson 03; run `make carry`" in dataloader, dataloader
    # lesson 03's DDP test runs task 01.1's _run_batch, carried: it was skipped, now it passes
    node = "tests/l03_ddp_spawn/test_ddp_spawn.py::" \
           "test_ddp_with_batch_b_on_two_ranks_equals_one_process_with_batch_2b"
    run = _run_on(tree, node)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "1 passed" in out, out[-3000:]


def test_make_carry_a_second_time_changes_nothing(tmp_path, capsys):
    """Idempotent, and a fresh exercises/ (every parent still a stub) is already carried: the
    generator and the command write the same copies."""
    carry = _carry_tool()
    fresh = _student_tree(tmp_path, fill_01=False) / "exercises"
    before = _snapshot(fresh)
    assert carry.main(["--tree", str(fresh)]) == 0
    assert _snapshot(fresh) == before, "make carry changed a freshly generated exercises/"
    filled = _student_tree(tmp_path / "filled") / "exercises"
    assert carry.main(["--tree", str(filled)]) == 0
    once = _snapshot(filled)
    assert once != _snapshot(fresh), "the first run carried nothing"
    capsys.readouterr()
    assert carry.main(["--tree", str(filled)]) == 0
    assert _snapshot(filled) == once, "a second make carry changed the tree"
    assert " 0 updated" in capsys.readouterr().out


def test_make_carry_keeps_a_copy_edited_by_hand_and_names_it(tmp_path, capsys):
    carry = _carry_tool()
    tree = _student_tree(tmp_path) / "exercises"
    assert carry.main(["--tree", str(tree)]) == 0
    child = tree / "03_ddp_spawn" / "ddp_spawn.py"
    edited = child.read_text().replace("def save_checkpoint(path", "def save_checkpoint(  path")
    assert edited != child.read_text()
    child.write_text(edited)
    parent = tree / _MAIN_01  # then the student changes the lesson-01 answer
    parent.write_text(parent.read_text().replace(
        "def save_checkpoint(path", "def save_checkpoint(path  "))
    capsys.readouterr()
    assert carry.main(["--tree", str(tree)]) == 1
    out = capsys.readouterr()
    kept = [line for line in out.out.splitlines() if "save_checkpoint" in line
            and line.startswith(("kept: 03_ddp_spawn/ddp_spawn.py", "error: 03_ddp_spawn"))]
    assert len(kept) == 1 and "by hand" in kept[0] and "--force" in kept[0], out
    assert child.read_text() == edited, "a copy edited by hand was overwritten"
    assert carry.main(["--tree", str(tree), "--lesson", "03", "--force"]) == 0
    assert child.with_name(child.name + ".bak").read_text() == edited
    assert (_definition(child, "save_checkpoint") == _definition(parent, "save_checkpoint"))
    assert "overwrote" in capsys.readouterr().out


def test_make_carry_refuses_bad_input_in_one_line(tmp_path, capsys):
    carry = _carry_tool()
    tree = _student_tree(tmp_path) / "exercises"
    before = _snapshot(tree)
    for argv in (["--tree", str(tmp_path / "nowhere")], ["--tree", str(tree), "--lesson", "05"],
                 ["--tree", str(tmp_path)]):
        assert carry.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)
    parent = tree / _MAIN_01
    parent.write_text(parent.read_text() + "\ndef broken(:\n")
    assert carry.main(["--tree", str(tree)]) == 1
    err = capsys.readouterr().err
    assert "error: 01_single_device/single_device.py does not parse" in err, err
    child = tree / "03_ddp_spawn" / "ddp_spawn.py"
    assert child.read_bytes() == before[child], "carried from a file that does not parse"
