"""Build the course website: assemble its pages from the repository, then run Sphinx + myst-nb.

Nothing here copies lesson text into git: every build reads the READMEs, the notebooks and the
benchmark reference as they are now and writes the pages under ``--out`` (git-ignored):

- ``src/``: the assembled sources (Markdown pages, one notebook per lesson, images);
- ``html/``: the site; open ``html/index.html`` or ``make site-serve``.

Each lesson page is one notebook: the lesson's README (from ``exercises/``, whose commands run
the student's code), then ``notebooks/NN_*.ipynb`` (student-facing code cells, which call the
lesson's functions) executed with ``DPT_TARGET=solutions``, so its outputs and plots are the
reference answers' while no solution source is shown.

Execution (``--execute`` or ``DPT_SITE_EXECUTE``): ``cache`` (the default) runs each notebook
that jupyter-cache has not seen in this form and stores its outputs; ``cached`` uses stored
outputs and shows the other notebooks unexecuted (fast, never runs a kernel); ``off`` shows
every notebook unexecuted.

The README's lesson table is derived from the lesson folders (``lesson_table``):
``--write-lesson-table`` rewrites it in README.md.

Usage: ``python site/build.py [--out DIR] [--execute cache|cached|off] [--cache DIR]``
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SITE = REPO / "site"
BUILD = SITE / "_build"
MODES = ("cache", "cached", "off")
IMAGES = {".png", ".svg", ".jpg", ".jpeg", ".gif"}
# Files a page may offer for download: data and logs, never code.
DOWNLOADS = {".json", ".csv", ".log", ".txt"}
LINK = re.compile(r"(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LESSON_DIR = re.compile(r"^(solutions|exercises)/(\d\d_\w+)(/README\.md)?/?$")
# The sources a lesson notebook's outputs depend on: when one changes, the notebook runs again.
SHARED_SOURCES = ("dpt", "benchmarks")


def lessons() -> list[str]:
    return sorted(p.stem for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


# The README's lesson table is derived from the lesson folders: each README's title line
# (``# Lesson NN: title``) and the task ids of its ``## Tasks`` table. ``--write-lesson-table``
# rewrites it between these markers; a test fails when the README's copy is stale.
TABLE_START, TABLE_END = "<!-- lesson-table -->", "<!-- /lesson-table -->"
TITLE = re.compile(r"^#\s+Lesson\s+(\d\d):\s*(.+?)\s*$")
TASK_ROW = re.compile(r"^\|\s*`?(\d\d\.\d+)`?\s*\|")


def lesson_info(folder: Path) -> dict:
    """A lesson folder's number, title and task ids, read from its README."""
    readme = folder / "README.md"
    if not readme.is_file():
        raise SystemExit(f"error: {folder.name}/ has no README.md (every lesson needs one)")
    text = readme.read_text()
    first = text.lstrip().splitlines()[0] if text.strip() else ""
    m = TITLE.match(first)
    if not m or m[1] != folder.name[:2]:
        raise SystemExit(f"error: {folder.name}/README.md must start with "
                         f"'# Lesson {folder.name[:2]}: <title>' (it starts with {first!r})")
    try:
        body = section(text, "Tasks")
    except SystemExit:
        body = ""
    tasks = []
    for line in body.splitlines():
        row = TASK_ROW.match(line)
        if row and row[1] not in tasks:
            tasks.append(row[1])
    tasks.sort(key=lambda t: int(t.split(".")[1]))
    return {"number": m[1], "folder": folder.name, "title": m[2], "tasks": tasks}


def _task_span(tasks: list[str]) -> str:
    if not tasks:
        return "none"
    nums = [int(t.split(".")[1]) for t in tasks]
    if nums == list(range(nums[0], nums[0] + len(nums))) and len(nums) > 1:
        return f"{tasks[0]}-{tasks[-1]}"
    return ", ".join(tasks)


def lesson_table(solutions: Path | None = None) -> str:
    """The Markdown lesson table, one row per ``NN_name`` folder of ``solutions``."""
    solutions = solutions or REPO / "solutions"
    rows = ["| # | lesson | tasks |", "|---|---|---|"]
    for folder in sorted(p for p in solutions.glob("[0-9][0-9]_*") if p.is_dir()):
        info = lesson_info(folder)
        rows.append(f"| {info['number']} | [{info['title']}](exercises/{info['folder']}/) "
                    f"| {_task_span(info['tasks'])} |")
    return "\n".join(rows) + "\n"


def with_lesson_table(text: str, table: str) -> str:
    """``text`` (the README) with the block between the lesson-table markers set to ``table``."""
    if TABLE_START not in text or TABLE_END not in text:
        raise SystemExit(f"error: README.md lacks the markers {TABLE_START} and {TABLE_END}")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_START}\n{table}{TABLE_END}{tail}"


def readme_text() -> str:
    """The README as the site shows it: with the lesson table derived from the folders now."""
    return with_lesson_table((REPO / "README.md").read_text(), lesson_table())


# Pages besides the lessons: every ``docs/*.md`` (these first, in this order, then any other
# by name) and the benchmark page, which opens with ``benchmarks/README.md``.
DOCS_ORDER = ("instructors", "grading", "machines", "troubleshooting", "maintainers")


def doc_pages() -> list[str]:
    names = [p.stem for p in (REPO / "docs").glob("*.md")]
    return sorted(names, key=lambda n: (DOCS_ORDER.index(n) if n in DOCS_ORDER
                                        else len(DOCS_ORDER), n))


def split_fences(text: str):
    """Yield (is_code, chunk) for the text outside and inside fenced code blocks."""
    chunk, code, fence = [], False, None
    for line in text.splitlines(keepends=True):
        m = FENCE.match(line)
        if m and (fence is None or m.group(1) == fence):
            if not code:
                if chunk:
                    yield False, "".join(chunk)
                chunk, code, fence = [line], True, m.group(1)
            else:
                chunk.append(line)
                yield True, "".join(chunk)
                chunk, code, fence = [], False, None
            continue
        chunk.append(line)
    if chunk:
        yield code, "".join(chunk)


def section(text: str, title: str | None) -> str:
    """The body of the Markdown section headed ``title`` (without its heading line), up to
    the next heading of the same or a higher level; ``None``: the text before the first
    ``##`` heading, without the ``#`` title."""
    lines = text.splitlines()
    out, level, code = [], None, False
    for line in lines:
        if FENCE.match(line):
            code = not code
        m = None if code else HEADING.match(line)
        if title is None:
            if m and len(m.group(1)) >= 2:
                break
            if not (m and len(m.group(1)) == 1):
                out.append(line)
            continue
        if level is None:
            if m and m.group(2).strip() == title:
                level = len(m.group(1))
            continue
        if m and len(m.group(1)) <= level:
            break
        out.append(line)
    if title is not None and level is None:
        raise SystemExit(f"error: README.md has no section '{title}' (renamed? update site/)")
    return "\n".join(out).strip() + "\n"


def shift_headings(text: str, by: int) -> str:
    parts = []
    for code, chunk in split_fences(text):
        if not code:
            chunk = re.sub(r"(?m)^(#{1,6})(?=\s)", lambda m: "#" * min(6, len(m.group(1)) + by),
                           chunk)
        parts.append(chunk)
    return "".join(parts)


class Assembler:
    """Writes the page sources under ``src``, rewriting relative links as it goes."""

    def __init__(self, src: Path, cache_only: Path | None = None):
        self.src = src
        self.cache_only = cache_only  # show only cached outputs, from this jupyter-cache
        self.unexecuted: list[str] = []
        self.problems: list[str] = []
        self.written: set[Path] = set()

    def write(self, rel: str, content: str | bytes) -> Path:
        """Write a source file only when its content changed, so that Sphinx, which compares
        times, rebuilds only the pages whose sources did."""
        path = self.src / rel
        data = content.encode() if isinstance(content, str) else content
        if not (path.is_file() and path.read_bytes() == data):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        self.written.add(path)
        return path

    def asset(self, repo_file: Path) -> str:
        """Copy a repository file into the sources (as ``_repo/<path>``); its source path."""
        rel = "_repo/" + repo_file.relative_to(REPO).as_posix()
        self.write(rel, repo_file.read_bytes())
        return rel

    def links(self, text: str, origin: Path, page: str) -> str:
        """Rewrite the relative links of Markdown written in folder ``origin`` for the page at
        ``page`` (a path under ``src``): a lesson's README or folder becomes its page, an image
        or a data file is copied beside the pages, code becomes its path in plain text."""
        page_dir = (self.src / page).parent

        def rewrite(m: re.Match) -> str:
            target = m["target"]
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                return m.group(0)
            path, _, frag = target.partition("#")
            file = (origin / path).resolve()
            try:
                rel = file.relative_to(REPO).as_posix()
            except ValueError:
                rel = None
            lesson = LESSON_DIR.match(rel or "")
            if lesson and lesson.group(2) in lessons():
                name = lesson.group(2)
                new = os.path.relpath(self.src / "lessons" / f"{name}.ipynb", page_dir)
                return f"[{m['text']}]({new}{'#' + frag if frag else ''})"
            pages = {"README.md": "index.md", "benchmarks/README.md": "benchmarks.md",
                     **{f"docs/{n}.md": f"docs/{n}.md" for n in doc_pages()}}
            if rel in pages:
                new = os.path.relpath(self.src / pages[rel], page_dir)
                return f"[{m['text']}]({new}{'#' + frag if frag else ''})"
            if rel and file.is_file() and file.suffix.lower() in IMAGES | DOWNLOADS:
                new = os.path.relpath(self.src / self.asset(file), page_dir)
                return f"{m['bang']}[{m['text']}]({new}{m['title'] or ''})"
            if not (rel and file.exists()):
                self.problems.append(f"{origin.relative_to(REPO)}: link to {target} does not "
                                     "resolve in the repository; shown as text")
            shown = m["text"] or target
            return f"{shown} (`{rel or target}`)" if shown != target else f"`{target}`"

        parts = []
        for code, chunk in split_fences(text):
            parts.append(chunk if code else LINK.sub(rewrite, chunk))
        return "".join(parts)


def lesson_notebook(asm: Assembler, name: str) -> str:
    """The lesson page: its README, then its notebook with every heading one level down."""
    import nbformat

    readme = REPO / "exercises" / name / "README.md"
    if not readme.is_file():
        readme = REPO / "solutions" / name / "README.md"
    page = f"lessons/{name}.ipynb"
    nb = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
    cells = [nbformat.v4.new_markdown_cell(asm.links(readme.read_text(), readme.parent, page))]
    intro = (f"The notebook `notebooks/{name}.ipynb`, shown here run against `solutions/`: the "
             "outputs and plots are the reference answers'. In your copy it runs your code in "
             f"`exercises/{name}/`.")
    titled = False
    for i, cell in enumerate(nb.cells):
        cell = nbformat.from_dict(dict(cell))
        cell.pop("id", None)
        if cell.cell_type == "markdown":
            text = shift_headings(asm.links(cell.source, REPO / "notebooks", page), 1)
            if i == 0 and text.lstrip().startswith("## "):  # the notebook's title
                head, _, rest = text.lstrip().partition("\n")
                text = f"{head.replace('## ', '## Notebook: ', 1)}\n\n{intro}\n{rest}"
                titled = True
            cell.source = text
        cells.append(cell)
    if not titled:
        cells.insert(1, nbformat.v4.new_markdown_cell(f"## Notebook\n\n{intro}"))
    # The cache keys a notebook by its code: a hidden cell holding a digest of the lesson's
    # sources makes a change to solutions/ (or dpt/, benchmarks/) run the notebook again.
    stamp = nbformat.v4.new_code_cell(f"# sources digest (site build): {sources_digest(name)}",
                                      metadata={"tags": ["remove-cell"]})
    cells.insert(1, stamp)
    out = nbformat.v4.new_notebook(cells=cells, metadata=nb.metadata)
    for i, cell in enumerate(out.cells):
        cell["id"] = f"c{i:03d}"
    if asm.cache_only is not None and not in_cache(asm.cache_only, out):
        out.metadata["mystnb"] = {"execution_mode": "off"}  # myst-nb's per-notebook setting
        asm.unexecuted.append(name)
    nbformat.validate(out)
    asm.write(page, nbformat.writes(out))
    return page


def in_cache(cache: Path, nb) -> bool:
    """Whether jupyter-cache holds the outputs of this notebook's code (as myst-nb asks it)."""
    from jupyter_cache import get_cache

    if not cache.is_dir():
        return False
    try:
        get_cache(cache).match_cache_notebook(nb)
    except KeyError:
        return False
    return True


def sources_digest(name: str) -> str:
    h = hashlib.sha256()
    roots = [REPO / "solutions" / name, *(REPO / d for d in SHARED_SOURCES)]
    for root in roots:
        for f in sorted(root.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix in {".py", ".json", ".csv"}:
                h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def fill(asm: Assembler, template: Path, page: str) -> None:
    """A page from ``site/<template>``: each line ``<!-- README: Title -->`` becomes that
    section of the README (``intro``: the text before the first section)."""
    readme = readme_text()
    out = []
    for line in template.read_text().splitlines():
        m = re.fullmatch(r"\s*<!-- README: (.+?) -->\s*", line)
        if m:
            title = None if m[1] == "intro" else m[1]
            out.append(asm.links(section(readme, title), REPO, page))
        else:
            out.append(line)
    asm.write(page, "\n".join(out) + "\n")


def dashboard(asm: Assembler) -> None:
    ref = REPO / "benchmarks" / "reference"
    page = "benchmarks.md"
    text = [(SITE / "benchmarks.md").read_text().rstrip(), ""]
    method = REPO / "benchmarks" / "README.md"
    if method.is_file():
        body = method.read_text().split("\n", 1)[1]  # without its title
        text += [asm.links(body, method.parent, page).strip(), ""]
    summary = ref / "summary.md"
    if summary.is_file():
        text += ["## Summary table", "", shift_headings(summary.read_text(), 2), ""]
    pngs = sorted(ref.glob("*.png"))
    if pngs:
        text += ["## Plots", ""]
        for png in pngs:
            text += [f"### {png.stem.replace('_', ' ')}", "",
                     f"![{png.stem}]({asm.asset(png)})", ""]
    files = [f for f in sorted(ref.rglob("*")) if f.is_file() and f.suffix in DOWNLOADS]
    if files:
        text += ["## The files", ""]
        text += [f"- [`{f.relative_to(ref).as_posix()}`]({asm.asset(f)})" for f in files]
    asm.write(page, "\n".join(text) + "\n")


def assemble(src: Path, cache_only: Path | None = None) -> Assembler:
    asm = Assembler(src, cache_only)
    names = lessons()
    for name in names:
        lesson_notebook(asm, name)
    for name in doc_pages():
        doc = REPO / "docs" / f"{name}.md"
        asm.write(f"docs/{name}.md", asm.links(doc.read_text(), doc.parent, f"docs/{name}.md"))
    fill(asm, SITE / "index.md", "index.md")
    index = (src / "index.md").read_text()
    index = index.replace("<!-- LESSONS -->", "\n".join(f"lessons/{n}" for n in names))
    index = index.replace("<!-- DOCS -->", "\n".join(f"docs/{n}" for n in doc_pages()))
    asm.write("index.md", index)
    dashboard(asm)
    for stale in [p for p in src.rglob("*") if p.is_file() and p not in asm.written]:
        stale.unlink()  # a page or image whose source is gone
    return asm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=BUILD)
    ap.add_argument("--cache", type=Path, default=BUILD / ".jupyter_cache",
                    help="jupyter-cache folder (executed notebooks)")
    ap.add_argument("--execute", choices=MODES,
                    default=os.environ.get("DPT_SITE_EXECUTE") or "cache")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--write-lesson-table", action="store_true",
                    help="rewrite README.md's lesson table from the lesson folders, then stop")
    args = ap.parse_args(argv)
    if args.write_lesson_table:
        readme = REPO / "README.md"
        text = readme_text()
        if text != readme.read_text():
            readme.write_text(text)
            print("site: README.md's lesson table rewritten from solutions/")
        return 0
    start = time.monotonic()
    src, html = args.out / "src", args.out / "html"
    asm = assemble(src, args.cache if args.execute == "cached" else None)
    for problem in asm.problems:
        print(f"site: {problem}", file=sys.stderr)
    if asm.unexecuted:
        print(f"site: not in the notebook cache, shown unexecuted: {', '.join(asm.unexecuted)} "
              "(`make site` executes them)")
    mode = {"cache": "cache", "cached": "cache", "off": "off"}[args.execute]
    env = dict(os.environ, DPT_SITE_NB_MODE=mode, DPT_SITE_CACHE=str(args.cache.resolve()),
               DPT_TARGET=str(REPO / "solutions"), TQDM_DISABLE="1",
               DPT_BENCH_SHOW="reference", PYTHONPATH=str(REPO))
    env.pop("MPLBACKEND", None)  # the kernel draws inline
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-c", str(SITE), str(src), str(html),
           "-d", str(args.out / "doctrees"), "-j", "1"] + (["-q"] if args.quiet else [])
    proc = subprocess.run(cmd, env=env, cwd=REPO)
    if proc.returncode != 0:
        print(f"error: sphinx-build failed (exit {proc.returncode}); see above", file=sys.stderr)
        return proc.returncode
    print(f"site: {html / 'index.html'} ({time.monotonic() - start:.0f} s, "
          f"notebooks: {args.execute})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
