"""Build a demo class for the class grader: honest, broken and hostile submissions.

    python -m tools.class_demo DIR [--course PATH]
    make grade-class SUBMISSIONS=DIR GRADE_ARGS="--lessons 01,08"

Full-course submissions (every lesson folder): ``solutions`` (a whole clone, as a .tar.gz),
``untouched`` (the exercises as handed out, an exercises/-shaped folder), ``half_done`` (a
clone as a .zip: lessons 01 and 08 solved, the rest untouched). The hostile and broken ones
hold lesson 08 only, the solutions with one file changed (tasks 08.1 and 08.2; each hostile
change sits in 08.1's file, so 08.2 shows what an unaffected task still earns):

==================  =================================================================
import_loop         zero_accounting.py loops forever at import
os_exit             measure_bytes calls os._exit(3)
fork_bomb           measure_bytes forks up to 200 sleeping children (bounded on purpose)
memory_hog          measure_bytes maps 12 GiB in one piece (lazily: never touched)
deadlock            measure_bytes starts 2 gloo ranks; rank 0 all-reduces, rank 1 never does
escape              measure_bytes deletes the grader's tests/ and dpt/, writes a file in the
                    course checkout and its own copy's tests/, then answers correctly
syntax_error        zero_accounting.py does not parse
missing_lesson      no 08_sharding/ folder (lesson 01's exercises only)
tamper              the 08.1 stubs, plus an import that patches the course's conftest so
                    every failure is counted as a pass
==================  =================================================================

Every hostile action is bounded by itself too (sleeps, a fixed number of forks, memory
reserved but not touched), so a grader without a sandbox cannot harm the machine either:
``escape`` aims at the course checkout named by ``--course``; point it at a throwaway copy.
"""

from __future__ import annotations

import argparse
import shutil
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LESSON = "08_sharding"

_WRAP = '''

# --- a hostile change (tools/class_demo.py) ----------------------------------------------
_real_measure_bytes = measure_bytes


def measure_bytes(model, optimizer):
{body}
    return _real_measure_bytes(model, optimizer)
'''

HOSTILE_BODIES = {
    "os_exit": "    import os\n    os._exit(3)",
    "fork_bomb": (
        "    import os\n    import time\n"
        "    for _ in range(200):  # at most 200, each sleeps: bounded even without limits\n"
        "        if os.fork() == 0:\n            time.sleep(120)\n            os._exit(0)"),
    "memory_hog": ("    import mmap\n"
                   "    hog = mmap.mmap(-1, 12 << 30)  # 12 GiB of address space, never touched\n"
                   "    hog.close()"),
    "deadlock": (
        "    import multiprocessing as mp\n    import socket\n"
        "    with socket.socket() as s:\n        s.bind(('127.0.0.1', 0))\n"
        "        port = s.getsockname()[1]\n"
        "    ctx = mp.get_context('fork')\n"
        "    ranks = [ctx.Process(target=_stuck_rank, args=(r, port)) for r in (0, 1)]\n"
        "    for p in ranks:\n        p.start()\n"
        "    for p in ranks:\n        p.join()"),
}

DEADLOCK_RANK = '''

def _stuck_rank(rank, port):
    import datetime
    import time

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(hours=1))
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: waits
    time.sleep(600)
'''

ESCAPE_BODY = '''    import os
    import pathlib
    import shutil
    course = pathlib.Path({course!r})
    own = pathlib.Path(__file__).resolve().parent.parent.parent  # this copy's course root
    for victim in (course / "tests", course / "dpt", own / "tests", own / "dpt"):
        shutil.rmtree(victim, ignore_errors=True)
    for spot in (course / "ESCAPED.txt", own / "tests" / "ESCAPED.txt",
                 pathlib.Path.home() / "ESCAPED.txt"):
        try:
            spot.write_text("written by a submission")
        except OSError:
            pass
    os.environ["DPT_ESCAPED"] = "1"'''

TAMPER = '''

# --- a hostile change (tools/class_demo.py): count every failure as a pass ----------------
import sys as _sys  # noqa: E402

_conftest = _sys.modules.get("tests.conftest")
if _conftest is not None:
    _record = _conftest.record
    _conftest.record = lambda entry, when, outcome, message="": _record(
        entry, when, "passed" if outcome == "failed" else outcome, "")
'''


def _copy_lessons(tree: Path, dest: Path, only: list[str] | None = None) -> None:
    for lesson in sorted(tree.iterdir()):
        if lesson.is_dir() and lesson.name[:2].isdigit() and (only is None
                                                              or lesson.name in only):
            shutil.copytree(lesson, dest / lesson.name,
                            ignore=shutil.ignore_patterns("__pycache__"))


def _pack(folder: Path, archive: Path) -> None:
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive, "w") as zf:
            for f in sorted(folder.rglob("*")):
                zf.write(f, f.relative_to(folder.parent))
    else:
        with tarfile.open(archive, "w:gz") as tf:
            tf.add(folder, arcname=folder.name)
    shutil.rmtree(folder)


def build_full(dest: Path, course: Path = REPO) -> list[str]:
    """The three full-course submissions."""
    sol, ex = course / "solutions", course / "exercises"
    clone = dest / "solutions"
    _copy_lessons(sol, clone / "exercises")  # a clone whose exercises/ are all done
    (clone / "README.md").write_text("my copy of the course\n")
    _pack(clone, dest / "solutions.tar.gz")
    _copy_lessons(ex, dest / "untouched")
    half = dest / "half_done"
    _copy_lessons(ex, half / "exercises")
    for name in ("01_single_device", LESSON):
        shutil.rmtree(half / "exercises" / name)
        shutil.copytree(sol / name, half / "exercises" / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    _pack(half, dest / "half_done.zip")
    return ["solutions", "untouched", "half_done"]


def build_hostile(dest: Path, course: Path = REPO) -> list[str]:
    """The broken and hostile submissions (lesson 08 only)."""
    sol, ex = course / "solutions", course / "exercises"
    names = []

    def lesson08(name: str, tree: Path = sol) -> Path:
        names.append(name)
        _copy_lessons(tree, dest / name, [LESSON])
        return dest / name / LESSON / "zero_accounting.py"

    f = lesson08("import_loop")
    f.write_text(f.read_text() + "\nimport time as _t\n\nwhile True:  # never returns\n"
                                 "    _t.sleep(0.05)\n")
    for name, body in HOSTILE_BODIES.items():
        f = lesson08(name)
        extra = DEADLOCK_RANK if name == "deadlock" else ""
        f.write_text(f.read_text() + extra + _WRAP.format(body=body))
    f = lesson08("escape")
    f.write_text(f.read_text() + _WRAP.format(body=ESCAPE_BODY.format(course=str(course))))
    f = lesson08("syntax_error")
    f.write_text(f.read_text().replace("def measure_bytes(", "def measure_bytes(:", 1))
    names.append("missing_lesson")
    _copy_lessons(ex, dest / "missing_lesson", ["01_single_device"])
    f = lesson08("tamper", ex)
    f.write_text(f.read_text() + TAMPER)
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dest", type=Path, help="folder to create")
    p.add_argument("--course", type=Path, default=REPO,
                   help="the course checkout the grader uses (escape's target)")
    p.add_argument("--hostile-only", action="store_true")
    args = p.parse_args(argv)
    if args.dest.exists() and any(args.dest.iterdir()):
        p.exit(2, f"error: {args.dest} is not empty\n")
    args.dest.mkdir(parents=True, exist_ok=True)
    names = [] if args.hostile_only else build_full(args.dest, args.course.resolve())
    names += build_hostile(args.dest, args.course.resolve())
    print(f"{len(names)} submissions in {args.dest}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
