"""`make gpu-check` (tools/gpu_check.py): what can be checked without a GPU.

The plan for pretend machines of 1, 2, 4 and 8 GPUs (which items, at which N, side by side or
alone, within the overall cap), the cap stopping a slow item with its whole process tree,
the checklist, and the Makefile running on a Python that already has torch. Nothing here
runs a real item.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.lessons import REPO

sys.path.insert(0, str(REPO / "tools"))
import gpu_check  # noqa: E402

MACHINES = [(1, 16), (2, 16), (4, 32), (8, 64)]  # (GPUs, cores)
CORES = (sorted(os.sched_getaffinity(0)) * 2)[:2] if hasattr(os, "sched_getaffinity") else [0, 1]
MULTI_RANK = ("l03-ddp-spawn-resume", "l04-torchrun-restart", "l04-torchrun", "l05-ring",
              "l06-ddp-amp", "l08-fsdp2")


def by_name(todo):
    return {it.name: it for it in todo}


def flag_value(argv, flag):
    words = " ".join(argv).split()
    return words[words.index(flag) + 1]


@pytest.mark.timeout(120)
def test_without_a_gpu_it_says_so_in_one_line_and_exits_3():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run `make gpu-check` itself")
    proc = subprocess.run([sys.executable, "tools/gpu_check.py"], capture_output=True,
                          text=True, timeout=100, cwd=REPO)
    assert proc.returncode == 3
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0], proc.stderr


@pytest.mark.parametrize("n_gpus,cores", MACHINES)
def test_every_item_names_files_that_exist(n_gpus, cores, tmp_path):
    todo = gpu_check.items(n_gpus, cores, tmp_path)
    assert len({it.name for it in todo}) == len(todo), "two items share a name"
    assert not list(tmp_path.iterdir()), "items() must not write anything"
    for item in todo:
        if item.skip:
            continue
        words = " ".join(item.argv).replace("&&", " ").split()
        for word in words:
            word, _, test = word.partition("::")  # a pytest node id: file::function
            if word.startswith(("solutions/", "tests/")) and word.endswith(".py"):
                assert (REPO / word).is_file(), f"{item.name}: {word} does not exist"
                if test:
                    assert f"def {test}(" in (REPO / word).read_text(), f"{item.name}: {test}?"
            if word in ("tests", "tests/gpu"):
                assert (REPO / word).is_dir(), f"{item.name}: {word} does not exist"
        for i, word in enumerate(words[:-1]):
            if word == "-m" and words[i + 1].startswith(("benchmarks.", "tests.")):
                path = REPO / (words[i + 1].replace(".", "/") + ".py")
                assert path.is_file(), f"{item.name}: module {words[i + 1]} does not exist"


@pytest.mark.parametrize("n_gpus,cores", MACHINES)
def test_the_plan_covers_every_path_at_the_right_n(n_gpus, cores, tmp_path):
    todo = by_name(gpu_check.items(n_gpus, cores, tmp_path))
    shared = n_gpus == 1
    want_ns = [2, 4] if shared else sorted({2, n_gpus})
    tag = "-shared" if shared else ""
    for base in MULTI_RANK:
        for n in want_ns:
            item = todo[f"{base}-n{n}{tag}"]
            assert str(n) in " ".join(item.argv), f"{item.name} does not start {n} ranks"
            assert item.cpus == n
            assert (item.env.get("DPT_SHARE_GPU") == "1") == shared, item.name
        planned = {f"{base}-n{n}{tag}" for n in want_ns}
        if shared and base != "l05-ring":  # and one rank on NCCL, as on any GPU machine
            one = todo[f"{base}-n1"]
            assert one.gpu == "light" and "DPT_SHARE_GPU" not in one.env
            planned.add(one.name)
        extra = [name for name in todo if name.startswith(base + "-n") and name not in planned]
        assert not extra, f"{base} runs at an N not planned: {extra}"
    for strategy in ("ddp", "ddp_spawn", "fsdp"):
        if shared:  # Lightning starts NCCL itself: one rank on the one GPU, the rest skipped
            assert not todo[f"l07-{strategy}-n1"].skip
            for n in want_ns:
                reason = todo[f"l07-{strategy}-n{n}-shared"].skip
                assert reason and "NCCL" in reason and len(reason.splitlines()) == 1
        else:
            for n in want_ns:
                item = todo[f"l07-{strategy}-n{n}"]
                assert flag_value(item.argv, "--devices") == str(n) and not item.skip
    bench = todo["benchmark-quick"]
    assert bench.gpu == "exclusive" and "--quick" in bench.argv
    if shared:
        assert flag_value(bench.argv, "--nprocs").split(",") == ["1", "2", "4"]
        assert bench.bench_ns == (2, 4) and bench.env["DPT_SHARE_GPU"] == "1"
    else:  # QUICK's own N on GPUs: 1 and every GPU, planned to stay under 5 minutes
        assert "--nprocs" not in bench.argv and bench.bench_ns == (n_gpus,)
    notebooks = todo["notebooks" + tag]
    assert notebooks.env["DPT_TEST_BACKEND"] == "auto"
    assert (notebooks.env.get("DPT_SHARE_GPU") == "1") == shared
    assert gpu_check.NOTEBOOKS in notebooks.argv
    assert gpu_check.NOTEBOOKS.startswith("tests/harness/test_notebooks.py::")
    suite = todo["suite"]
    assert "tests" in suite.argv and "-k" not in suite.argv, "the whole suite, not a part"
    assert suite.argv[suite.argv.index("--deselect") + 1] == gpu_check.NOTEBOOKS
    assert "DPT_TEST_BACKEND" not in suite.env and "DPT_SHARE_GPU" not in suite.env
    workers = int(suite.xdist[suite.xdist.index("-n") + 1])
    assert 1 < workers and suite.cpus <= cores
    for name in ("l01-cuda-resume", "l02-dataparallel", "l06-fp16-inf", "l07-16-mixed"):
        assert name in todo and not todo[name].skip
    # The hand-written DataParallel over every GPU, checked by the line that names it (on one
    # GPU the timing study would time CPU replicas: skipped, saying why).
    by_hand = todo["l02-dp-by-hand"]
    if n_gpus >= 2:
        assert not by_hand.skip and flag_value(by_hand.argv, "--devices") == str(n_gpus)
        assert by_hand.expect == (rf"DP by hand, {n_gpus} GPUs",)
    else:
        assert by_hand.skip and "2 GPUs" in by_hand.skip
    if not shared:
        assert not any("DPT_SHARE_GPU" in it.env for it in todo.values())
        for base in MULTI_RANK:  # NCCL over every GPU: those get the GPUs to themselves
            assert todo[f"{base}-n{n_gpus}"].gpu == "exclusive"
            if n_gpus > 2:
                assert todo[f"{base}-n2"].gpu == "shared"


@pytest.mark.parametrize("n_gpus,cores", MACHINES)
def test_the_plan_fits_the_cap_and_runs_items_side_by_side(n_gpus, cores, tmp_path):
    todo = gpu_check.items(n_gpus, cores, tmp_path)
    schedule = gpu_check.plan(todo, cores)
    assert {it.name for it, _, _ in schedule} == {it.name for it in todo if not it.skip}
    cap = gpu_check.overall_cap(n_gpus)
    assert gpu_check.planned_seconds(todo, cores) <= cap
    for it in todo:
        assert it.estimate <= it.timeout <= cap, it.name
    serial = sum(it.estimate for it in todo if not it.skip)
    # Items that take every GPU run one after another; everything else should overlap them.
    exclusive = sum(it.estimate for it in todo if not it.skip and it.gpu == "exclusive")
    assert gpu_check.planned_seconds(todo, cores) <= max(serial / 2, exclusive), \
        "hardly anything overlaps"
    suite = next(s for s in schedule if s[0].name == "suite")
    assert suite[1] == 0
    for when in sorted({start for _, start, _ in schedule}):
        now = [it for it, start, end in schedule if start <= when < end]
        assert sum(it.cpus for it in now) <= cores, f"at {when} s: more cores than the machine"
        exclusive = [it.name for it in now if it.gpu == "exclusive"]
        beside = [it.name for it in now if it.gpu in ("exclusive", "shared")]
        assert not exclusive or beside == exclusive[:1], f"at {when} s: {beside}"
    beside_suite = [it.name for it, start, _ in schedule
                    if it.gpu != "light" and start < suite[2]]
    assert beside_suite, "no GPU item runs while the suite does"


def test_the_cap_grows_with_the_gpus():
    caps = [gpu_check.overall_cap(n) for n in range(1, 9)]
    assert caps[0] == 10 * 60 and caps[-1] == 20 * 60
    assert caps == sorted(caps)


def test_a_colab_sized_machine_is_told_the_plan_outlasts_the_cap(tmp_path):
    todo = gpu_check.items(1, 2, tmp_path)  # one GPU, two cores
    assert gpu_check.planned_seconds(todo, 2) > gpu_check.overall_cap(1)
    assert gpu_check.to_start(todo, [], 2), "something must start on two cores"


def _fake(name, code, **kw):
    return gpu_check.Item(name, f"fake {name}", [sys.executable, "-c", code], **kw)


def _state(pid: int) -> str | None:
    """The process's state letter; None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
@pytest.mark.timeout(90)
def test_the_cap_stops_a_slow_item_and_its_whole_process_tree(tmp_path):
    pidfile = tmp_path / "pids"
    slow = _fake("slow", f"""
import os, subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
child = subprocess.Popen(sleep)
loner = subprocess.Popen(sleep, start_new_session=True)  # as a Jupyter kernel does
open({str(pidfile)!r}, "w").write(f"{{os.getpid()}} {{child.pid}} {{loner.pid}}")
time.sleep(600)
""", gpu="exclusive", estimate=1, timeout=600)
    waiting = _fake("waiting", "print('never')", gpu="exclusive", estimate=1)
    quick = _fake("quick", "print('all good')", gpu="light", expect=("all good",))
    wrong = _fake("wrong", "print('something else')", gpu="light", expect=("all good",))
    lines: list[str] = []
    cap = 8.0
    start = time.monotonic()
    results = gpu_check.run_all([slow, waiting, quick, wrong], CORES, cap, tmp_path,
                                tmp_path / "logs", say=lines.append, poll=0.05)
    took = time.monotonic() - start
    status = {r["name"]: (r["status"], r.get("reason", "")) for r in results}
    assert status["slow"] == ("fail", "stopped at the overall cap"), status
    assert status["waiting"] == ("fail", "not started before the overall cap"), status
    assert status["quick"] == ("pass", ""), status
    assert status["wrong"][0] == "fail" and "all good" in status["wrong"][1], status
    assert cap <= took < cap + 30, f"took {took:.0f} s for a {cap:.0f} s cap"
    assert pidfile.is_file(), "the slow item did not start its processes before the cap"
    pids = [int(p) for p in pidfile.read_text().split()]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_state(p) not in (None, "Z") for p in pids):
        time.sleep(0.1)
    alive = {p: _state(p) for p in pids if _state(p) not in (None, "Z")}
    for p in alive:  # do not leave them behind, then fail
        os.kill(p, 9)
    assert not alive, f"still running after the cap: {alive} (item, child, own session)"
    assert any(re.search(r"start +slow", ln) for ln in lines), lines
    assert any(re.search(r"fail +slow .*overall cap", ln) for ln in lines), lines
    assert any(re.search(r"pass +quick", ln) for ln in lines), lines


@pytest.mark.timeout(60)
def test_an_item_past_its_own_timeout_is_stopped(tmp_path):
    hang = _fake("hang", "import time; time.sleep(600)", gpu="light", timeout=1)
    results = gpu_check.run_all([hang], CORES[:1], 30, tmp_path, tmp_path / "logs",
                                say=lambda line: None, poll=0.05)
    assert results[0]["status"] == "fail"
    assert results[0]["reason"] == "timed out after 1 s"
    assert results[0]["seconds"] < 20


def test_an_item_needing_a_missing_module_is_skipped_with_the_reason(tmp_path):
    item = _fake("needy", "print(1)", needs=("no_such_module_here",))
    planned = _fake("planned", "print(1)", skip="needs 2 GPUs")
    results = gpu_check.run_all([item, planned], CORES[:1], 30, tmp_path, tmp_path / "logs",
                                say=lambda line: None, poll=0.05)
    assert [r["status"] for r in results] == ["skipped", "skipped"]
    assert "no_such_module_here" in results[0]["reason"]
    assert results[1]["reason"] == "needs 2 GPUs"


def test_a_required_item_that_cannot_run_fails_saying_how_to_get_what_it_lacks(tmp_path):
    """A missing tool must not turn the suite into a "skipped" line of a green checklist."""
    suite = _fake("suite", "print(1)", needs=("pytest", "no_such_module_here"), required=True)
    nb = _fake("notebooks", "print(1)", needs=("xdist",), required=True)
    results = gpu_check.run_all([suite, nb], CORES[:1], 30, tmp_path, tmp_path / "logs",
                                say=lambda line: None, poll=0.05)
    status = {r["name"]: r for r in results}
    assert status["suite"]["status"] == "fail" and "exit" not in status["suite"]
    reason = status["suite"]["reason"]
    assert len(reason.splitlines()) == 1
    assert "no_such_module_here" in reason and "pytest," not in reason, reason
    assert "pip install" in reason and "tools/offline_bundle.sh --install" in reason, reason
    assert status["notebooks"]["status"] == "pass" and status["notebooks"]["exit"] == 0
    assert "1 failed" in gpu_check.summary(results)


@pytest.mark.parametrize("n_gpus,cores", MACHINES)
def test_the_suite_and_the_notebooks_are_required_with_the_tools_they_run_on(n_gpus, cores,
                                                                           tmp_path):
    todo = gpu_check.items(n_gpus, cores, tmp_path)
    required = {it.name for it in todo if it.required}
    assert required == {"suite", "notebooks" + ("-shared" if n_gpus == 1 else "")}
    for it in todo:
        if it.required:
            assert not it.skip
            assert {"pytest", "pytest_timeout", "xdist", "nbclient", "nbformat", "ipykernel",
                    "jupytext"} <= set(it.needs), it.name
            assert it.xdist, f"{it.name}: the suite on one worker outlasts the cap"


def _third_party_imports() -> dict[str, str]:
    """Every module the course imports at top level that is neither the standard library nor
    one of its own files, with a file that imports it."""
    import ast

    files = [p for p in REPO.rglob("*.py") if ".venv" not in p.parts]
    own = {p.stem for p in files} | {part for p in files for part in p.relative_to(REPO).parts}
    found: dict[str, str] = {}
    for folder in ("dpt", "solutions", "tests", "benchmarks", "tools"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in own:
                        found.setdefault(top, str(path.relative_to(REPO)))
    return found


# Imported behind a check that skips or falls back without them: the site's browser test, the
# optional apex comparison of lesson 06, lesson 13's torchft job (Linux x86_64 wheels only).
OPTIONAL_IMPORTS = {"selenium", "apex", "torchft"}


def test_the_required_items_need_every_module_the_course_imports():
    found = _third_party_imports()
    assert "matplotlib" in found and "nbclient" in found, "the scan finds nothing"
    lacking = {m: f for m, f in found.items()
               if m not in gpu_check.COURSE_NEEDS and m != "torch" and m not in OPTIONAL_IMPORTS}
    assert not lacking, (f"imported but not in tools/gpu_check.py's COURSE_NEEDS: {lacking}; "
                         "add it there (and to tools/offline_bundle.sh's PACKAGES)")


def _bash_array(text: str, name: str) -> list[str]:
    match = re.search(rf"^{name}=\(([^)]*)\)", text, re.M)
    assert match, f"tools/offline_bundle.sh has no {name}=(...)"
    return match.group(1).split()


def test_the_offline_bundle_packs_what_the_required_items_need():
    script = (REPO / "tools" / "offline_bundle.sh").read_text()
    packages = _bash_array(script, "PACKAGES")
    with_torch = _bash_array(script, "WITH_TORCH")
    assert tuple(with_torch) == gpu_check.WITH_TORCH
    needs = {m for it in gpu_check.items(1, 16, Path("/nonexistent")) if it.required
             for m in it.needs}
    for module in needs:
        dist = gpu_check.DISTRIBUTIONS.get(module, module)
        assert dist in packages or dist in with_torch, f"the bundle lacks {dist} ({module})"
    # --install proves itself by importing every module the bundle is for
    modules = re.search(r"^MODULES=(\S+)", script, re.M).group(1).split(",")
    assert set(modules) == {m for m in needs
                            if gpu_check.DISTRIBUTIONS.get(m, m) not in with_torch}
    # resolved with their dependencies, for the target Python and platform
    download = re.search(r"^download=\(([^)]*)\)", script, re.M | re.S).group(1)
    assert "--no-deps" not in download and "--python-version" in download
    assert re.search(r'^"\$\{download\[@\]\}" pip "\$\{PACKAGES\[@\]\}"$', script, re.M)


@pytest.mark.timeout(120)
def test_missing_tools_stop_the_run_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (7, 5))
    monkeypatch.setattr(gpu_check, "machine", lambda cores: dict(INFO, cores=cores))
    marker = tmp_path / "ran"
    monkeypatch.setattr(gpu_check, "items", lambda n, cores, tmp, **kw: [
        _fake("suite", "print(1)", needs=("no_such_module_here",), required=True),
        _fake("lesson", f"open({str(marker)!r}, 'w')", gpu="light")])
    monkeypatch.setattr(gpu_check, "RECORDS", tmp_path / "docs" / "gpu-check")
    code = gpu_check.main(["--out", str(tmp_path / "out"), "--commit", "--budget", "60"])
    out, err = capsys.readouterr()
    assert code == gpu_check.MISSING_TOOLS_EXIT != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no_such_module_here" in lines[0], err
    assert "offline_bundle.sh" in lines[0] and out == ""
    assert not marker.exists(), "an item ran although the check could not be complete"
    assert not (tmp_path / "docs").exists() and not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_commit_refuses_a_checklist_in_which_a_required_item_did_not_run(tmp_path,
                                                                        monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(gpu_check, "machine", lambda cores: dict(INFO, cores=cores))
    monkeypatch.setattr(gpu_check, "items", lambda n, cores, tmp, **kw: [
        _fake("suite", "import time; time.sleep(60)", gpu="light", timeout=1, required=True),
        _fake("quick", "print('ok')", gpu="light", expect=("ok",))])
    records = tmp_path / "docs" / "gpu-check"
    monkeypatch.setattr(gpu_check, "RECORDS", records)
    code = gpu_check.main(["--out", str(tmp_path / "out"), "--commit", "--budget", "60"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and "refused" in err[0] and "suite (timed out" in err[0], err
    assert not records.exists() or not list(records.iterdir()), "recorded all the same"
    assert (tmp_path / "out" / "checklist.md").is_file(), "the checklist itself is still kept"
    # --only without a required item: refused before anything runs
    code = gpu_check.main(["--out", str(tmp_path / "out2"), "--commit", "--only", "quick"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "suite" in err[0], err
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (8, 0), (9, 0)])
def test_low_precision_items_compute_in_what_the_course_s_rule_picks(capability, tmp_path):
    """A T4 (7.5) emulates bf16: the course's own rule (dpt/precision.py) says fp16 there."""
    from dpt.precision import low_precision_for

    want = low_precision_for(capability)
    assert want == ("bf16" if capability[0] >= 8 else "fp16")
    cc = ".".join(map(str, capability))
    for n_gpus, cores in MACHINES[:2]:
        todo = gpu_check.items(n_gpus, cores, tmp_path, capability=capability)
        by_hand = [it for it in todo if it.name.startswith("l09-fsdp-by-hand")]
        fsdp2 = [it for it in todo if it.name.startswith("l09-fsdp2-")]
        assert by_hand and fsdp2
        for it in by_hand:
            assert flag_value(it.argv, "--dtype") == want, it.name
            assert f"{want} compute" in it.what and cc in it.what, it.what
            assert re.search(it.expect[0], f"FSDP by hand on {it.cpus} rank(s), {want} "
                             "compute, prefetch on")
        for it in fsdp2:
            assert ("--bf16" in it.argv) == (want == "bf16"), it.name
            assert cc in it.what and ("bf16 policy" in it.what) == (want == "bf16"), it.what
        if want == "fp16":  # nothing computes in bf16 where it is emulated
            for it in todo:
                words = " ".join(it.argv).split()
                assert "--bf16" not in words, it.name
                for flag in ("--dtype", "--precision"):
                    if flag in words:
                        assert flag_value(it.argv, flag) != "bf16", it.name


INFO = {"gpus": ["NVIDIA H200", "NVIDIA H200"], "capabilities": ["9.0", "9.0"],
        "torch": "2.11.0+cu128", "cuda": "12.8", "driver": "570.133.20", "cores": 16,
        "python": "3.12.3", "date": "2026-11-26 10:00:00 UTC"}


def test_the_checklist_names_the_machine_the_time_and_every_item(tmp_path):
    results = [{"name": "suite", "what": "the whole suite", "status": "pass", "seconds": 200.0},
               {"name": "l05-ring-n2", "what": "the ring", "status": "fail", "seconds": 600.0,
                "reason": "stopped at the overall cap"},
               {"name": "l07-fsdp-n2-shared", "what": "Lightning", "status": "skipped",
                "reason": "needs 2 GPUs"}]
    md = gpu_check.write(results, INFO, tmp_path, elapsed=601.0, cap=600.0).read_text()
    for text in ("2 x NVIDIA H200 (compute capability 9.0)", "2.11.0+cu128", "CUDA 12.8",
                 "driver 570.133.20", "| cores | 16 |", "3.12.3", "2026-11-26",
                 "601 s of a 600 s cap", "1 of 3 items passed, 1 failed, 1 skipped",
                 "fail: stopped at the overall cap", "skipped: needs 2 GPUs"):
        assert text in md, f"{text!r} not in the checklist:\n{md}"
    for r in results:
        assert f"| {r['name']} |" in md
    doc = json.loads((tmp_path / "checklist.json").read_text())
    assert doc["machine"] == INFO and doc["cap_s"] == 600.0 and doc["elapsed_s"] == 601.0
    assert [r["name"] for r in doc["items"]] == [r["name"] for r in results]
    assert gpu_check.record_name(INFO) == "2x-nvidia-h200-2026-11-26.md"


@pytest.mark.timeout(120)
def test_commit_puts_the_checklist_under_the_tracked_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(gpu_check, "machine", lambda cores: dict(INFO, cores=cores))
    monkeypatch.setattr(gpu_check, "items", lambda n, cores, tmp, **kw: [
        _fake("quick", "print('ok')", gpu="light", expect=("ok",))])
    monkeypatch.setattr(gpu_check, "RECORDS", tmp_path / "docs" / "gpu-check")
    code = gpu_check.main(["--out", str(tmp_path / "out"), "--commit", "--budget", "60"])
    assert code == 0
    record = tmp_path / "docs" / "gpu-check" / gpu_check.record_name(INFO)
    assert record.read_text() == (tmp_path / "out" / "checklist.md").read_text()
    assert "| quick | pass |" in record.read_text()


def test_a_bad_budget_is_one_error_line(capsys):
    assert gpu_check.main(["--budget", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --budget")


def _make_n(tmp_path, python):
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    proc = subprocess.run(["make", "-n", "gpu-check", f"PYTHON={python}",
                           f"VENV={tmp_path / 'fresh-venv'}"],
                          capture_output=True, text=True, timeout=100, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.timeout(120)
def test_make_gpu_check_uses_a_python_that_has_torch_as_it_is(tmp_path):
    out = _make_n(tmp_path, sys.executable)
    assert "-m venv" not in out and "pip install" not in out, out
    assert f"{sys.executable} tools/gpu_check.py" in out, out
    assert "PYTHONPATH=" in out and f"{sys.executable} -m dpt.data" in out, out


@pytest.mark.timeout(120)
def test_make_gpu_check_builds_the_venv_for_a_python_without_torch(tmp_path):
    fake = tmp_path / "python-without-torch"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    out = _make_n(tmp_path, fake)
    assert f"{fake} -m venv" in out, out
    assert f"{tmp_path / 'fresh-venv'}/bin/python tools/gpu_check.py" in out, out


def test_the_machines_page_says_not_yet_run_until_a_checklist_is_committed():
    readme = (REPO / "docs" / "machines.md").read_text()
    records = sorted(p.name for p in gpu_check.RECORDS.glob("*.md"))
    if not records:
        assert "not yet run" in readme
    for name in records:
        assert name in readme, (f"docs/gpu-check/{name} is committed but docs/machines.md "
                                "does not quote it")


def test_the_offline_bundle_without_its_wheels_says_so_in_one_line(tmp_path):
    """`tools/offline_bundle.sh --install` on a machine where the bundle was never copied."""
    (tmp_path / "tools").mkdir()
    shutil.copy(REPO / "tools" / "offline_bundle.sh", tmp_path / "tools")
    proc = subprocess.run(["bash", str(tmp_path / "tools" / "offline_bundle.sh"), "--install"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no .offline/wheels"), proc.stderr
    assert not (tmp_path / "data").exists(), "it wrote data/ before finding its wheels"
