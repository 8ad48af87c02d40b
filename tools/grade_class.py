"""Grade a whole class: a folder of submissions in, a gradebook out.

    make grade-class SUBMISSIONS=DIR            # or:
    python -m tools.grade_class DIR [--out grades] [--jobs N] [--lessons 01,08] [--tasks 08.1]

Each entry of DIR is one submission: a folder, a ``.zip`` or a ``.tar.gz``, holding an
``exercises/``-shaped tree or a whole clone of the course (the lesson folders ``NN_name/`` are
found either way). Each lesson of each submission is graded in a fresh temporary copy that
holds the course's own ``tests/``, ``dpt/`` and ``pyproject.toml`` and only the submission's
lesson folders, by ``pytest --grade`` in a sandbox (``tools/sandbox.py``): a wall-clock limit,
a memory limit, a process limit, no network, its own PID namespace and user where the machine
allows it. The grader writes, under ``--out``:

- ``gradebook.csv``: one row per submission, one column per task (points earned), the
  lessons' scores, the total, and a one-line note per problem;
- ``feedback/<name>.txt``: the score table and each failing task's first message;
- ``gradescope/<name>/results.json``: Gradescope's autograder format;
- ``summary.json``: all of it, with the isolation this machine allowed and the timings.

Points per task come from ``tests/scoring.py``, as for ``make grade``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python tools/grade_class.py` as well as `-m tools.grade_class`
    sys.path.insert(0, str(REPO))

from tests.scoring import (  # noqa: E402
    new_entry,
    points_for,
    record,
    shorten_message,
    task_order,
    task_state,
    wrap_line,
)
from tools import carry_answers  # noqa: E402

LESSON_RE = re.compile(r"^(\d\d)_\w+$")
# Never copied from a submission: anything pytest or Python would load as configuration.
BLOCKED_NAMES = {"conftest.py", "pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini",
                 "sitecustomize.py", "usercustomize.py", "__pycache__", ".pytest_cache"}
SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", "node_modules", ".ipynb_checkpoints",
             "tests", "dpt", "data", "notebooks", "benchmarks"}
MAX_SUBMISSION_BYTES = 200 * 2**20
MAX_LOG_BYTES = 20 * 2**20
UID_BASE = 200_000
AFTER_RESULT_GRACE_S = 20
# A failure that may come from an earlier task's leftovers (a fork bomb's sleeping children,
# memory held): the tasks failing so after the first one get a second run in a fresh process.
RESOURCE_ERROR = re.compile(r"BlockingIOError|Resource temporarily unavailable|MemoryError|"
                            r"Cannot allocate memory|Too many open files|can't start new thread")


class GradeError(Exception):
    """Bad input: one line for the grader."""


# --- the course --------------------------------------------------------------------------

@dataclass
class Course:
    root: Path
    lessons: dict[str, str]  # "01" -> "01_single_device" (lessons that have graded tests)
    test_dirs: dict[str, str]  # "01" -> "tests/l01_single_device"
    expected: dict[str, dict[str, str]] = field(default_factory=dict)  # lesson -> {id: task}

    def tasks(self, lesson: str) -> list[str]:
        return sorted(set(self.expected.get(lesson, {}).values()), key=task_order)  # 09.2 < 09.10


def load_course(root: Path, lessons: list[str] | None) -> Course:
    tree = root / "solutions" if (root / "solutions").is_dir() else root / "exercises"
    names = {m.group(1): p.name for p in sorted(tree.iterdir())
             if p.is_dir() and (m := LESSON_RE.match(p.name))}
    test_dirs = {p.name[1:3]: f"tests/{p.name}" for p in sorted((root / "tests").iterdir())
                 if p.is_dir() and re.match(r"^l\d\d_", p.name)}
    graded = {n: names[n] for n in names if n in test_dirs}
    if lessons:
        unknown = [n for n in lessons if n not in graded]
        if unknown:
            raise GradeError(f"no graded lesson {', '.join(unknown)}; "
                             f"choose from {', '.join(graded)}")
        graded = {n: graded[n] for n in lessons}
    return Course(root, graded, {n: test_dirs[n] for n in graded})


def pytest_selection(args) -> list[str]:
    sel = ["--grade", "-p", "no:cacheprovider", "-p", "no:randomly", "-m", args.markers,
           f"--timeout={args.test_timeout}"]
    if args.tasks:
        sel += ["--grade-tasks", args.tasks]
    return sel


def collect_expected(course: Course, args) -> None:
    """Which graded tests each lesson runs: collected from the course's own tree, so a result
    file that claims other tests, or fewer, is caught (see cross_check)."""
    with tempfile.TemporaryDirectory(prefix="dpt-grade-collect-") as tmp:
        out = Path(tmp) / "collected.json"
        tree = "solutions" if (course.root / "solutions").is_dir() else "exercises"
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "--target", tree,
               "--grade-json", str(out), *pytest_selection(args),
               *course.test_dirs.values()]
        proc = subprocess.run(cmd, cwd=course.root, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(course.root)), timeout=600)
        if not out.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            raise GradeError("collecting the course's tests failed: " + " | ".join(tail))
        tests = json.loads(out.read_text())["tests"]
    for lesson, tdir in course.test_dirs.items():
        course.expected[lesson] = {i: t for i, t in tests.items() if i.startswith(tdir + "/")}


# --- submissions ---------------------------------------------------------------------------

@dataclass
class Submission:
    name: str
    source: Path  # the entry in DIR
    lessons: dict[str, Path] = field(default_factory=dict)  # "01" -> folder
    problem: str = ""  # why it could not be read at all


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "submission"


def _check_size(total: int, what: str) -> None:
    if total > MAX_SUBMISSION_BYTES:
        raise GradeError(f"{what} unpacks to {total / 2**20:.0f} MB, over the "
                         f"{MAX_SUBMISSION_BYTES // 2**20} MB limit")


def unpack(path: Path, dest: Path) -> Path:
    """Extract an archive safely (no absolute paths, no '..', no links, bounded size)."""
    dest.mkdir(parents=True)
    if path.name.endswith(".zip"):
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            _check_size(sum(i.file_size for i in infos), path.name)
            for info in infos:
                target = (dest / info.filename).resolve()
                if not target.is_relative_to(dest.resolve()):
                    raise GradeError(f"{path.name}: member {info.filename!r} leaves the archive")
                is_link = (info.external_attr >> 16) & 0o170000 == 0o120000
                if not is_link:
                    zf.extract(info, dest)
    else:
        with tarfile.open(path) as tf:
            members = tf.getmembers()
            _check_size(sum(m.size for m in members if m.isfile()), path.name)
            tf.extractall(dest, members=[m for m in members if m.isfile() or m.isdir()],
                          filter="data")
    return dest


def find_lessons(root: Path, lesson_names: dict[str, str]) -> dict[str, Path]:
    """The submission's lesson folders: from an exercises/-shaped tree or a course clone.

    Every folder (four levels deep at most) that holds folders named like the course's
    lessons is a candidate; ``exercises/`` wins, then the one with the most lessons.
    """
    wanted = set(lesson_names.values())
    candidates: list[tuple[Path, dict[str, Path]]] = []
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        depth = len(here.relative_to(root).parts)
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")
                       and not (here / d).is_symlink() and depth < 4]
        found = {d[:2]: here / d for d in dirnames if d in wanted}
        if found:
            candidates.append((here, found))
    if not candidates:
        return {}
    candidates.sort(key=lambda c: (c[0].name != "exercises", c[0].name == "solutions",
                                   -len(c[1]), len(c[0].parts)))
    return candidates[0][1]


def discover(folder: Path, staging: Path, course: Course) -> list[Submission]:
    subs: list[Submission] = []
    seen: set[str] = set()
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        name = entry.name
        for ext in (".tar.gz", ".tgz", ".zip", ".tar"):
            if name.endswith(ext):
                name = name[: -len(ext)]
                break
        else:
            if not entry.is_dir():
                continue
        name = _safe_name(name)
        while name in seen:
            name += "_"
        seen.add(name)
        sub = Submission(name, entry)
        try:
            root = entry if entry.is_dir() else unpack(entry, staging / name)
            sub.lessons = find_lessons(root, course.lessons)
            if not sub.lessons:
                sub.problem = "no lesson folder (NN_name/) found in the submission"
        except (GradeError, OSError, zipfile.BadZipFile, tarfile.TarError) as exc:
            sub.problem = f"could not read the submission: {exc}"
        subs.append(sub)
    return subs


def copy_lesson_tree(src: Path, dst: Path, budget: list[int]) -> None:
    """Copy regular files and folders only: no links, no configuration files (BLOCKED_NAMES)."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(src):
        if entry.name in BLOCKED_NAMES or entry.name.endswith((".pyc", ".pth")):
            continue
        if entry.is_symlink():
            continue
        if entry.is_dir():
            copy_lesson_tree(Path(entry.path), dst / entry.name, budget)
        elif entry.is_file():
            budget[0] -= entry.stat().st_size
            if budget[0] < 0:
                raise GradeError(f"the lesson folders hold over "
                                 f"{MAX_SUBMISSION_BYTES // 2**20} MB")
            shutil.copyfile(entry.path, dst / entry.name)


# --- the sandbox -----------------------------------------------------------------------------

@dataclass
class Isolation:
    root: bool
    net: bool
    pidns: bool
    uid: bool
    notes: list[str]
    read_only: list[str] = field(default_factory=list)


def probe_isolation(args) -> Isolation:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "sandbox.py"), "--probe"],
                          capture_output=True, text=True, timeout=60)
    try:
        found = json.loads(proc.stdout)
    except json.JSONDecodeError:
        found = {"root": os.geteuid() == 0, "net": proc.stderr.strip() or "failed",
                 "pidns": "failed", "uid": "failed"}
    net = found["net"] == "ok" and not args.allow_network
    pidns = found["pidns"] == "ok"
    uid = found["root"] and found["uid"] == "ok"
    read_only = protected_paths() if found.get("ro") == "ok" else []
    notes = []
    if args.allow_network:
        notes.append("network: allowed (--allow-network)")
    elif not net:
        notes.append(f"network: NOT isolated (no network namespace here: {found['net']})")
    else:
        notes.append("network: none (own network namespace, loopback only)")
    notes.append("processes: own PID namespace, all killed when a lesson ends" if pidns else
                 f"processes: no PID namespace ({found['pidns']}); a timeout kills the "
                 "process group only, so a process that left it may survive")
    if uid:
        notes.append("user: each job runs as its own unprivileged uid (read-only access to "
                     f"the course); process limit {args.nproc} per job")
    elif found["root"]:
        notes.append(f"user: root, could not switch user ({found['uid']}): RLIMIT_NPROC has "
                     "no effect on root, and the code can write wherever root can")
    else:
        notes.append("user: the grader's own user: the code can write wherever you can, and "
                     "RLIMIT_NPROC counts all your processes (the limit is set above your "
                     "current count)")
    notes.append("files: read-only for the code (own mount namespace): "
                 + ", ".join(read_only) if read_only else
                 f"files: no mount namespace ({found.get('ro')}): the course checkout, venv "
                 "and data are protected only by file permissions")
    notes.append(f"memory: RLIMIT_AS {args.mem_gb:g} GiB per process")
    return Isolation(found["root"], net, pidns, uid, notes, read_only)


def protected_paths() -> list[str]:
    """What the sandboxed code must not change: the course checkout, the Python it runs on,
    the data (and where its links point). Never a folder that holds the temporary copies."""
    paths = {REPO, Path(sys.prefix), Path(sys.base_prefix), (REPO / "data").resolve()}
    data = REPO / "data"
    if data.is_dir():
        paths |= {p.resolve() for p in data.iterdir() if p.is_symlink()}
    tmp = Path(tempfile.gettempdir()).resolve()
    keep = {p.resolve() for p in paths if p.exists()}
    return sorted(str(p) for p in keep if not tmp.is_relative_to(p) and p != Path("/"))


def _user_process_count() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                pass
    return count


@dataclass
class Attempt:
    rc: int | None  # None: killed at the lesson's time limit
    seconds: float
    journal: list[dict]
    result: dict | None
    stderr_tail: str
    hung_after_result: bool = False  # the scores were written, then the process did not end


class Sandbox:
    def __init__(self, course: Course, iso: Isolation, args):
        self.course, self.iso, self.args = course, iso, args
        self.uids: queue.Queue[int | None] = queue.Queue()
        base = UID_BASE + (os.getpid() % 10_000) * 64
        for i in range(args.jobs):
            self.uids.put(base + i if iso.uid else None)

    def _own(self, path: Path, uid: int | None) -> None:
        if uid is None:
            return
        for dirpath, _dirs, filenames in os.walk(path):
            os.chown(dirpath, uid, uid)
            for f in filenames:
                os.chown(os.path.join(dirpath, f), uid, uid, follow_symlinks=False)

    def _copy(self, sub: Submission, lesson: str, uid: int | None) -> tuple[Path, Path, Path]:
        """A fresh temporary copy: the course's tests/, dpt/, pyproject.toml and the
        submission's lesson folders; HOME, TMPDIR, the caches and out/ owned by ``uid``."""
        course = self.course
        if _STOPPING.is_set():
            raise Stopped(_STOP_SIGNAL[0])
        tmp = Path(tempfile.mkdtemp(prefix=f"dpt-grade-{sub.name[:20]}-{lesson}-"))
        try:
            work = tmp / "course"
            work.mkdir()
            for part in ("tests", "dpt"):
                shutil.copytree(course.root / part, work / part, symlinks=False,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            shutil.copyfile(course.root / "pyproject.toml", work / "pyproject.toml")
            target = work / "submission"
            budget = [MAX_SUBMISSION_BYTES]
            for name, folder in sub.lessons.items():
                copy_lesson_tree(folder, target / course_lesson_name(course, name, folder), budget)
            target.mkdir(exist_ok=True)
            # As `make grade` does: the student's earlier answers go into the copies that later
            # lessons carry (a copy the student edited by hand is kept). Text only: nothing of
            # the submission runs here.
            carry_answers.carry_tree(target)
            for d in ("home", "tmp", "out", *CACHE_DIRS.values()):
                (tmp / d).mkdir(parents=True, exist_ok=True)
            # The code may write in its copy of the lessons, HOME, TMPDIR and the work folder,
            # but (as another user) neither change nor remove the course's tests/ and dpt/:
            # the work folder is sticky, like /tmp.
            os.chmod(tmp, 0o755)
            os.chmod(work, 0o1777)
            for d in (target, tmp / "home", tmp / "tmp", tmp / "out"):
                self._own(d, uid)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp, work, target

    def _discard(self, tmp: Path) -> None:
        if self.args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    def _launch(self, cmd: list[str], tmp: Path, work: Path, uid: int | None,
                timeout: float, result_path: Path | None) -> tuple[int | None, float, bool]:
        """Run ``cmd`` in the sandbox: (exit status or None at the limit, seconds, whether the
        scores were written and the process then did not end). Its process group is killed
        when it ends, and by stop_sandboxes() when the grader is stopped."""
        args = self.args
        sandbox = [sys.executable, str(REPO / "tools" / "sandbox.py"),
                   "--mem", str(int(args.mem_gb * 2**30)), "--cwd", str(work)]
        if self.iso.net:
            sandbox += ["--net", "none"]
        if self.iso.pidns:
            sandbox += ["--pidns"]
        for path in self.iso.read_only:
            sandbox += ["--ro", path]
        if uid is not None:
            sandbox += ["--uid", str(uid), "--nproc", str(args.nproc)]
        elif not self.iso.root:
            sandbox += ["--nproc", str(_user_process_count() + args.nproc)]
        env = sandbox_env(tmp, work, self.course.root, self.iso.net)
        if _STOPPING.is_set():
            raise Stopped(_STOP_SIGNAL[0])
        start = time.monotonic()
        with open(tmp / "stderr.txt", "ab") as err:
            proc = subprocess.Popen([*sandbox, "--", *cmd], cwd=work, env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err, start_new_session=True)
        _LIVE[proc.pid] = proc
        hung_after_result = False
        try:
            if _STOPPING.is_set():  # stopped while it started: stop_sandboxes may have missed it
                raise Stopped(_STOP_SIGNAL[0])
            rc = _wait(proc, start + timeout, result_path)
            hung_after_result = rc is None and result_path is not None and result_path.exists()
        finally:
            _kill_group(proc)  # the whole process group; the PID namespace takes the rest
            proc.wait()
            _LIVE.pop(proc.pid, None)
        return rc, time.monotonic() - start, hung_after_result

    def run(self, sub: Submission, lesson: str, deselect: list[str], uid: int | None) -> Attempt:
        """One pytest run of one lesson of one submission, in a fresh temporary copy."""
        args, course = self.args, self.course
        tmp, work, target = self._copy(sub, lesson, uid)
        try:
            result_path, log_path = tmp / "out" / "result.json", tmp / "out" / "journal.jsonl"
            cmd = [sys.executable, "-m", "pytest", course.test_dirs[lesson], "-q",
                   "--target", str(target), "--grade-json", str(result_path),
                   "--grade-log", str(log_path), *pytest_selection(args)]
            for nodeid in deselect:
                cmd += ["--deselect", nodeid]
            rc, seconds, hung_after_result = self._launch(cmd, tmp, work, uid,
                                                          args.lesson_timeout, result_path)
            return Attempt(rc, seconds, _read_journal(log_path), _read_json(result_path),
                           _tail(tmp / "stderr.txt"), hung_after_result)
        finally:
            self._discard(tmp)

    def probe_imports(self, sub: Submission, lesson: str, uid: int | None) -> ImportProbe:
        """Import each module of the lesson once, in the sandbox, each with a short limit: a
        module that loops or ends the process at import costs its lesson seconds, not every
        test's timeout in turn. Returns why the lesson cannot be graded ("" when it can)."""
        folder = course_lesson_name(self.course, lesson, sub.lessons[lesson])
        limit = import_limit(self.args.import_timeout)
        warm = WARM_FACTOR * limit
        tmp, work, target = self._copy(sub, lesson, uid)
        try:
            modules = sorted(p.stem for p in (target / folder).glob("*.py")
                             if p.name not in PROBE_SKIP and p.stem.isidentifier())
            log, hang = tmp / "out" / "probe.jsonl", tmp / "out" / "hang.txt"
            cmd = [sys.executable, "-c", PROBE_CODE, str(target / folder), str(log), str(hang),
                   f"{limit:.0f}", f"{warm:.0f}", *modules]
            rc, seconds, _ = self._launch(cmd, tmp, work, uid,
                                          warm + limit * (len(modules) + 1) + 30, None)
            why = probe_verdict(rc, _read_journal(log), _tail(hang), limit)
            return ImportProbe(why, seconds)
        finally:
            self._discard(tmp)


@dataclass
class ImportProbe:
    problem: str  # "" when every module imported (or the probe could not tell)
    seconds: float


# Imported by the probe: every .py file of the lesson folder but these (a notebook's source).
PROBE_SKIP = {"tutorial.py"}
WARM_FACTOR = 6  # the third-party imports (torch, lightning) get this many module limits
# Run in the sandbox: argv = lesson folder, log, hang file, limit, warm-up limit, modules.
# First the third-party packages the lesson's files name (torch, lightning: slow to import,
# never the student's code), then each module with faulthandler's watchdog, which prints where
# a stuck import is and ends the process at the limit. One JSON line per step, to the log.
PROBE_CODE = r'''
import ast, faulthandler, importlib, json, os, sys, time
folder, log, hang = sys.argv[1:4]
limit, warm = float(sys.argv[4]), float(sys.argv[5])
modules = sys.argv[6:]
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
def say(**kw):
    os.write(fd, (json.dumps(kw) + "\n").encode())
target, lesson = os.path.split(folder)
os.environ["DPT_TARGET"] = target
from dpt.lessons import load  # the one way in: the lesson's folder goes on sys.path, no other
lessons = sorted(os.path.join(target, d) for d in os.listdir(target) if d[:2].isdigit())
own = set()
for d in lessons:
    if os.path.isdir(d):
        own |= {f[:-3] for f in os.listdir(d) if f.endswith(".py")}
third = set()
for m in modules:
    try:
        with open(os.path.join(folder, m + ".py"), "rb") as f:
            tree = ast.parse(f.read())
    except Exception:
        continue
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            third |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            third.add(node.module.split(".")[0])
out = open(hang, "w")
faulthandler.dump_traceback_later(warm, exit=True, file=out)
t0 = time.monotonic()
for name in sorted(third - own - {"antigravity", "this"}):
    try:
        importlib.import_module(name)
    except BaseException:
        pass
faulthandler.cancel_dump_traceback_later()
say(warm=round(time.monotonic() - t0, 2))
for m in modules:
    say(start=m)
    faulthandler.dump_traceback_later(limit, exit=True, file=out)
    t0 = time.monotonic()
    try:
        load(lesson, m, target)
        error = ""
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    faulthandler.cancel_dump_traceback_later()
    say(done=m, seconds=round(time.monotonic() - t0, 2), error=error)
say(end=True)
os._exit(0)
'''


def import_limit(base: float) -> float:
    """The seconds one module's import may take: ``base`` on an idle machine, more when the
    machine is loaded (the load average per core, 8 times at most)."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        load = 1.0
    return base * min(8.0, max(1.0, load))


def probe_verdict(rc: int | None, log: list[dict], hang: str, limit: float) -> str:
    """Why the lesson's modules cannot be imported, from the probe's log; "" when they can or
    when the probe could not tell (the sandbox failed, or the third-party imports were slow):
    then the tests run as usual."""
    if rc == 0 and any(ln.get("end") for ln in log):
        return ""
    done = {ln.get("done") for ln in log}
    stuck = next((ln["start"] for ln in reversed(log) if isinstance(ln.get("start"), str)
                  and ln["start"] not in done), None)
    if stuck is None or rc in (95, 96):
        return ""
    frames = re.findall(r'File "([^"]*/submission/[^"]*)", line (\d+)', hang)
    if hang.strip() or rc is None:
        where = ""
        if frames:
            path, line = frames[0]  # faulthandler lists the innermost frame first
            where = f" (stuck at {Path(path).name} line {line})"
        return (f"importing {stuck}.py did not finish in {limit:.0f} s{where}: a loop at "
                "import time?")
    return (f"importing {stuck}.py ended the process ({_rc_text(rc)}): os._exit or a crash "
            "at import time?")


class Stopped(KeyboardInterrupt):
    """The grader was stopped by a signal; every sandbox it started has been killed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)


_LIVE: dict[int, subprocess.Popen] = {}  # the sandboxes running now, by pid
_STOPPING = threading.Event()
_IN_POOL = threading.Event()  # the main thread is waiting on the pool of graders
_STOP_SIGNAL = [signal.SIGTERM]  # the signal that stopped the grader


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_sandboxes(signum: int | None = None) -> int:
    """Kill every sandbox's process group (their PID namespaces take the rest) and start no
    new one. Safe in a signal handler: no lock is taken."""
    if signum is not None:
        _STOP_SIGNAL[0] = signum
    _STOPPING.set()
    live = list(_LIVE.values())
    for proc in live:
        _kill_group(proc)
    return len(live)


# Where the tools the lessons use keep their caches and settings (all inside the copy): torch's
# compiler looks the user up to name its default cache folder, which fails for a uid without
# a passwd entry, as the grader's uids are.
CACHE_DIRS = {"XDG_CACHE_HOME": "home/.cache", "XDG_CONFIG_HOME": "home/.config",
              "TORCHINDUCTOR_CACHE_DIR": "home/.cache/torchinductor",
              "TRITON_CACHE_DIR": "home/.cache/triton", "MPLCONFIGDIR": "home/.config/matplotlib",
              "TORCH_EXTENSIONS_DIR": "home/.cache/torch_extensions",
              "CUDA_CACHE_PATH": "home/.cache/nv"}
SANDBOX_USER = "student"


def sandbox_env(tmp: Path, work: Path, course_root: Path, net_isolated: bool) -> dict[str, str]:
    """The sandboxed command's whole environment: nothing of the grader's but PATH. It names
    a user (getpass.getuser() reads LOGNAME, USER, LNAME, USERNAME before the passwd file, which
    has no entry for the sandbox's uid) and a writable HOME and caches inside the copy."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp / "home"),
           "TMPDIR": str(tmp / "tmp"), "PYTHONPATH": str(work),
           "DPT_DATA": str(course_root / "data"), "DPT_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
           "MPLBACKEND": "Agg", "LANG": "C.UTF-8", "CUDA_VISIBLE_DEVICES": ""}
    env.update({var: SANDBOX_USER for var in ("LOGNAME", "USER", "LNAME", "USERNAME")})
    env.update({var: str(tmp / sub) for var, sub in CACHE_DIRS.items()})
    if net_isolated:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _wait(proc: subprocess.Popen, deadline: float, result_path: Path | None) -> int | None:
    """The exit status, or None at the deadline, or None once the scores have been written and
    the process has not ended within AFTER_RESULT_GRACE_S (left-over children it waits for)."""
    written_at = None
    while True:
        now = time.monotonic()
        if now >= deadline:
            return None
        try:
            return proc.wait(timeout=min(1.0, deadline - now))
        except subprocess.TimeoutExpired:
            pass
        if written_at is None and result_path is not None and result_path.exists():
            written_at = time.monotonic()
        if written_at is not None and time.monotonic() - written_at > AFTER_RESULT_GRACE_S:
            return None


def course_lesson_name(course: Course, number: str, folder: Path) -> str:
    return course.lessons.get(number, folder.name)


def _read_journal(path: Path) -> list[dict]:
    lines = []
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_LOG_BYTES)
    except OSError:
        return lines
    for raw in data.splitlines():
        try:
            line = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(line, dict):
            lines.append(line)
    return lines


def _read_json(path: Path) -> dict | None:
    try:
        if path.stat().st_size > MAX_LOG_BYTES:
            return None
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _tail(path: Path, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


# --- grading a lesson: reruns after a crash, the cross-check ------------------------------

@dataclass
class LessonResult:
    tasks: dict[str, dict]  # task -> entry (tests.scoring) + "state" + "reason"
    notes: list[str]
    seconds: float
    tampered: bool = False


def _test_name(nodeid: str) -> str:
    return nodeid.split("::", 1)[-1]


def _rc_text(rc: int) -> str:
    if rc > 128:
        try:
            return f"killed by {signal.Signals(rc - 128).name}"
        except ValueError:
            pass
    return f"exit status {rc}"


def grade_lesson(sandbox: Sandbox, sub: Submission, lesson: str) -> LessonResult:
    course = sandbox.course
    if lesson not in sub.lessons:
        folder = course.lessons[lesson]
        tasks = {t: dict(new_entry(), failed=1, total=1) for t in course.tasks(lesson)}
        reasons = {t: f"lesson folder {folder}/ is missing from the submission" for t in tasks}
        return _finish(tasks, reasons, [f"{lesson}: folder {folder}/ missing"], 0.0)
    uid = sandbox.uids.get()
    try:
        probe = sandbox.probe_imports(sub, lesson, uid)
        if probe.problem:  # its tests would each wait out their timeout, or die, in turn
            tasks = {t: dict(new_entry(), failed=1, total=1) for t in course.tasks(lesson)}
            return _finish(tasks, {t: probe.problem for t in tasks},
                           [f"{lesson}: {probe.problem} (its tests were not run)"],
                           probe.seconds)
        result = _grade_selection(sandbox, sub, lesson, uid, None)
        result.seconds += probe.seconds
        if result.tampered:
            return result
        # A second chance for tasks that may have failed from an earlier task's leftovers.
        hit = [t for t, e in result.tasks.items()
               if e["state"] == "fail" and RESOURCE_ERROR.search(e["reason"])]
        victims = {t for t, e in result.tasks.items() if e["state"] == "fail"
                   and RESOURCE_ERROR.search(e["reason"]) and t != min(hit, default=None)}
        if victims:
            again = _grade_selection(sandbox, sub, lesson, uid, victims)
            result.seconds += again.seconds
            if again.tampered:
                return again
            for t in victims:
                if again.tasks[t]["state"] == "pass":
                    result.tasks[t] = again.tasks[t]
                    result.notes.append(f"{lesson}: {t} failed after {min(hit)}'s "
                                        "resource error, passed when run alone")
        return result
    finally:
        sandbox.uids.put(uid)


def _clean(message: str) -> str:
    """A message as the student reads it: paths relative to their submission."""
    return shorten_message(re.sub(r"/\S*?/course/submission/", "", message))


def _grade_selection(sandbox: Sandbox, sub: Submission, lesson: str, uid: int | None,
                     only: set[str] | None) -> LessonResult:
    """Run the lesson's tests (of the tasks in ``only``), rerunning after a test kills the
    process: the test that was running is blamed, the finished ones kept."""
    course, args = sandbox.course, sandbox.args
    expected = {i: t for i, t in course.expected[lesson].items() if only is None or t in only}
    tasks = {t: new_entry() for t in sorted(set(expected.values()), key=task_order)}
    reasons: dict[str, str] = {}
    notes: list[str] = []
    done = [i for i in course.expected[lesson] if i not in expected]  # deselected
    seconds = 0.0
    for _ in range(args.reruns + 1):
        att = sandbox.run(sub, lesson, done, uid)
        seconds += att.seconds
        finished = {ln["nodeid"] for ln in att.journal
                    if ln.get("when") == "teardown" and ln.get("nodeid") in expected}
        for ln in att.journal:
            if ln.get("nodeid") in finished and ln.get("nodeid") not in done:
                record(tasks[expected[ln["nodeid"]]], str(ln.get("when")),
                       str(ln.get("outcome")), _clean(str(ln.get("message", ""))))
        ended = att.rc is not None or att.hung_after_result
        # Scores written but tests unfinished: the session was interrupted (a KeyboardInterrupt,
        # pytest.exit): handled as a crash, the finished tests kept, the rest run again.
        interrupted = ended and att.result is not None and not (
            finished >= set(expected) - set(done))
        if att.result is not None and ended and not interrupted:
            problem = cross_check(att, expected, done, finished)
            if problem:
                notes.append(f"{lesson}: tampered: {problem}")
                return _tampered(tasks, problem, notes, seconds)
            if att.hung_after_result:
                notes.append(f"{lesson}: the test process did not end after its last test "
                             f"(processes left running?): killed after "
                             f"{AFTER_RESULT_GRACE_S} s")
            done += sorted(finished - set(done))
            break
        started = [ln["start"] for ln in att.journal if isinstance(ln.get("start"), str)]
        culprit = next((s for s in reversed(started)
                        if s in expected and s not in finished and s not in done), None)
        if att.rc is None:
            why = f"timed out: the lesson ran past its {args.lesson_timeout:g} s limit"
        elif att.rc in (95, 96):
            why = "the grader could not start the sandbox: " + att.stderr_tail.strip()[-300:]
        elif interrupted:
            why = f"the test session was interrupted ({_rc_text(att.rc or 0)})"
        else:
            why = (f"the test process died ({_rc_text(att.rc)}): os._exit, a crash, "
                   "or the memory or process limit")
        done += sorted(finished - set(done))
        if culprit is None:
            when = "after its last test" if finished else "before any test ran"
            notes.append(f"{lesson}: {why}, {when}")
            break
        task = expected[culprit]
        tasks[task]["failed"] += 1
        tasks[task]["total"] += 1
        reasons.setdefault(task, f"{why}, in {_test_name(culprit)}")
        notes.append(f"{lesson}: {why}, in {_test_name(culprit)}")
        done.append(culprit)
        if not set(expected) - set(done):
            break
    # Tests that never ran (the process kept dying, or died before any test): failed.
    for nodeid in set(expected) - set(done):
        t = expected[nodeid]
        tasks[t]["failed"] += 1
        tasks[t]["total"] += 1
        reasons.setdefault(t, "not run: " + (notes[-1].split(": ", 1)[-1] if notes
                                             else "the test process ended early"))
    return _finish(tasks, reasons, notes, seconds)


def cross_check(att: Attempt, expected: dict[str, str], deselected: list[str],
                finished: set[str]) -> str:
    """The result file against what the grader expected and what the journal showed."""
    should_run = set(expected) - set(deselected)
    claimed = att.result.get("tests")
    if not isinstance(claimed, dict) or set(claimed) != should_run:
        return "the result file lists other tests than the course's"
    if finished != should_run:
        return (f"{len(should_run)} tests expected, {len(finished & should_run)} seen "
                "finishing")
    replay: dict[str, dict] = {}
    for ln in att.journal:
        node = ln.get("nodeid")
        if node in should_run:
            record(replay.setdefault(expected[node], new_entry()), str(ln.get("when")),
                   str(ln.get("outcome")), "")
    tasks = att.result.get("tasks")
    if not isinstance(tasks, dict):
        return "the result file has no task scores"
    for task, entry in replay.items():
        got = tasks.get(task)
        if not isinstance(got, dict) or any(got.get(k) != entry[k]
                                            for k in ("passed", "failed", "skipped", "total")):
            return f"task {task}: the result file's counts differ from the test reports"
    if set(tasks) - set(replay):
        return "the result file claims tasks no test reported"
    return ""


def _tampered(tasks, problem, notes, seconds) -> LessonResult:
    for entry in tasks.values():
        entry.update(new_entry(), failed=1, total=1, state="fail",
                     reason=f"tampered with the grading: {problem}")
    return LessonResult(tasks, notes, seconds, tampered=True)


def _finish(tasks, reasons, notes, seconds) -> LessonResult:
    for t, entry in tasks.items():
        entry["state"] = task_state(entry)
        if entry["state"] == "fail":
            entry["reason"] = reasons.get(t) or entry["first_error"] or "failed"
        elif entry["state"] == "skipped":
            entry["reason"] = entry["skip_reason"] or "no test ran"
        else:
            entry["reason"] = ""
    return LessonResult(tasks, notes, seconds)


# --- reports ---------------------------------------------------------------------------------

@dataclass
class SubmissionResult:
    sub: Submission
    lessons: dict[str, LessonResult]

    def earned(self, lesson: str | None = None) -> float:
        return sum(points_for(t) for n, r in self.lessons.items() if lesson in (None, n)
                   for t, e in r.tasks.items() if e["state"] == "pass")

    def possible(self, lesson: str | None = None) -> float:
        return sum(points_for(t) for n, r in self.lessons.items() if lesson in (None, n)
                   for t, e in r.tasks.items() if e["state"] != "skipped")

    def notes(self) -> list[str]:
        out = [self.sub.problem] if self.sub.problem else []
        return out + [n for r in self.lessons.values() for n in r.notes]

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.lessons.values())


def write_gradebook(path: Path, course: Course, results: list[SubmissionResult]) -> None:
    all_tasks = [t for lesson in course.lessons for t in course.tasks(lesson)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["submission", *all_tasks, *[f"lesson {n}" for n in course.lessons],
                    "total", "max", "notes"])
        for r in results:
            cells = []
            for lesson in course.lessons:
                for t in course.tasks(lesson):
                    e = r.lessons[lesson].tasks[t]
                    cells.append("skipped" if e["state"] == "skipped"
                                 else f"{points_for(t) if e['state'] == 'pass' else 0:g}")
            w.writerow([r.sub.name, *cells, *[f"{r.earned(n):g}" for n in course.lessons],
                        f"{r.earned():g}", f"{r.possible():g}", "; ".join(r.notes())])


def feedback_text(course: Course, r: SubmissionResult) -> str:
    lines = [f"Data-Parallel PyTorch: grade for {r.sub.name}", "",
             f"{'lesson':<8}{'task':<8}{'tests':>7}  {'points':>8}  result"]
    failing = []
    for lesson in course.lessons:
        for t in course.tasks(lesson):
            e = r.lessons[lesson].tasks[t]
            ran = e["passed"] + e["failed"]
            p = points_for(t)
            got = p if e["state"] == "pass" else 0
            result = {"pass": "pass", "fail": "FAIL", "skipped": "not graded"}[e["state"]]
            lines.append(f"{lesson:<8}{t:<8}{e['passed']:>3}/{ran:<3}  {got:>3g}/{p:<4g}  "
                         f"{result}")
            if e["state"] != "pass":
                failing.append((t, e["reason"]))
        lines.append(f"{lesson:<8}{'score':<8}{'':>7}  {r.earned(lesson):>3g}/"
                     f"{r.possible(lesson):<4g}")
    lines.append(f"{'total':<8}{'':<8}{'':>7}  {r.earned():>3g}/{r.possible():<4g}")
    if failing:
        lines += ["", "What to look at, task by task (the first message of its first failing "
                  "test):"]
        lines += [line for t, why in failing for line in wrap_line(f"  {t}: ", why, 100)]
    if r.notes():
        lines += ["", "Notes from the grader:"] + [f"  {n}" for n in r.notes()]
    lines += ["", "Run the same tests yourself: make grade LESSON=NN (see the course README)."]
    return "\n".join(lines) + "\n"


def gradescope_results(course: Course, r: SubmissionResult, isolation: Isolation) -> dict:
    tests = []
    for lesson in course.lessons:
        for t in course.tasks(lesson):
            e = r.lessons[lesson].tasks[t]
            p = points_for(t)
            tests.append({
                "name": f"Task {t}", "number": t,
                "score": p if e["state"] == "pass" else 0.0,
                "max_score": p if e["state"] != "skipped" else 0.0,
                "status": "passed" if e["state"] == "pass" else "failed",
                "output": (f"{e['passed']}/{e['passed'] + e['failed']} tests passed"
                           + (f"\n{e['reason']}" if e["reason"] else "")),
                "visibility": "visible"})
    return {"score": r.earned(), "tests": tests, "visibility": "visible",
            "output": "\n".join(r.notes()) if r.notes() else "graded in an isolated copy",
            "execution_time": round(r.seconds, 1)}


# --- the command ---------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m tools.grade_class",
        description="Grade every submission in a folder: a gradebook CSV, feedback files, "
                    "Gradescope results.json files.")
    p.add_argument("submissions", type=Path, help="folder of submissions (folders, .zip, .tar.gz)")
    p.add_argument("--out", type=Path, default=Path("grades"), help="where to write (grades/)")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="lessons graded side by side (default: cores // 2, at least 1)")
    p.add_argument("--lessons", default="", help="only these lessons, e.g. 01,08")
    p.add_argument("--tasks", default="", help="only these tasks, e.g. 08.1,08.2")
    p.add_argument("--markers", default="not slow", help='pytest -m expression ("not slow")')
    p.add_argument("--lesson-timeout", type=float, default=1200,
                   help="wall-clock seconds per lesson run (1200)")
    p.add_argument("--test-timeout", type=float, default=300, help="seconds per test (300)")
    p.add_argument("--import-timeout", type=float, default=30,
                   help="seconds to import one lesson module before any test runs (30; more "
                        "on a loaded machine: times the load average per core, 8 at most)")
    p.add_argument("--mem-gb", type=float, default=8,
                   help="RLIMIT_AS per process in GiB (8; importing torch maps about 3.3)")
    p.add_argument("--nproc", type=int, default=512,
                   help="processes and threads per job (512; RLIMIT_NPROC)")
    p.add_argument("--reruns", type=int, default=2,
                   help="after a test kills its process, rerun the lesson without it (2)")
    p.add_argument("--allow-network", action="store_true", help="do not isolate the network")
    p.add_argument("--keep", action="store_true", help="keep the temporary copies")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if not args.submissions.is_dir():
        p.exit(2, f"error: {args.submissions} is not a folder of submissions\n")
    if args.jobs < 1:
        p.exit(2, "error: --jobs must be at least 1\n")
    if args.import_timeout <= 0:
        p.exit(2, "error: --import-timeout must be more than 0 seconds\n")
    return args


def grade_class(args) -> list[SubmissionResult]:
    lessons = [x.strip().zfill(2) for x in args.lessons.split(",") if x.strip()]
    course = load_course(REPO, lessons)
    if args.tasks:
        keep = {t.strip()[:2] for t in args.tasks.split(",")}
        course.lessons = {n: v for n, v in course.lessons.items() if n in keep}
        course.test_dirs = {n: v for n, v in course.test_dirs.items() if n in keep}
    iso = probe_isolation(args)
    for note in iso.notes:
        print(f"isolation: {note}", file=sys.stderr)
    collect_expected(course, args)
    course.lessons = {n: v for n, v in course.lessons.items() if course.expected.get(n)}
    staging = Path(tempfile.mkdtemp(prefix="dpt-grade-staging-"))
    try:
        subs = discover(args.submissions, staging, course)
        if not subs:
            raise GradeError(f"no submission (folder, .zip, .tar.gz) in {args.submissions}")
        sandbox = Sandbox(course, iso, args)
        units = [(s, n) for s in subs for n in course.lessons]
        by_sub: dict[str, dict[str, LessonResult]] = {s.name: {} for s in subs}
        from tqdm import tqdm
        start = time.monotonic()
        bar = tqdm(total=len(units), unit="lesson", disable=args.no_progress,
                   desc=f"grading {len(subs)} submissions")
        lock = threading.Lock()
        pool = ThreadPoolExecutor(max_workers=args.jobs)
        try:
            futures = {}
            for s, n in units:
                if s.problem:
                    by_sub[s.name][n] = grade_lesson(sandbox, Submission(s.name, s.source), n)
                    by_sub[s.name][n].notes[:] = []
                    bar.update()
                    continue
                futures[pool.submit(grade_lesson, sandbox, s, n)] = (s, n)
            # While the pool runs, a stop signal only kills the sandboxes and sets _STOPPING
            # (_on_stop_signal): this loop notices within half a second and raises. Raised
            # from the handler, it could land inside the futures' own locks and leave a worker
            # unable to report its result, and the shutdown below waiting for it forever.
            _IN_POOL.set()
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for fut in done:
                    s, n = futures[fut]
                    with lock:
                        by_sub[s.name][n] = fut.result()
                        bar.set_postfix_str(f"{s.name} {n}")
                        bar.update()
                if _STOPPING.is_set():
                    raise Stopped(_STOP_SIGNAL[0])
        except BaseException:  # stopped (a signal) or broken: no lesson may run on alone
            stop_sandboxes()
            raise
        finally:
            _IN_POOL.clear()
            pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
        wall = time.monotonic() - start
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    results = [SubmissionResult(s, by_sub[s.name]) for s in subs]
    write_outputs(args.out, course, iso, results, wall, args)
    return results


def write_outputs(out: Path, course: Course, iso: Isolation, results, wall: float, args):
    (out / "feedback").mkdir(parents=True, exist_ok=True)
    write_gradebook(out / "gradebook.csv", course, results)
    for r in results:
        (out / "feedback" / f"{r.sub.name}.txt").write_text(feedback_text(course, r))
        gs = out / "gradescope" / r.sub.name
        gs.mkdir(parents=True, exist_ok=True)
        (gs / "results.json").write_text(
            json.dumps(gradescope_results(course, r, iso), indent=2))
    summary = {
        "isolation": iso.notes, "jobs": args.jobs, "wall_seconds": round(wall, 1),
        "lessons": course.lessons, "markers": args.markers, "tasks_filter": args.tasks,
        "submissions": {r.sub.name: {
            "score": r.earned(), "max": r.possible(), "seconds": round(r.seconds, 1),
            "notes": r.notes(),
            "tasks": {t: {k: e[k] for k in ("state", "passed", "failed", "skipped", "reason")}
                      for lr in r.lessons.values() for t, e in lr.tasks.items()}}
            for r in results}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"graded {len(results)} submissions in {wall:.0f} s with {args.jobs} job(s): "
          f"{out / 'gradebook.csv'}, {out / 'feedback'}/, {out / 'gradescope'}/")
    for r in results:
        print(f"  {r.sub.name:<24} {r.earned():>5g}/{r.possible():<5g} "
              f"{r.seconds:6.0f} s  {'; '.join(r.notes())[:150]}")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _on_stop_signal(signum, _frame):
    """SIGTERM, SIGINT, SIGHUP: kill every sandbox now (each runs in its own session, so
    a signal to the grader's group never reaches them), then unwind and clean up."""
    stop_sandboxes(signum)
    for sig in STOP_SIGNALS:  # a second signal while cleaning up: kill again, do not unwind
        signal.signal(sig, lambda *_: stop_sandboxes())
    if not _IN_POOL.is_set():  # waiting on the pool: its loop raises at a safe point
        raise Stopped(signum)


def main(argv=None) -> int:
    args = parse_args(argv)
    previous = {}
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:  # e.g. SIGHUP under nohup
            previous[sig] = signal.signal(sig, _on_stop_signal)
    try:
        grade_class(args)
    except GradeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Stopped as exc:
        stop_sandboxes()
        print(f"error: stopped by {signal.Signals(exc.signum).name}: every sandbox was "
              "killed, nothing written", file=sys.stderr)
        return 128 + exc.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
