"""Lesson 12, tasks 12.5-12.6: algbw and busbw as nccl-tests counts them, and one collective
timed on every rank.

12.5 is arithmetic, checked against nccl-tests' ``doc/PERFORMANCE.md``: the factors at several
N (and at one rank), and the size S of each operation (the whole array). 12.6 runs on 2 gloo
ranks in one launch (``rank_fns_bandwidth.bandwidth_checks``): the real collectives, their
tensors counted through wrapped ``torch.distributed`` calls, and a pretend asynchronous device
on a pretend clock, on which a missing warm-up, sync or maximum over the ranks gives a wrong
time exactly, whatever the machine's load. The given code (the fit, the command line) is
checked without a mark; the benchmark's small form runs once.
"""

from __future__ import annotations

import json
import re
import statistics

import pytest

from tests.helpers import checked_part, ranks_or_fail
from tests.l12_step_cost import rank_fns_bandwidth as rf
from tests.lessons import REPO, load, target

LESSON = rf.LESSON
TIMEOUT = 120
FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


@pytest.fixture(scope="module")
def bw():
    return load(LESSON, "bandwidth")


@pytest.fixture(scope="module")
def runs():
    return ranks_or_fail(rf.bandwidth_checks, rf.N, timeout=TIMEOUT)


# --- 12.5 the factors and the size ---------------------------------------------------------------

@pytest.mark.task("12.5")
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_bus_factors_are_nccl_tests(bw, n):
    why = {"all_reduce": "a reduce-scatter then an all-gather: 2(n-1) transfers per element "
                         "over n links",
           "all_gather": "only the assignment half of an all-reduce: (n-1)/n, not 2(n-1)/n",
           "reduce_scatter": "only the addition half of an all-reduce: (n-1)/n, not 2(n-1)/n",
           "broadcast": "every byte leaves the root through its one link: the factor is 1, "
                        "whatever n (not (n-1)/n)"}
    for op, factor in FACTORS.items():
        got = bw.bus_factor(op, n)
        assert got == pytest.approx(factor(n), rel=1e-12), (
            f"bus_factor({op!r}, {n}) = {got}, nccl-tests' is {factor(n):.4g}: {why[op]}")


@pytest.mark.task("12.5")
def test_bus_factors_at_one_rank_and_bad_input(bw):
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert bw.bus_factor(op, 1) == 0, (
            f"bus_factor({op!r}, 1) = {bw.bus_factor(op, 1)}: at one rank nothing crosses a "
            "link, (n-1)/n is 0 (nccl-tests prints busbw 0)")
    assert bw.bus_factor("broadcast", 1) == 1, "broadcast's factor is 1 at any n"
    for bad in [("all_reduce", 0), ("all_to_all", 2)]:
        with pytest.raises(ValueError):
            bw.bus_factor(*bad)


@pytest.mark.task("12.5")
def test_bandwidths_count_the_whole_array(bw):
    n, t, chunk = 4, 0.01, 2_000_000  # each rank's chunk of an all-gather or reduce-scatter
    cases = {"all_gather": (chunk, n * chunk), "reduce_scatter": (n * chunk, chunk),
             "all_reduce": (n * chunk, n * chunk), "broadcast": (n * chunk, n * chunk)}
    for op, (inp, out) in cases.items():
        got = bw.bandwidths(op, inp, out, t, n)
        size = n * chunk
        if got["size"] == chunk:
            pytest.fail(f"{op}: S = {chunk} bytes, one rank's chunk; nccl-tests' S is the whole "
                        f"array, {size} bytes ({n} chunks: the "
                        + ("gathered output" if op == "all_gather" else "input scattered")
                        + "), so algbw = S / t", pytrace=False)
        assert got["size"] == size, f"{op}: S = {got['size']}, expected {size} bytes"
        assert got["algbw"] == pytest.approx(size / t, rel=1e-12), (
            f"{op}: algbw {got['algbw']:.4g} B/s, expected S / t = {size / t:.4g}")
        assert got["busbw"] == pytest.approx(size / t * FACTORS[op](n), rel=1e-12), (
            f"{op}: busbw {got['busbw']:.4g} B/s, expected algbw x {FACTORS[op](n):.4g} = "
            f"{size / t * FACTORS[op](n):.4g} (bus_factor)")
    with pytest.raises(ValueError):
        bw.bandwidths("all_reduce", 8, 8, 0.0, 2)


# --- 12.6 one collective, timed on every rank -------------------------------------------------

EXPECTED_BYTES = {"all_reduce": (rf.SIZE, rf.SIZE), "broadcast": (rf.SIZE, rf.SIZE),
                  "all_gather": (rf.SIZE // rf.N, rf.SIZE),
                  "reduce_scatter": (rf.SIZE, rf.SIZE // rf.N)}
DIST_FN = {"all_reduce": ("all_reduce",), "broadcast": ("broadcast",),
           "all_gather": ("all_gather_into_tensor", "all_gather"),
           "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter")}


@pytest.mark.task("12.6")
@pytest.mark.timeout(TIMEOUT + 30)
def test_time_collective_sizes_the_tensors_per_operation(runs):
    for rank, res in enumerate(runs):
        real = checked_part(res["real"])
        for op, (want_in, want_out) in EXPECTED_BYTES.items():
            calls = [c for c in real[op]["calls"]  # not the all-reduce of the times
                     if c["fn"] in DIST_FN[op] and not c["max"]]
            assert calls, f"rank {rank}: time_collective({op!r}) never called {DIST_FN[op][0]}"
            sizes = {(c["in"], c["out"]) for c in calls}
            where = f"rank {rank}, {op} of S = {rf.SIZE} bytes on {rf.N} ranks"
            assert sizes == {(want_in, want_out)}, (
                f"{where}: the tensors passed were (input, output) bytes {sorted(sizes)}, "
                f"expected ({want_in}, {want_out})"
                + (": each rank's input is a chunk of S/N, the gathered output is S"
                   if op == "all_gather" else ": the input is S, each rank's output a chunk "
                   "of S/N" if op == "reduce_scatter" else ": one buffer of S"))
            got = real[op]["result"]
            assert (got["input_bytes"], got["output_bytes"]) == (want_in, want_out), (
                f"{where}: returned input_bytes {got['input_bytes']}, output_bytes "
                f"{got['output_bytes']}; the tensors used were ({want_in}, {want_out})")
            assert {c["device"] for c in calls} == {real["device"]}, (
                f"{where}: tensors on {sorted({c['device'] for c in calls})}, not on "
                f"rank_device() ({real['device']})")


@pytest.mark.task("12.6")
@pytest.mark.timeout(TIMEOUT + 30)
def test_time_collective_reports_the_slowest_ranks_time_on_every_rank(runs):
    fakes = [checked_part(res["fake_device"]) for res in runs]
    got = [f["result"]["seconds"] for f in fakes]
    want = rf.COST + rf.LATE
    if got[0] == pytest.approx(rf.COST) and got[1] == pytest.approx(want):
        pytest.fail(f"rank 1 returns {rf.LATE * 1e3:g} ms late from each call: it took "
                    f"{want * 1e3:g} ms, rank 0 {rf.COST * 1e3:g} ms, and each reported its own; "
                    "the collective is done when its slowest rank is: all-reduce with "
                    "ReduceOp.MAX", pytrace=False)
    for op in EXPECTED_BYTES:
        times = [checked_part(res["real"])[op]["result"]["seconds"] for res in runs]
        assert all(t > 0 for t in times), f"{op}: times {times}: must be positive seconds"
        assert len(set(times)) == 1, (
            f"{op}: the ranks report different times {times}: each its own; all-reduce the "
            "median with ReduceOp.MAX, so every rank reports the slowest rank's")


@pytest.mark.task("12.6")
@pytest.mark.timeout(TIMEOUT + 30)
def test_time_collective_times_finished_work_after_the_warm_up(runs):
    want = rf.COST + rf.LATE
    for rank, res in enumerate(runs):
        fake = checked_part(res["fake_device"])
        got = fake["result"]["seconds"]
        who = (f"rank {rank}, a pretend GPU: each call queues {rf.COST * 1e3:g} ms of work "
               f"(the first {rf.SETUP:g} s more, its set-up), rank 1 returns "
               f"{rf.LATE * 1e3:g} ms late; time_collective(repeats=2, warmup=1)")
        assert fake["barriers"] >= 2, (
            f"{who}: {fake['barriers']} barrier(s) for 2 repeats: call dist.barrier() before "
            "each timed call, so every rank starts together")
        if got >= rf.SETUP / 4:
            pytest.fail(f"{who}: {got:.3f} s, the first call's set-up counted: make `warmup` "
                        "untimed calls first, and synchronize the device before starting the "
                        "clock (the warm-up's queued work must not count)", pytrace=False)
        if got < rf.COST:
            pytest.fail(f"{who}: {got * 1e3:.3f} ms, less than the {rf.COST * 1e3:g} ms the "
                        "call queued: the clock was read before the device finished; call "
                        "synchronize(device) before each time.perf_counter() read (the test "
                        "replaces both)", pytrace=False)
        assert got == pytest.approx(want, abs=1e-9), (
            f"{who}: {got * 1e3:.4f} ms, expected {want * 1e3:g} ms")


@pytest.mark.task("12.6")
@pytest.mark.timeout(TIMEOUT + 30)
def test_time_collective_reports_the_median_of_the_repeats(runs):
    want = statistics.median(rf.CYCLE)
    for rank, res in enumerate(runs):
        got = checked_part(res["fake_median"])["result"]["seconds"]
        names = {statistics.mean(rf.CYCLE): "the mean", min(rf.CYCLE): "the minimum",
                 max(rf.CYCLE): "the maximum"}
        what = next((name for v, name in names.items() if got == pytest.approx(v)), None)
        assert got == pytest.approx(want, abs=1e-9), (
            f"rank {rank}: 3 repeats taking {', '.join(f'{c * 1e3:g}' for c in rf.CYCLE)} ms "
            f"gave {got * 1e3:.4f} ms" + (f", {what}" if what else "")
            + f"; expected their median, {want * 1e3:g} ms (one slow repeat must not move it)")


# --- given code: the fit, the command line, the benchmark's small form ------------------------

def test_fit_alpha_beta_recovers_the_ring_model(bw):
    alpha, bandwidth, n = 30e-6, 2e9, 4
    sizes = [4**k * 1024 for k in range(9)]
    times = [alpha + 2 * (n - 1) / n * s / bandwidth for s in sizes]
    fit = bw.fit_alpha_beta(sizes, times, n)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-9)
    assert fit["bandwidth_Bps"] == pytest.approx(bandwidth, rel=1e-9)
    assert bw.fit_line(n, fit) == "N=4 all-reduce: alpha = 30.0 us, bandwidth = 2.00 GB/s"
    with pytest.raises(ValueError, match="does not grow"):
        bw.fit_alpha_beta(sizes, list(reversed(times)), n)


@pytest.mark.parametrize("argv,said", [
    (["--max-nproc", "1"], "at least 2"),
    (["--max-nproc", "999"], "more ranks than"),
    (["--min-kb", "8", "--max-mb", "0.001"], "--min-kb <= --max-mb"),
    (["--repeats", "0"], "--repeats >= 1"),
    (["--out", "{tmp}/missing/x.json"], "does not exist"),
])
def test_bad_flags_are_one_line_errors(bw, capsys, tmp_path, argv, said):
    assert bw.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err


def test_on_a_gpu_machine_every_gpu_is_a_rank_and_no_more(bw, monkeypatch, capsys):
    """The NCCL path's limit, on pretend GPUs (tests/gpu and `make gpu-check` run it for real)."""
    monkeypatch.setattr(bw.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bw.torch.cuda, "device_count", lambda: 4)
    assert bw.max_ranks() == (4, "4 GPUs")
    assert bw.check(bw.build_parser().parse_args([])) == [2, 3, 4]
    assert bw.main(["--max-nproc", "8"]) == 2
    assert "more ranks than this machine's 4 GPUs" in capsys.readouterr().err


@pytest.mark.timeout(150)
def test_the_benchmarks_small_form_writes_its_table_figure_and_fit(tmp_path, capsys):
    if target() != (REPO / "solutions").resolve():
        pytest.skip("the benchmark runs solutions/ whatever the target: checked when the "
                    "tests target solutions/")
    import benchmarks.bench_l12_collectives as bench

    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "l12_collectives.json").read_text())
    rows = result["rows"]
    sizes = [1024 * 4**k for k in range(5)]  # 1 KB to 256 KB
    assert {(r["op"], r["size"], r["n"]) for r in rows} == {
        (op, s, 2) for op in FACTORS for s in sizes}
    for r in rows:
        assert r["seconds"] > 0
        assert r["busbw"] == pytest.approx(r["algbw"] * FACTORS[r["op"]](2))
        assert ("emulated" in r) == (r["op"] == "reduce_scatter"), r  # gloo emulates it
    # the fit, or why not: on a loaded machine a small message can take longer than a large one
    assert re.search(r"N=2 all-reduce: (alpha = [\d.]+ us, bandwidth = [\d.]+ GB/s|no fit \(time "
                     r"does not grow)", out), out
    assert {"alpha_s", "bandwidth_Bps"} <= set(result["fit"]["2"]) or "error" in result["fit"]["2"]
    assert "emulated" in out
    assert (tmp_path / "l12_collectives.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
