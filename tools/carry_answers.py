"""Bring your answers from earlier lessons into the lessons that carry them (`make carry`).

Lessons 03, 04 and 06 grow their parent lesson's training script (03 from 01, 04 and 06 from
03), and keep some of its functions unchanged: each such copy stands under a line ::

    # from lesson 01_single_device, unchanged: `make carry` updates it [carry 1a2b3c4d]

This command copies YOUR current definition of that function from the parent lesson's file
into every copy, lesson by lesson (01 into 03, then 03 into 04 and 06), so an answer is
written once, where its task is. A task you have not done yet in the parent is carried as
its stub. Run it again whenever you change an earlier answer; a second run changes nothing.

A copy you edited by hand (it no longer matches what was last carried there, the
``[carry ...]`` fingerprint) is kept and named, unless ``--force``: then it is overwritten and
the file as it was is kept next to it as ``<file>.bak``. Exit status: 0 when every copy is up
to date, 1 when a copy was kept or a file does not parse, 2 on bad input.

Usage: ``python tools/carry_answers.py`` (the tree ``exercises/``), ``--tree DIR`` (any folder
of lesson folders, e.g. a submission), ``--lesson 03`` (only the copies in lesson 03),
``--force``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_exercises as gen  # noqa: E402  (GROWTH, markers, definitions: stdlib only)

REPO = gen.REPO


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    updated: int = 0
    current: int = 0
    kept: int = 0
    errors: int = 0


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _reindent(block: list[str], old: str, new: str) -> list[str]:
    return [new + line[len(old):] if line.startswith(old) and line.strip() else line
            for line in block]


def _as_carried(block: list[str]) -> list[str]:
    """A parent's definition as its copy reads: a stub names the lesson its task is from."""
    out = []
    for line in block:
        m = gen.STUB.match(line.rstrip("\n"))
        out.append(f'{m["indent"]}raise NotImplementedError("{gen.carried_stub(m["task"])}")\n'
                   if m else line)
    if out and not out[-1].endswith("\n"):
        out[-1] += "\n"
    return out


def _parse_error(path: Path, tree: Path, exc: SyntaxError) -> str:
    return (f"error: {path.relative_to(tree)} does not parse (line {exc.lineno}: {exc.msg}): "
            "fix it, then run `make carry` again; the lessons it feeds were not carried")


def carry_pair(tree: Path, parent: str, child: str, force: bool, report: Report) -> None:
    """Carry ``tree/parent``'s definitions into the copies in ``tree/child``."""
    p, c = tree / parent, tree / child
    lesson = Path(parent).parts[0]
    parent_text, child_text = p.read_text(), c.read_text()
    try:
        theirs = gen._definitions(parent_text)
    except SyntaxError as exc:
        report.lines.append(_parse_error(p, tree, exc))
        report.errors += 1
        return
    try:
        copies = gen.carried_copies(child_text, str(c.relative_to(tree)))
    except SyntaxError as exc:
        report.lines.append(_parse_error(c, tree, exc))
        report.errors += 1
        return
    parent_lines = parent_text.splitlines(keepends=True)
    lines = child_text.splitlines(keepends=True)
    where = c.relative_to(tree)
    edits = []  # (marker line, start, end, new block)
    overwritten = []
    for i, marked, name, start, end in copies:
        if marked != lesson:
            report.lines.append(f"error: {where}:{i + 1}: {name} says it is from lesson {marked}, "
                                f"but this lesson grows {lesson}: left as it is")
            report.errors += 1
            continue
        if name not in theirs:
            report.lines.append(f"error: {where}: {name} is carried from {parent}, which has no "
                                f"{name} (renamed or deleted there?): left as it is")
            report.errors += 1
            continue
        a, b = gen._span(parent_lines, theirs[name])
        source = parent_lines[a:b]
        want = _as_carried(_reindent(source, _indent(source[0]), _indent(lines[start])))
        have = lines[start:end]
        marker = gen.FROM.match(lines[i])
        recorded = gen.FINGERPRINT.search(marker["rest"])
        if have == want:
            report.current += 1
            if recorded is None or recorded["fp"] != gen.fingerprint(want):
                edits.append((i, start, end, want))
            continue
        untouched = (gen.fingerprint(have) == recorded["fp"] if recorded
                     else any(gen.STUB.match(line.rstrip("\n")) for line in have))  # no stamp yet
        if not untouched and not force:
            report.lines.append(
                f"kept: {where}: {name} was edited here by hand and differs from lesson "
                f"{lesson}'s; edit it in {parent} instead, or overwrite it with "
                "`make carry FORCE=1` (--force; the old file is kept as .bak)")
            report.kept += 1
            continue
        if not untouched:
            overwritten.append(name)
        edits.append((i, start, end, want))
        stubs = sorted({m["task"] for m in map(gen.STUB.match, (s.rstrip("\n") for s in want))
                        if m})
        todo = f" (Task {', '.join(stubs)} not done there yet: carried as a stub)" if stubs else ""
        report.lines.append(f"carried: {where}: {name} from {parent}{todo}")
        report.updated += 1
    if not edits:
        return
    for i, start, end, block in sorted(edits, reverse=True):
        lines[start:end] = block
        lines[i] = gen.from_marker(gen.FROM.match(lines[i])["indent"], lesson, block)
    if overwritten:
        backup = c.with_name(c.name + ".bak")
        shutil.copyfile(c, backup)
        report.lines.append(f"overwrote your edits: {where}: {', '.join(overwritten)} (the file "
                            f"as it was is {backup.relative_to(tree)})")
    c.write_text("".join(lines))


def carry_tree(tree: Path, lessons: set[str] | None = None, force: bool = False) -> Report:
    """Carry every parent's definitions into its children's copies, parents first."""
    report = Report()
    for parent, child in gen.GROWTH:
        if lessons and Path(child).parts[0][:2] not in lessons:
            continue
        if (tree / parent).is_file() and (tree / child).is_file():
            carry_pair(tree, parent, child, force, report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=REPO / "exercises",
                    help="the folder of your lesson folders (default: exercises/)")
    ap.add_argument("--lesson", action="append", default=[],
                    help="only the copies in this lesson (NN; repeat or comma-separate)")
    ap.add_argument("--force", action="store_true",
                    help="overwrite copies edited by hand (each file is kept as .bak first)")
    args = ap.parse_args(argv)
    tree = args.tree
    if not tree.is_dir():
        print(f"error: no folder {tree}: name your lesson tree with --tree (make carry "
              "TARGET=DIR)", file=sys.stderr)
        return 2
    lessons = {x.strip() for arg in args.lesson for x in arg.split(",") if x.strip()}
    bad = sorted(x for x in lessons if not (len(x) == 2 and x.isdigit()))
    children = {Path(child).parts[0][:2] for _, child in gen.GROWTH}
    if bad or (lessons and not lessons & children):
        print(f"error: --lesson {','.join(sorted(lessons))}: the lessons that carry code are "
              f"{', '.join(sorted(children))} (two digits)", file=sys.stderr)
        return 2
    if not any((tree / child).is_file() for _, child in gen.GROWTH):
        print(f"error: {tree} holds none of the lessons that carry code "
              f"({', '.join(sorted(children))}): is it your exercises/ folder?", file=sys.stderr)
        return 2
    report = carry_tree(tree, lessons or None, args.force)
    for line in report.lines:
        print(line, file=sys.stderr if line.startswith("error:") else sys.stdout)
    total = report.updated + report.current + report.kept
    print(f"make carry: {total} carried copies: {report.updated} updated, {report.current} "
          f"already up to date, {report.kept} kept (edited by hand)")
    return 1 if report.kept or report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
