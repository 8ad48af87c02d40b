"""Plant classic student bugs in a copy of ``solutions/`` and check that the suite catches each.

A grading suite is only as good as the bugs it fails on. Each lesson keeps a catalogue of the
mistakes students really make (a sum without the mean, a save without a barrier, clipping
before ``unscale_``...) beside its tests, in ``tests/lNN_name/planted_bugs.py``: a list
``BUGS`` of :class:`tests.planted.Bug`, each an exact edit of one solution file anchored to
the block or definition it breaks (``where="05.3"``, ``where="Trainer.__init__"``), with the
tests that must fail on it and, where the tests word it, the message that proves they failed
*for that reason* and not, say, on a timeout. This tool collects every lesson's catalogue (a
new lesson's file is found by its name, nothing to register).

For each bug it copies ``solutions/`` to a temporary folder, makes the edit there, and runs
the named tests against the copy (``pytest --target COPY``). The verdicts:

- ``caught``: the tests failed, with the expected message when one is given;
- ``SURVIVED``: the tests passed on the broken code: a hole in the suite;
- ``WRONG REASON``: they failed, but on a timeout or without the expected message;
- ``STALE``: the edit no longer applies (the solution changed): update the entry.

Usage (from the repository root; one bug takes 10-60 s, the whole list about 17 min on two
idle cores)::

    .venv/bin/python tools/plant_bugs.py                 # every bug, two at a time
    .venv/bin/python tools/plant_bugs.py --list          # the catalogue
    .venv/bin/python tools/plant_bugs.py --only 05.3-no-mean,03.5-no-barrier -j 1
    .venv/bin/python tools/plant_bugs.py --lesson 05

Exit status 0 when every bug is caught for the right reason. ``make plant-bugs`` runs it.
The fast test ``tests/harness/test_plant_bugs.py`` checks that every edit still applies.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = REPO / "solutions"
if str(REPO) not in sys.path:  # run as a script: tools/ is on the path, the repository not
    sys.path.insert(0, str(REPO))

from tests.planted import Bug, PlantError
from tests.planted import apply as apply_to_text


def catalogues(root: Path = REPO) -> list[Path]:
    """Every lesson's ``tests/lNN_name/planted_bugs.py``, in lesson order."""
    return sorted((root / "tests").glob("l[0-9][0-9]_*/planted_bugs.py"))


def load_bugs(root: Path = REPO) -> list[Bug]:
    """The entries of every lesson's catalogue, lesson by lesson."""
    bugs: list[Bug] = []
    for path in catalogues(root):
        module = importlib.import_module(f"tests.{path.parent.name}.planted_bugs")
        found = getattr(module, "BUGS", None)
        if not isinstance(found, list) or not all(isinstance(b, Bug) for b in found):
            raise TypeError(f"{path.relative_to(root)}: BUGS must be a list of tests.planted.Bug")
        bugs.extend(found)
    return bugs


BUGS: list[Bug] = load_bugs()


def apply(bug: Bug, tree: Path) -> str | None:
    """Make ``bug``'s edit in ``tree`` (a copy of solutions/); an error text if it can't."""
    path = tree / bug.file
    if not path.exists():
        return f"{bug.file} does not exist"
    try:
        path.write_text(apply_to_text(bug, path.read_text()))
    except PlantError as exc:
        return str(exc)
    return None


def _failure_lines(output: str) -> list[str]:
    """The lines that say why a test failed: pytest's ``E ...`` lines and summary lines."""
    return [ln for ln in output.splitlines()
            if ln.startswith("E ") or ln.startswith("FAILED") or ln.startswith("ERROR")]


def verdict(bug: Bug, rc: int, output: str) -> tuple[str, str]:
    """``(verdict, detail)`` for a run of ``bug``'s tests that exited with ``rc``."""
    lines = _failure_lines(output)
    last = output.strip().splitlines()[-1] if output.strip() else ""
    first = next((ln[2:].strip() for ln in lines if ln.startswith("E ")),
                 lines[0] if lines else last)
    if rc == 0:
        return "SURVIVED", "the tests passed on the broken code"
    if rc != 1:
        return "ERROR", f"pytest exited {rc}: {first[:200]}"
    if bug.expect:  # the entry says what the right failure reads like (a hang, for some)
        if re.search(bug.expect, output):
            return "caught", first[:200]
        return "WRONG REASON", f"no /{bug.expect}/ in the failure: {first[:200]}"
    if re.search(r"Timeout|timed out after|hung and was stopped", "\n".join(lines)):
        return "WRONG REASON", f"a timeout, not an assertion: {first[:200]}"
    return "caught", first[:200]


def run_one(bug: Bug, python: str, timeout: int) -> dict:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"dpt-bug-{bug.id}-") as tmp:
        tree = Path(tmp) / "solutions"
        shutil.copytree(SOLUTIONS, tree, ignore=shutil.ignore_patterns("__pycache__"))
        problem = apply(bug, tree)
        if problem:
            return {"id": bug.id, "verdict": "STALE", "detail": problem, "seconds": 0.0}
        cmd = [python, "-m", "pytest", "--target", str(tree), "-q", "-x", "-p", "no:randomly",
               "-p", "no:cacheprovider", "--no-header", *bug.tests]
        if bug.keywords:
            cmd += ["-k", " or ".join(bug.keywords)]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env,
                                  timeout=timeout)
            rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, output = 1, f"E   Timeout: the tests ran past {timeout} s\n{exc.stdout or ''}"
    v, detail = verdict(bug, rc, output)
    return {"id": bug.id, "verdict": v, "detail": detail,
            "seconds": round(time.monotonic() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print the catalogue and exit")
    p.add_argument("--only", default="", help="comma-separated bug ids")
    p.add_argument("--lesson", default="", help="only this lesson's bugs, e.g. 05")
    p.add_argument("-j", "--jobs", type=int, default=2, help="bugs tested at once (default 2)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per bug (default 600)")
    p.add_argument("--python", default=sys.executable, help="the venv's python")
    args = p.parse_args(argv)

    bugs = BUGS
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(wanted) - {b.id for b in BUGS})
        if unknown:
            p.error(f"unknown bug id(s): {', '.join(unknown)} (see --list)")
        bugs = [b for b in BUGS if b.id in wanted]
    if args.lesson:
        bugs = [b for b in bugs if b.lesson == args.lesson.zfill(2)]
        if not bugs:
            p.error(f"no bug in lesson {args.lesson!r} (see --list)")
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    if args.list:
        for b in bugs:
            print(f"{b.id:36s} {b.file}: {b.why}")
        return 0

    print(f"[plant-bugs] {len(bugs)} bug(s), {args.jobs} at a time, tests against a broken "
          f"copy of solutions/", flush=True)
    results = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for n, result in enumerate(pool.map(lambda b: run_one(b, args.python, args.timeout),
                                            bugs), 1):
            results.append(result)
            print(f"[{n}/{len(bugs)}] {result['verdict']:12s} {result['id']} "
                  f"({result['seconds']:.0f} s): {result['detail']}", flush=True)
    bad = [r for r in results if r["verdict"] != "caught"]
    print(f"\n[plant-bugs] {len(results) - len(bad)} of {len(results)} planted bugs caught "
          "for the right reason")
    for r in bad:
        print(f"  {r['verdict']}: {r['id']}: {r['detail']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
