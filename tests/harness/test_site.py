"""The course website (``make site``): it builds, gives away no solution, reads offline, and
every page opens in a real browser without a console error, a broken link or a broken image.

The test builds the site into its own temporary folder with the notebooks' outputs taken from
``make site``'s cache where it has them (``--execute cached``); a notebook the cache lacks is
shown unexecuted, so the test never spends minutes running kernels. ``DPT_SITE_EXECUTE=cache``
makes it execute them too.
"""

from __future__ import annotations

import fcntl
import functools
import html
import http.server
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests.lessons import REPO

sys.path.insert(0, str(REPO / "tools"))
from make_exercises import BEGIN, END  # noqa: E402 (the generator's own markers)

SITE_TOOLS = ("sphinx", "myst_nb", "furo", "jupyter_cache")
SCREENSHOTS = REPO / "site" / "_build" / "screenshots"
LESSON_SHOT = "02_data_parallel"  # a lesson page with a diagram and plots


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    missing = [m for m in SITE_TOOLS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"site tools not installed ({', '.join(missing)}): `make site-setup`")
    # One build per test run: pytest-xdist's workers share the parent of their temp folders,
    # and the first to take the lock builds while the other waits for it.
    base = tmp_path_factory.getbasetemp()
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "course-site"
    out.mkdir(exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "built").exists():
            mode = os.environ.get("DPT_SITE_EXECUTE") or "cached"
            proc = subprocess.run([sys.executable, str(REPO / "site" / "build.py"), "--out",
                                   str(out), "--execute", mode, "--quiet"],
                                  capture_output=True, text=True, timeout=1700, cwd=REPO)
            print(proc.stdout[-2000:], proc.stderr[-4000:])
            assert proc.returncode == 0, (f"the site did not build (exit {proc.returncode}):\n"
                                          f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
            (out / "built").write_text(mode)
    return out / "html"


def given_to_students() -> set[str]:
    """What a student's tree already shows: the lines of the code in exercises/, and the
    one-line inline code spans (`...`) of the prose of its READMEs and notebooks, where a
    lesson names an API call on purpose (`scaler.scale(loss).backward()`). Fenced code blocks
    of READMEs are not in it: a solution line there is a leak."""
    given = set()
    for f in (REPO / "exercises").rglob("*"):
        if f.is_file() and f.suffix in {".py", ".diff", ".sbatch"}:
            given.update(line.strip() for line in f.read_text().splitlines())
    prose = [f.read_text() for f in (REPO / "exercises").rglob("*.md")]
    for nb in (REPO / "notebooks").glob("*.ipynb"):
        prose += ["".join(c["source"]) for c in json.loads(nb.read_text())["cells"]
                  if c["cell_type"] == "markdown"]
    for text in prose:
        text = re.sub(r"(?ms)^\s*```.*?^\s*```", "", text)  # fenced blocks do not count
        given.update(span.strip() for span in re.findall(r"`([^`\n]+)`", text))
    return given


def solution_lines() -> dict[str, str]:
    """Each line inside a solution block (longer than 25 characters, not given to students
    already), mapped to the file it comes from."""
    given = given_to_students()
    found = {}
    for f in sorted((REPO / "solutions").rglob("*.py")):
        inside = False
        for line in f.read_text().splitlines():
            if BEGIN.match(line):
                inside = True
            elif END.match(line):
                inside = False
            elif inside and len(line.strip()) > 25 and line.strip() not in given:
                found.setdefault(line.strip(), str(f.relative_to(REPO)))
    return found


def page_text(path: Path) -> str:
    """A built file's text as a reader sees it: tags removed, entities decoded (highlighted
    code is split into many tags)."""
    text = path.read_text(errors="replace")
    if path.suffix == ".html":
        text = re.sub(r"<[^>]+>", "", text)
    return html.unescape(text)


def test_lines_are_collected_from_every_solution_file():
    lines = solution_lines()
    files = {f for f in lines.values()}
    with_blocks = {str(f.relative_to(REPO)) for f in (REPO / "solutions").rglob("*.py")
                   if "# BEGIN SOLUTION" in f.read_text()}
    assert len(files) >= len(with_blocks) // 2, (
        f"only {len(files)} of {len(with_blocks)} solution files gave lines to look for")


@pytest.mark.tools  # builds the whole site (make site): make check-tools
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_no_solution_source_on_the_site(site):
    lines = solution_lines()
    assert lines, "no solution lines found to look for: are the BEGIN/END SOLUTION markers gone?"
    leaks = []
    for path in sorted(site.rglob("*")):
        if path.is_file() and path.suffix in {".html", ".js", ".txt", ".json", ".ipynb", ".md"}:
            text = page_text(path)
            leaks += [f"{path.relative_to(site)}: {line!r} (from {src})"
                      for line, src in lines.items() if line in text]
    assert not leaks, ("the site shows solution code (a README code block, or a notebook "
                       "cell that prints or loads a solution file?):\n" + "\n".join(leaks[:20]))


class _Refs(HTMLParser):
    """Every URL a page loads by itself: scripts, stylesheets, fonts, icons, images, frames."""

    def __init__(self):
        super().__init__()
        self.loads: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in {"script", "img", "iframe", "source", "audio", "video", "embed"} and a.get("src"):
            self.loads.append(a["src"])
        if tag == "link" and a.get("href") and a.get("rel") not in {"canonical", "alternate"}:
            self.loads.append(a["href"])
        if tag == "object" and a.get("data"):
            self.loads.append(a["data"])


EXTERNAL = re.compile(r"^(https?:)?//", re.I)


@pytest.mark.tools  # builds the whole site (make site): make check-tools
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_site_loads_nothing_from_the_network(site):
    found = []
    for path in sorted(site.rglob("*.html")):
        refs = _Refs()
        refs.feed(path.read_text())
        found += [f"{path.relative_to(site)}: {u}" for u in refs.loads if EXTERNAL.match(u)]
    for path in sorted(site.rglob("*.css")):
        for url in re.findall(r"""(?:@import\s+|url\()\s*['"]?([^'")\s]+)""", path.read_text()):
            if EXTERNAL.match(url):
                found.append(f"{path.relative_to(site)}: {url}")
    assert not found, "the site needs the network to display (bundle these):\n" + "\n".join(found)


def _browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or (
        "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
    if not (chromium and driver):
        pytest.skip("no chromium/chromedriver: `apt-get install chromium chromium-driver`")
    if importlib.util.find_spec("selenium") is None:
        pytest.skip("selenium is not installed: `make site-setup`")
    return chromium, driver


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def served(site):
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def browser(tmp_path):
    chromium, chromedriver = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-dev-shm-usage", "--window-size=1280,1400",
                f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=opts)
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()


LOADED = """
const done = arguments[arguments.length - 1];
const ready = () => document.readyState === 'complete' &&
  [...document.images].every(i => i.complete);
const t0 = Date.now();
(function wait() { if (ready() || Date.now() - t0 > 20000) done(true); else setTimeout(wait, 50); })();
"""
LINKS = "return [...document.querySelectorAll('a[href]')].map(a => a.href)"
IMAGES = ("return [...document.images].map(i => [i.currentSrc || i.src, i.complete, "
          "i.naturalWidth])")


@pytest.mark.tools  # the whole site in a browser: make check-tools
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_page_opens_in_a_browser_without_errors(site, served, browser):
    browser.set_script_timeout(60)
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    assert "index.html" in pages and any(p.startswith("lessons/") for p in pages)
    problems, links = [], {}
    start = time.monotonic()
    for page in pages:
        browser.get(served + page)
        browser.execute_async_script(LOADED)
        for entry in browser.get_log("browser"):
            if entry.get("level") == "SEVERE":
                problems.append(f"{page}: console error: {entry.get('message')}")
        for src, complete, width in browser.execute_script(IMAGES):
            if not (complete and width > 0):
                problems.append(f"{page}: image does not display: {src}")
        for href in browser.execute_script(LINKS):
            if href.startswith(served):
                links.setdefault(href, page)
        if page == "index.html" or page == f"lessons/{LESSON_SHOT}.html":
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            shot = SCREENSHOTS / f"{Path(page).stem}.png"
            browser.save_screenshot(str(shot))
            print(f"screenshot: {shot}")
    bodies = {}
    for href, page in sorted(links.items()):
        url, _, frag = href.partition("#")
        if url not in bodies:
            try:
                with urllib.request.urlopen(url, timeout=30) as resp:
                    bodies[url] = resp.read().decode(errors="replace")
            except urllib.error.URLError as exc:
                bodies[url] = None
                problems.append(f"{page}: broken link {href} ({exc})")
        frag = urllib.parse.unquote(frag)
        body = bodies[url]
        if body is not None and frag and url.endswith((".html", "/")) and not re.search(
                rf"""\bid=["']{re.escape(frag)}["']""", body):
            problems.append(f"{page}: link to a missing anchor: {href}")
    print(f"{len(pages)} pages, {len(links)} internal links, {time.monotonic() - start:.0f} s")
    assert not problems, "\n".join(problems)


# ------------------------------------------- the lesson table and pages follow the folders


def _build_module():
    spec = importlib.util.spec_from_file_location("site_build", REPO / "site" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readmes_lesson_table_is_the_one_derived_from_the_lesson_folders():
    build = _build_module()
    readme = (REPO / "README.md").read_text()
    assert readme == build.with_lesson_table(readme, build.lesson_table()), (
        "README.md's lesson table is stale: run `.venv/bin/python site/build.py "
        "--write-lesson-table`")
    for folder in sorted((REPO / "solutions").glob("[0-9][0-9]_*")):
        info = build.lesson_info(folder)
        assert f"](exercises/{folder.name}/)" in readme, f"{folder.name} is not in the table"
        code = "".join(p.read_text() for p in folder.rglob("*.py"))
        own = set(re.findall(rf"# BEGIN SOLUTION ({folder.name[:2]}\.\d+)\b", code))
        assert set(info["tasks"]) == own, (
            f"{folder.name}/README.md's '## Tasks' table lists {sorted(info['tasks'])}, its "
            f"solution blocks are {sorted(own)} (one row '| NN.K | ...' per task)")


def test_the_readme_stays_a_front_door_whose_links_resolve():
    build = _build_module()
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, "README.md is the front door: keep it to 150 lines"
    assert "make test" in readme and "make benchmark" in readme and "## Start here" in readme
    asm = build.Assembler(Path("/nonexistent"))
    for path in [REPO / "README.md", REPO / "benchmarks" / "README.md",
                 *sorted((REPO / "docs").glob("*.md"))]:
        asm.links(path.read_text(), path.parent, "index.md")
    assert not asm.problems, "\n".join(asm.problems)


def _fake_course(root: Path) -> None:
    """A copy of the course's pages with lesson 01 and a new lesson 10, nothing else."""
    shutil.copy(REPO / "README.md", root / "README.md")
    shutil.copytree(REPO / "docs", root / "docs", ignore=shutil.ignore_patterns("gpu-check"))
    (root / "benchmarks").mkdir()
    shutil.copy(REPO / "benchmarks" / "README.md", root / "benchmarks" / "README.md")
    (root / "dpt").mkdir()
    (root / "notebooks").mkdir()
    for tree in ("solutions", "exercises"):
        shutil.copytree(REPO / tree / "01_single_device", root / tree / "01_single_device",
                        ignore=shutil.ignore_patterns("__pycache__"))
        new = root / tree / "10_pipelines"
        new.mkdir()
        (new / "README.md").write_text(
            "# Lesson 10: pipeline parallelism\n\nStages on devices.\n\n## Goal\n\n- a pipe\n\n"
            "## Tasks\n\n| task | where | what you write |\n|---|---|---|\n"
            "| 10.2 | `schedule` | the 1F1B order |\n| 10.1 | `split` | the stages |\n")
    shutil.copy(REPO / "notebooks" / "01_single_device.ipynb", root / "notebooks")
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": "## Pipelines"}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (root / "notebooks" / "10_pipelines.ipynb").write_text(json.dumps(nb))


def test_a_new_lesson_folder_reaches_the_table_the_site_and_the_scores(tmp_path, monkeypatch):
    pytest.importorskip("nbformat")
    build = _build_module()
    root = tmp_path / "course"
    root.mkdir()
    _fake_course(root)
    monkeypatch.setattr(build, "REPO", root)
    table = build.lesson_table()
    assert "| 10 | [pipeline parallelism](exercises/10_pipelines/) | 10.1-10.2 |" in table, table
    assert build.main(["--write-lesson-table"]) == 0
    assert "exercises/10_pipelines/" in (root / "README.md").read_text()
    asm = build.assemble(tmp_path / "src")
    index = (tmp_path / "src" / "index.md").read_text()
    assert "lessons/10_pipelines" in index and "pipeline parallelism" in index
    assert (tmp_path / "src" / "lessons" / "10_pipelines.ipynb").is_file()
    assert all((tmp_path / "src" / "docs" / p.name).is_file() for p in (root / "docs").glob("*.md"))
    assert "docs/maintainers" in index
    from tests.scoring import points_for

    assert points_for("10.1") == points_for("10.2") > 0  # a new task scores without an entry
    assert not [p for p in asm.problems if "10_pipelines" in p], asm.problems


def test_a_lesson_readme_without_its_title_line_is_refused_in_one_line(tmp_path):
    build = _build_module()
    folder = tmp_path / "10_pipelines"
    folder.mkdir()
    (folder / "README.md").write_text("# Pipelines\n\n## Tasks\n")
    with pytest.raises(SystemExit) as err:
        build.lesson_info(folder)
    assert str(err.value).startswith("error: 10_pipelines/README.md must start with '# Lesson 10:")
