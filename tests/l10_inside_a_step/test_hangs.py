"""Lesson 10: the hang clinic (10.11-10.15), hang_clinic.py and its runner hang_runner.py.

Each task has a fix and a diagnosis. The fix is graded by running it (2 and 3 ranks): it
must finish, and give the numbers the broken code meant to compute, worked out here from the
given pieces only (the inputs, the model, the loss). The diagnosis is graded on its cause,
and on its evidence: a line that must occur in the report of its tool on the broken code, so
only a student who ran the tool can write it (paths, line numbers, times and ports are
normalised away).

Every run is bounded twice: the process group gives up after ``timeout_s`` and the runner
kills the ranks after ``timeout_s`` + 30 s. The broken cases use the clinic's 3 s; the fixed
ones 10 s, so that a loaded machine that starts one rank late does not fail a correct fix.
Nothing here measures speed.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import run_script
from tests.lessons import load, script

LESSON = "10_inside_a_step"
BROKEN_TIMEOUT, FIXED_TIMEOUT = 3.0, 10.0
TOL = 1e-5  # float32 sums in another order: ~1e-7; a real mistake moves the weights by 1e-2
# Lines of a report that every hang prints: they show that something waited, not why.
GENERIC = ("timed out waiting ?s for recv operation to complete",
           "timed out waiting ?s for send operation to complete",
           "connection closed by peer", "detected mismatch between collectives on ranks",
           "failed after ?s", "finished after ?s", "thread 0x? (most recent call first):",
           "flight recorder: its last", "'s stack, the last of")
FAULTHANDLER_HEAD = re.compile(r"timeout \([\d:.]+\)!?")  # "Timeout (0:00:01.500000)!"
STILL = {  # what a fix that still does not finish has left, case by case
    "order": "the ranks still call broadcast and all_reduce in different orders, or not every "
             "rank calls both",
    "rank0": "some rank still skips the all_reduce in mean_loss: only the print is rank 0's",
    "shapes": "the ranks still give all_gather tensors of different lengths (pad to the "
              "longest, which every rank must know)",
    "uneven": "a rank still runs a gradient all-reduce the others do not answer: train under "
              "Join([model]) and keep your own collectives outside its block",
    "nonfinite": "a rank still skips its gradient all-reduce alone: the ranks must agree on "
                 "the skip",
}
STUB = re.compile(r"NotImplementedError: (Task 10\.\d+[^\n]*)")


@pytest.fixture(scope="module")
def hc():
    return load(LESSON, "hang_clinic")


@pytest.fixture(scope="module")
def hr():
    return load(LESSON, "hang_runner")


def run_fixed(hc, case: str, world_size: int):
    """The fixed case's per-rank results; raises a task's NotImplementedError from the ranks."""
    report = hc.run_case(case, fixed=True, world_size=world_size, timeout_s=FIXED_TIMEOUT)
    stub = STUB.search(report.text)
    if stub:
        raise NotImplementedError(stub.group(1))
    assert report.finished, (
        f"the fixed {case!r} case did not finish on {world_size} ranks: {STILL[case]}."
        f"\n{report.text}")
    return report.results


def assert_same_on_every_rank(values: list, what: str) -> None:
    for rank, v in enumerate(values[1:], start=1):
        assert torch.allclose(torch.as_tensor(v), torch.as_tensor(values[0]), atol=TOL), (
            f"{what} differs between rank 0 and rank {rank}: {values[0]} vs {v}")


def check_diagnosis(hc, hr, case: str, cause_name: str) -> None:
    diagnosis = hc.CASES[case][2]()
    assert isinstance(diagnosis, hc.Diagnosis), "return a Diagnosis(cause, tool, evidence)"
    assert diagnosis.cause == hc.Cause[cause_name], (
        f"the {case!r} case's cause is not {diagnosis.cause.name}: read the report again "
        f"(the causes: {', '.join(c.name for c in hc.Cause)})")
    assert diagnosis.tool in hr.TOOLS, f"tool {diagnosis.tool!r} is not one of {hr.TOOLS}"
    needle = hr.normalise(diagnosis.evidence).lower()
    assert len(needle) >= 15, (
        f"the evidence {diagnosis.evidence!r} is too short to show anything: copy a whole line")
    assert not (any(needle in g for g in GENERIC) or FAULTHANDLER_HEAD.fullmatch(needle)), (
        f"the evidence {diagnosis.evidence!r} is printed by every hang: copy the line that "
        "shows what differs between the ranks")
    report = hc.run_case(case, fixed=False, tool=diagnosis.tool, timeout_s=BROKEN_TIMEOUT)
    assert not report.finished, f"the broken {case!r} case finished:\n{report.text}"
    assert hr.evidence_found(diagnosis.evidence, report.text), (
        f"the evidence {diagnosis.evidence!r} is not in the {diagnosis.tool} report of the "
        f"broken {case!r} case: run the tool and copy a line of its report.\n{report.text}")


# --- the runner and the broken cases (given code) -------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["order", "rank0", "shapes", "uneven", "nonfinite"])
def test_every_broken_case_fails_within_its_timeout(hc, case):
    report = hc.run_case(case, fixed=False, timeout_s=BROKEN_TIMEOUT)
    assert not report.finished, f"the broken {case!r} case finished: the clinic is not honest"
    assert report.text.startswith(f"=== case {case} (broken)")
    assert "FAILED" in report.text or "did not return" in report.text, report.text
    left = [pid for pid in report.pids if still_running(pid)]
    assert not left, f"the broken {case!r} case left rank processes {left} running"


def still_running(pid: int, grace: float = 5.0) -> bool:
    """Whether process ``pid`` still runs ``grace`` seconds from now (a zombie has ended)."""
    status = Path(f"/proc/{pid}/status")
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            state = next(ln for ln in status.read_text().splitlines() if ln.startswith("State"))
        except (OSError, StopIteration):
            return False
        if "Z" in state.split()[1]:
            return False
        time.sleep(0.1)
    return True


def test_normalise_removes_what_varies_between_runs(hr):
    a = ('  File "/work/main/solutions/10_inside_a_step/hang_clinic.py", line 263 in ddp_step\n'
         "[/__w/pytorch/third_party/gloo/tcp/pair.cc:561] Connection closed by peer "
         "[127.0.0.1]:43396 after 3.0 s, Thread 0x00007f4079244b80")
    b = ('  File "/home/me/exercises/10_inside_a_step/hang_clinic.py", line 80 in ddp_step\n'
         "[/src/gloo/pair.cc:12] Connection closed by peer [10.0.0.2]:1234 after 12.5 s, "
         "Thread 0x00007fab")
    assert hr.normalise(a) == hr.normalise(b)
    assert hr.evidence_found('File "hang_clinic.py", line 7 in ddp_step', a)
    assert not hr.evidence_found("in sgd_step", a)
    assert not hr.evidence_found("   ", a)


def test_stacks_report_shows_the_main_thread_when_other_threads_come_first(hr):
    """On a GPU machine faulthandler lists torch's threads (no Python frame) before the main
    one: the report must show the thread that runs the case, cut above the runner."""
    dump = ("Timeout (0:00:00.500000)!\n"
            "Thread 0x00007f502ffff6c0 (most recent call first):\n  <no Python frame>\n\n"
            "Thread 0x00007f5100000000 (most recent call first):\n"
            '  File "/x/threading.py", line 331 in wait\n\n'
            "Thread 0x00007f5200000000 (most recent call first):\n"
            '  File "/x/hang_clinic.py", line 262 in ddp_step\n'
            '  File "/x/hang_runner.py", line 150 in _rank_main\n'
            '  File "/x/ranks.py", line 240 in _worker\n')
    report = hr.last_stack("Timeout (0:00:00.500000)!\nThread 0x1 (most recent call first):\n"
                           '  File "/x/old.py", line 1 in old\n' + dump, rank=1)
    assert "the last of 2 dumps" in report
    assert "in ddp_step" in report and "no Python frame" not in report
    assert "threading.py" not in report and "_worker" not in report and "old.py" not in report
    # without the runner's frame (another caller): the first thread with a Python frame
    alone = hr.last_stack(dump.replace("_rank_main", "main"), rank=0)
    assert "in wait" in alone and "no Python frame" not in alone


def test_runner_rejects_bad_input_in_one_line(hc, hr):
    with pytest.raises(ValueError, match="unknown case"):
        hc.run_case("nope")
    with pytest.raises(ValueError, match="unknown tool"):
        hc.run_case("order", tool="gdb")
    with pytest.raises(ValueError, match="DETAIL"):
        hc.run_case("uneven", tool="detail")

    def nested(rank, world_size):
        return rank

    for fn in (lambda rank, world_size: None, nested):  # the ranks import fn by its name
        with pytest.raises(ValueError, match="cannot import .* by name"):
            hr.run_ranks(fn, "a case the ranks cannot import")


@pytest.mark.timeout(60)
def test_cli_runs_a_case_and_prints_its_report():
    proc = run_script(script(LESSON, "hang_clinic.py"), "--case", "order", "--tool", "flight",
                      timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "it did not finish" in proc.stdout, proc.stdout
    # the Flight Recorder's entries (torch >= 2.8 records gloo), or one line saying why not
    if "flight recorder: not available" not in proc.stdout:
        assert re.search(r"rank 0 collective #\d+: broadcast", proc.stdout), proc.stdout
        assert re.search(r"rank 1 collective #\d+: all_reduce", proc.stdout), proc.stdout


FAKE_CLINIC = """
import os, time
from pathlib import Path

import torch.distributed as dist

MARK, LATE, SEEN = Path({mark!r}), Path({late!r}), Path({seen!r})


def gone(pid):
    try:
        state = Path(f"/proc/{{pid}}/status").read_text().split("State:")[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def rank1_dies_after_rank0_returned(rank, error):
    if rank == 0:
        MARK.write_text(str(os.getpid()))
        raise error
    while not MARK.exists():
        time.sleep(0.01)
    while not gone(int(MARK.read_text())):  # rank 0 has returned, and left
        time.sleep(0.01)
    os._exit(3)  # as a rank does when the store it waits on went away with rank 0


def stub(rank, world_size):
    rank1_dies_after_rank0_returned(rank, NotImplementedError("Task 10.99: to do"))


def error(rank, world_size):
    rank1_dies_after_rank0_returned(rank, ValueError("rank 0's own mistake"))


def rank0_fails_at_once(rank, world_size):
    if rank == 0:
        MARK.write_text(str(os.getpid()))
        raise ValueError("rank 0 fails before its first collective")


_init = dist.init_process_group


def late_init(*args, **kwargs):  # rank 1 is still joining when rank 0 has failed
    _init(*args, **kwargs)
    if LATE.exists() and dist.get_rank() == 1:
        while not MARK.exists():
            time.sleep(0.01)
        time.sleep(1.0)
        SEEN.write_text("gone" if gone(int(MARK.read_text())) else "alive")


dist.init_process_group = late_init
"""
RUN_FAKE = """
from pathlib import Path

from dpt.lessons import load

fake_cases = load({lesson!r}, "fake_cases", {tree!r})
hang_runner = load({lesson!r}, "hang_runner", {tree!r})

if __name__ == "__main__":
    try:
        hang_runner.run_ranks(fake_cases.stub, "stub", timeout_s=5)
        print("stub: no NotImplementedError")
    except NotImplementedError as e:
        print(f"stub: NotImplementedError: {{e}}")
    Path({mark!r}).unlink()
    print(hang_runner.run_ranks(fake_cases.error, "error", timeout_s=5).text)
    Path({mark!r}).unlink()
    Path({late!r}).touch()
    print(hang_runner.run_ranks(fake_cases.rank0_fails_at_once, "late", timeout_s=5).text)
    print("rank 1 saw rank 0", Path({seen!r}).read_text())
"""


@pytest.mark.timeout(90)
def test_runner_reports_every_rank_when_one_fails_first(tmp_path):
    """Rank 0 serves the store the others read while they join the group. When a case fails
    on rank 0 at once (a stub raises), rank 0 must not leave before every peer has joined,
    and when a peer dies after rank 0 returned, the report must still carry rank 0's error,
    and a stub must still name its task (`make grade` reads the task from it). The runner runs
    the cases it is given: here a module of fake ones, beside a copy of the runner alone."""
    lesson = tmp_path / LESSON  # a lesson tree of two files: the runner and the fake cases
    lesson.mkdir()
    paths = {k: str(tmp_path / k) for k in ("mark", "late", "seen")}
    shutil.copy(script(LESSON, "hang_runner.py"), lesson / "hang_runner.py")
    (lesson / "fake_cases.py").write_text(FAKE_CLINIC.format(**paths))
    (tmp_path / "run.py").write_text(RUN_FAKE.format(lesson=LESSON, tree=str(tmp_path),
                                                     **paths))
    proc = run_script(tmp_path / "run.py", timeout=80)
    assert proc.returncode == 0, proc.stderr
    assert "stub: NotImplementedError: Task 10.99: to do" in proc.stdout, (
        f"the stub's NotImplementedError was lost when rank 1 died after rank 0 returned:\n"
        f"{proc.stdout}")
    assert "rank 1 of 2 died with exit code 3" in proc.stdout, proc.stdout
    assert re.search(r"rank 0 had returned: FAILED after [\d.]+ s ---\n"
                     r"ValueError: rank 0's own mistake", proc.stdout), (
        f"the report leaves out the error of rank 0, which returned first:\n{proc.stdout}")
    assert "rank 1 saw rank 0 alive" in proc.stdout, (
        "rank 0 left while rank 1 was still joining the group: a slow peer then dies of "
        f"'connection reset' while joining, and the report shows that, not the case\n"
        f"{proc.stdout}")
    assert "ValueError: rank 0 fails before its first collective" in proc.stdout, proc.stdout


@pytest.mark.parametrize("argv, words", [
    (["--case", "order", "--ranks", "1"], "--ranks must be at least 2"),
    (["--case", "order", "--timeout", "0"], "--timeout must be positive"),
    (["--tool", "flight"], "give --case"),
    (["--case", "uneven", "--tool", "detail"], "DETAIL"),
])
def test_cli_rejects_bad_input_in_one_line(hc, capsys, argv, words):
    with pytest.raises(SystemExit) as exc:
        hc.main(argv)
    message = str(exc.value.code) if isinstance(exc.value.code, str) else capsys.readouterr().err
    lines = [ln for ln in message.strip().splitlines() if "error" in ln]
    assert len(lines) == 1 and words in lines[0], message


@pytest.mark.parametrize("lines, passed", [
    (["order: diagnosis ORDER with tool detail", "  broken: failed, as it should; evidence "
      "found in its detail report", "  fixed: finished in 0.2 s"], True),
    (["order: diagnosis ORDER with tool detail", "  broken: failed, as it should; evidence "
      "NOT found in its detail report", "  fixed: finished in 0.2 s"], False),
    (["order: diagnosis ORDER with tool detail", "  broken: failed, as it should; evidence "
      "found in its detail report", "  fixed: FAILED in 3.1 s"], False),
])
def test_cli_check_exits_with_an_error_unless_every_case_passed(hc, monkeypatch, capsys,
                                                                 lines, passed):
    """`--check` is what a student (and the GPU check) runs: its exit status must say."""
    monkeypatch.setattr(hc, "check_case", lambda case, *a: lines)
    import sys

    monkeypatch.setitem(sys.modules, "hang_clinic", hc)  # main() imports it by this name
    if passed:
        hc.main(["--check", "--case", "order"])
        assert "every case checked" in capsys.readouterr().out
    else:
        with pytest.raises(SystemExit) as exc:
            hc.main(["--check", "--case", "order"])
        assert "not passed yet: order" in str(exc.value.code)


# --- 10.11 order -------------------------------------------------------------------------------

@pytest.mark.task("10.11")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_order_fixed_finishes_with_the_settings_and_mean_metrics(hc, hr, world_size):
    results = run_fixed(hc, "order", world_size)
    want_settings = hc.order_inputs(0)[0]
    want_metrics = torch.stack([hc.order_inputs(r)[1] for r in range(world_size)]).mean(0)
    for rank, (settings, metrics) in enumerate(results):
        assert torch.equal(settings, want_settings), (
            f"rank {rank} has settings {settings.tolist()}, not rank 0's "
            f"{want_settings.tolist()}: every rank must receive rank 0's broadcast")
        assert torch.allclose(metrics, want_metrics, atol=TOL), (
            f"rank {rank}'s metrics {metrics.tolist()} are not the mean over the ranks "
            f"{want_metrics.tolist()}")


@pytest.mark.task("10.11")
@pytest.mark.timeout(60)
def test_order_diagnosis_names_the_cause_with_evidence(hc, hr):
    check_diagnosis(hc, hr, "order", "ORDER")


# --- 10.12 rank0 -------------------------------------------------------------------------------

@pytest.mark.task("10.12")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_rank0_fixed_finishes_with_the_mean_over_every_rank(hc, hr, world_size):
    results = run_fixed(hc, "rank0", world_size)
    want = torch.cat([hc.epoch_losses(r) for r in range(world_size)]).mean().item()
    assert results[0] is not None, "rank 0 returned no mean: it must still compute and log it"
    assert results[0] == pytest.approx(want, abs=TOL), (
        f"rank 0 logs {results[0]}, but the mean over every rank's losses is {want}: the "
        "mean over every rank's losses needs every rank's sum and count")


@pytest.mark.task("10.12")
@pytest.mark.timeout(60)
def test_rank0_diagnosis_names_the_cause_with_evidence(hc, hr):
    check_diagnosis(hc, hr, "rank0", "RANK_BRANCH")


# --- 10.13 shapes ------------------------------------------------------------------------------

@pytest.mark.task("10.13")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_shapes_fixed_gathers_every_prediction_once(hc, hr, world_size):
    results = run_fixed(hc, "shapes", world_size)
    want = torch.cat([hc.eval_predictions(r, world_size) for r in range(world_size)])
    for rank, got in enumerate(results):
        assert got.numel() == want.numel(), (
            f"rank {rank} gathered {got.numel()} predictions, the ranks hold {want.numel()}: "
            "the padding added to equalise the shapes must be cut off again")
        assert torch.equal(got, want), (
            f"rank {rank} gathered {got.tolist()}, not {want.tolist()} (every rank's own "
            "predictions, in rank order, each cut at its own length)")


@pytest.mark.task("10.13")
@pytest.mark.timeout(60)
def test_shapes_diagnosis_names_the_cause_with_evidence(hc, hr):
    check_diagnosis(hc, hr, "shapes", "SHAPES")


# --- 10.14 uneven ------------------------------------------------------------------------------

def reference_training(hc, batches: list[list], skip: set[int] = frozenset()):
    """One process: at each step, the gradients of the ranks that still have a batch, summed
    and divided by the world size (DDP's average, which Join keeps), then an SGD step."""
    model = hc.make_model()
    world_size = len(batches)
    for step in range(max(len(b) for b in batches)):
        if step in skip:
            continue
        total = [torch.zeros_like(p) for p in model.parameters()]
        for mine in batches:
            if step < len(mine):
                model.zero_grad()
                hc.loss_fn(model, *mine[step]).backward()
                for t, p in zip(total, model.parameters()):
                    t += p.grad
        with torch.no_grad():
            for t, p in zip(total, model.parameters()):
                p -= hc.LR * t / world_size
    return hc.flat_params(model)


@pytest.mark.task("10.14")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_fixed_trains_on_every_sample_and_ends_in_sync(hc, hr, world_size):
    results = run_fixed(hc, "uneven", world_size)
    for rank, (seen, _) in enumerate(results):
        want = sum(len(x) for x, _ in hc.uneven_batches(rank))
        assert seen == want, (
            f"rank {rank} trained on {seen} samples, it holds {want}: with Join every rank "
            "trains on all its batches; dropping the extra ones loses data")
    params = [p for _, p in results]
    assert_same_on_every_rank(params, "the model after training")
    want = reference_training(hc, [hc.uneven_batches(r) for r in range(world_size)])
    assert torch.allclose(params[0], want, atol=TOL), (
        "the model differs from DDP's average over the ranks that still had a batch at each "
        f"step (max diff {(params[0] - want).abs().max():.2e}): train under Join([model]) "
        "with its defaults")


@pytest.mark.task("10.14")
@pytest.mark.timeout(60)
def test_uneven_diagnosis_names_the_cause_with_evidence(hc, hr):
    check_diagnosis(hc, hr, "uneven", "UNEVEN")


# --- 10.15 nonfinite ---------------------------------------------------------------------------

@pytest.mark.task("10.15")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_nonfinite_fixed_skips_the_bad_step_on_every_rank(hc, hr, world_size):
    results = run_fixed(hc, "nonfinite", world_size)
    params = [p for _, p in results]
    assert all(torch.isfinite(p).all() for p in params), (
        "NaN reached the weights: a rank stepped with the corrupt batch's gradients (skip "
        "the step on every rank when any rank's loss is not finite, and drop its gradients)")
    for rank, (steps, _) in enumerate(results):
        assert steps == hc.BATCHES - 1, (
            f"rank {rank} took {steps} steps, not {hc.BATCHES - 1}: every rank skips exactly "
            "the step at which some rank's loss is not finite")
    assert_same_on_every_rank(params, "the model after training")
    want = reference_training(hc, [hc.nonfinite_batches(r) for r in range(world_size)],
                              skip={hc.BAD_STEP})
    assert torch.allclose(params[0], want, atol=TOL), (
        f"the model differs from training on the good steps only (max diff "
        f"{(params[0] - want).abs().max():.2e}): a skipped step must leave no gradient behind")


@pytest.mark.task("10.15")
@pytest.mark.timeout(60)
def test_nonfinite_diagnosis_names_the_cause_with_evidence(hc, hr):
    check_diagnosis(hc, hr, "nonfinite", "LOCAL_SKIP")
