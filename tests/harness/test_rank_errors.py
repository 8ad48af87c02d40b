"""A failed rank is reported with its cause in one line (dpt.errors), not "rank 1 of 2 failed:".

The rank's traceback puts the cause (``NotImplementedError: Task 08.2: ...``) on its last
line; a script that printed the first line of the failure's text showed nothing after the
colon. Here: a stub and a planted error on rank 1, through run_distributed; a lesson script's
own main on a stubbed copy of the lesson; and the benchmark's record of a failed method.
"""

import functools
import io
import re
import sys

import pytest

from dpt.errors import TRACEBACK_VAR, one_line, report_error
from dpt.ranks import RankFailure, run_distributed
from tests.harness import failing_ranks
from tests.helpers import one_line_error, run_script
from tests.lessons import REPO


def _failure(fn, world_size=2) -> RankFailure:
    with pytest.raises(RankFailure) as info:
        run_distributed(fn, world_size=world_size, timeout=60, echo=False)
    return info.value


@pytest.fixture(autouse=True)
def _no_traceback_asked(monkeypatch):
    monkeypatch.delenv(TRACEBACK_VAR, raising=False)


@pytest.mark.timeout(90)
def test_a_stub_on_rank_1_is_named_with_its_task_and_its_rank():
    exc = _failure(failing_ranks.stub_on_rank_1)
    assert (exc.rank, exc.world_size, exc.kind) == (1, 2, "NotImplementedError")
    assert exc.message == failing_ranks.STUB and "stub_on_rank_1" in exc.traceback
    assert one_line(exc) == f"rank 1 of 2 failed: NotImplementedError: {failing_ranks.STUB}"


@pytest.mark.timeout(90)
def test_the_rank_whose_stub_broke_the_collective_is_the_one_named():
    # rank 0 fails as well (its peer left the barrier) and may be the first to report: the
    # line still names rank 1's task, the cause, not rank 0's connection error
    line = one_line(_failure(failing_ranks.stub_on_rank_1_while_rank_0_waits))
    assert line == f"rank 1 of 2 failed: NotImplementedError: {failing_ranks.STUB}", line


@pytest.mark.timeout(90)
def test_a_planted_error_on_rank_1_gives_its_type_and_message():
    line = one_line(_failure(failing_ranks.divide_by_zero_on_rank_1))
    assert line == "rank 1 of 2 failed: ZeroDivisionError: division by zero", line


@pytest.mark.timeout(90)
def test_a_message_whose_cause_is_on_its_later_lines_is_given_whole_on_one_line(capsys):
    exc = _failure(failing_ranks.multiline_error_on_rank_1)
    assert report_error(exc) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: rank 1 of 2 failed: RuntimeError: shapes do not match: got [3, 4] "
                   f"expected [4, 3] ({TRACEBACK_VAR}=1 for the traceback)"], err


@pytest.mark.timeout(90)
def test_the_traceback_is_printed_on_request(monkeypatch):
    exc = _failure(failing_ranks.stub_on_rank_1)
    monkeypatch.setenv(TRACEBACK_VAR, "1")
    out = io.StringIO()
    report_error(exc, file=out)
    lines = out.getvalue().splitlines()
    assert "Traceback (most recent call last):" in lines
    assert any("in stub_on_rank_1" in line for line in lines), lines  # the rank's frames
    assert lines[-1] == f"error: rank 1 of 2 failed: NotImplementedError: {failing_ranks.STUB}"


@pytest.mark.timeout(60)
def test_a_rank_that_dies_says_how():
    from tests.harness import rank_fns

    line = one_line(_failure(rank_fns.exit_on_rank_0))
    assert line == "rank 0 of 2 died with exit code 3 before reporting", line


def test_errors_outside_the_ranks_keep_their_first_line():
    assert one_line(ValueError("--nproc must be at least 1\nmore")) == "--nproc must be at least 1"
    assert one_line(NotImplementedError("Task 09.1: one fp32 vector")) == "Task 09.1: one fp32 vector"
    assert one_line(RuntimeError()) == "RuntimeError"
    out = io.StringIO()
    assert report_error(OSError("disk full"), file=out) == 2
    assert out.getvalue() == "error: disk full\n"  # no hint: it has no rank's traceback


def test_a_rankfailure_from_another_launcher_keeps_its_last_line():
    # benchmarks/run.py's torchrun launcher puts the root cause on the last line
    exc = RankFailure("torchrun log ...\n=====\ntorchrun exited with 1: rank 1 died with SIGABRT")
    assert one_line(exc) == "torchrun exited with 1: rank 1 died with SIGABRT"


@pytest.mark.timeout(150)
def test_a_lesson_script_on_a_stub_prints_the_task_after_failed(tmp_path):
    """fsdp_by_hand.py's own main, on a copy of lesson 09 whose tasks are stubs (as in
    exercises/): the error line names the task the ranks stopped at, with its hint."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import make_exercises as gen
    finally:
        sys.path.remove(str(REPO / "tools"))
    lesson = tmp_path / "09_fsdp"
    lesson.mkdir()
    source = REPO / "solutions" / "09_fsdp"
    stubbed, tasks = gen.strip_solutions((source / "fsdp_by_hand.py").read_text())
    assert "09.1" in tasks, "task 09.1 (shard_flat, the first a rank reaches) moved: update"
    (lesson / "fsdp_by_hand.py").write_text(stubbed)
    hint = re.search(r'raise NotImplementedError\("(Task 09\.1: [^"]*)"\)', stubbed)[1]
    proc = run_script(lesson / "fsdp_by_hand.py", "--nproc", "2", "--steps", "1",
                      "--timeout", "90", timeout=130, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_line_error(proc)
    assert re.fullmatch(rf"error: rank [01] of 2 failed: NotImplementedError: "
                        rf"{re.escape(hint)} \({TRACEBACK_VAR}=1 for the traceback\)", line), line


@pytest.mark.timeout(120)
def test_the_benchmark_records_a_failed_methods_cause_as_its_error(monkeypatch):
    import dpt.ranks
    from benchmarks.registry import load_all
    from benchmarks.run import Config, launch

    # the ranks import the failing methods too (the fork server may predate this setting)
    monkeypatch.setenv("DPT_BENCH_EXTRA", "tests.harness.bench_methods")
    monkeypatch.setattr(dpt.ranks, "run_distributed", functools.partial(
        run_distributed, env={"DPT_BENCH_EXTRA": "tests.harness.bench_methods"}))
    out = launch("broken", 1, Config(pin=False, timeout=60), load_all())
    assert out["status"] == "failed", out
    assert out["error"] == "rank 0 of 1 failed: RuntimeError: this method is broken on purpose", (
        out["error"])


def test_a_lost_rendezvous_names_its_address(monkeypatch):
    """dpt.cli's mains and dpt.errors share one line for a network error: where it was."""
    import torch.distributed as dist

    from dpt.errors import one_line

    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29511")
    line = one_line(dist.DistNetworkError("connect() timed out\nmore detail"))
    assert line == ("lost or never reached the rendezvous at 10.0.0.7:29511 "
                    "(connect() timed out)"), line
