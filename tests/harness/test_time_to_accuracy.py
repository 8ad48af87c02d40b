"""Time to accuracy in `make benchmark` (benchmarks/time_to_accuracy.py): the summary of the
runs, the MLPerf-style epochs check, the plan's flags and the summary table, on made-up rows.
The run itself is in test_benchmarks.py (tools, slow)."""

import math
import statistics

import pytest

from benchmarks.analysis import fmt_ci
from benchmarks.time_to_accuracy import (
    TTAConfig,
    block_of,
    epochs_check_line,
    epochs_verdict,
    tta_markdown,
    tta_summary,
)


def _row(n, rnd, seconds, epochs, reached=True, status="ok", foreign=0.0):
    row = {"round": rnd, "seed": rnd, "nprocs": n, "status": status}
    if status != "ok":
        return {**row, "error": "RankFailure: rank 1 died"}
    return {**row, "global_batch": 64 * n, "lr": 0.02 * n, "reached": reached,
            "steps": round(epochs * 60000 / (64 * n)), "samples": round(epochs * 60000),
            "epochs": epochs, "seconds": seconds, "final_accuracy": 0.861 if reached else 0.84,
            "load": {"foreign_cores": foreign, "cpus": 2, "steal": 0.0, "load1": 1.0}}


def _geo_ci(xs):
    """A 95% t-interval on the logs, by hand (df 1: 12.706, df 2: 4.303)."""
    logs = [math.log(x) for x in xs]
    t = {2: 12.706, 3: 4.303}[len(xs)]
    half = t * statistics.stdev(logs) / math.sqrt(len(xs))
    m = statistics.fmean(logs)
    return math.exp(m), math.exp(m - half), math.exp(m + half)


RUNS = [_row(1, 0, 10.0, 0.60), _row(2, 0, 6.0, 0.64),
        _row(2, 1, 5.0, 0.62), _row(1, 1, 12.0, 0.70),
        _row(1, 2, 11.0, 0.65), _row(2, 2, 9.0, 1.90, reached=False),
        _row(1, 3, 0, 0, status="failed"), _row(2, 3, 5.5, 0.60)]


def test_the_summary_pairs_rounds_and_leaves_out_misses_and_failures_with_a_note():
    s = tta_summary(RUNS, margin=0.25)
    one, two = s["by_n"]
    # N = 1: rounds 0-2 reached (round 3 failed); N = 2: 0, 1, 3 of 4 (round 2 missed)
    assert (one["nprocs"], one["reached"], one["rounds"]) == (1, 3, 3)
    assert (two["nprocs"], two["reached"], two["rounds"]) == (2, 3, 4)
    assert (one["global_batch"], two["global_batch"], two["lr"]) == (64, 128, 0.04)
    g, lo, hi = _geo_ci([10.0, 12.0, 11.0])
    assert (one["seconds"], one["seconds_lo"], one["seconds_hi"]) == pytest.approx((g, lo, hi))
    e = [0.64, 0.62, 0.60]
    half = 4.303 * statistics.stdev(e) / math.sqrt(3)
    assert (two["epochs"], two["epochs_lo"], two["epochs_hi"]) == pytest.approx(
        (statistics.fmean(e), statistics.fmean(e) - half, statistics.fmean(e) + half))
    # The speedup pairs N = 2 with N = 1 of the same round, where both reached: rounds 0, 1
    (sp,) = s["speedup"]
    assert sp["nprocs"] == 2 and sp["rounds"] == 2
    assert (sp["value"], sp["lo"], sp["hi"]) == pytest.approx(_geo_ci([10 / 6, 12 / 5]))
    check = s["epochs_check"]
    assert check["rounds"] == 2
    assert check["ratio"] == pytest.approx(_geo_ci([0.64 / 0.60, 0.62 / 0.70])[0])
    assert check["verdict"] == "ok"
    # the same runs' throughput (samples a second), paired by round: time = throughput / epochs
    n1 = {r["round"]: r for r in RUNS if r["nprocs"] == 1 and r["status"] == "ok"}
    thr = [(r["samples"] / r["seconds"]) / (n1[r["round"]]["samples"] / n1[r["round"]]["seconds"])
           for r in RUNS[1:3]]
    assert (sp["throughput"]["value"], sp["throughput"]["lo"], sp["throughput"]["hi"]) == \
        pytest.approx(_geo_ci(thr))
    assert sp["value"] == pytest.approx(sp["throughput"]["value"] / check["ratio"])
    text = " ".join(s["notes"])
    assert "N=2 round 3 missed the target" in text and "censored" in text
    assert "N=1 round 4: failed" in text


def test_the_epochs_check_is_ok_within_the_margin_worse_beyond_it_unclear_between():
    assert epochs_verdict(1.25, 1.0, 1.5, margin=0.25) == "ok"  # the bound is inclusive
    assert epochs_verdict(0.8, None, None, margin=0.25) == "ok"
    assert epochs_verdict(1.6, 1.3, 1.9, margin=0.25) == "worse"
    assert epochs_verdict(1.6, 1.2, 2.1, margin=0.25) == "unclear"  # its interval reaches in
    assert epochs_verdict(1.6, None, None, margin=0.25) == "unclear"  # one round: no interval
    assert epochs_verdict(1.05, 1.01, 1.09, margin=0.0) == "worse"
    with pytest.raises(ValueError, match="margin"):
        epochs_verdict(1.0, None, None, margin=-0.1)


def test_a_batch_that_needs_twice_the_epochs_every_round_is_worse_and_the_line_says_so():
    runs = [r for rnd in range(3) for r in (_row(1, rnd, 10 + rnd, 0.6 + 0.01 * rnd),
                                            _row(2, rnd, 9 + rnd, 1.2 + 0.03 * rnd))]
    check = tta_summary(runs, margin=0.25)["epochs_check"]
    assert check["verdict"] == "worse" and check["lo"] > 1.25, check
    line = epochs_check_line(check)
    assert "**worse**" in line and "N=2" in line and "overstates" in line
    assert "no epochs check" in epochs_check_line(None)


def test_no_round_where_both_reached_gives_no_speedup_and_says_why():
    runs = [_row(1, 0, 10.0, 0.6), _row(2, 0, 9.0, 3.0, reached=False),
            _row(2, 1, 6.0, 0.6), _row(1, 1, 12.0, 3.0, reached=False)]
    s = tta_summary(runs, margin=0.25)
    assert s["speedup"] == [] and s["epochs_check"] is None
    assert any("no round where N=1 and N=2 both reached" in n for n in s["notes"])


def test_a_run_on_a_busy_machine_is_noted():
    runs = [_row(1, 0, 10.0, 0.6, foreign=1.2), _row(2, 0, 6.0, 0.6)]
    notes = tta_summary(runs, margin=0.25)["notes"]
    assert [n for n in notes if "busy" in n] == [
        "N=1 round 1: other processes used 1.20 cores during the run (unreliable: machine busy)"]


def _result(block):
    return {"stamp": "20990101-000000", "records": [], "ratios": [],
            "machine": {"label": "2-core CPU (made up)", "cpu": "test", "torch": "test"},
            "config": {"rounds": 4, "scaling": "weak", "batch_size": 128, "strong": False,
                       "repeats": 1, "steps": 4},
            "verdict": {"messages": ["No sign of a busy machine."]},
            "time_to_accuracy": block}


def test_results_carry_the_block_and_summary_md_shows_the_table_and_the_check():
    from benchmarks.run import summary_markdown

    records = [{"method": "ddp_spawn", "nprocs": 2, "status": "ok", "speedup": 1.8,
                "speedup_lo": 1.7, "speedup_hi": 1.9},
               {"method": "independent", "nprocs": 2, "status": "ok", "speedup": 1.95}]
    block = block_of(TTAConfig(), RUNS, records)
    assert block["config"]["target"] == TTAConfig.target and "timeout" not in block["config"]
    assert block["ddp_spawn_speedup"] == [{"nprocs": 2, "value": 1.8, "lo": 1.7, "hi": 1.9}]
    assert block["speedup"][0]["ddp_spawn"] == {"value": 1.8, "lo": 1.7, "hi": 1.9}
    (thr,) = block["throughput_speedup"]
    assert thr == {"nprocs": 2, "rounds": 2, **block["speedup"][0]["throughput"]}
    assert block["runs"] is RUNS and block["epochs_check"]["verdict"] == "ok"
    text = summary_markdown(_result(block))
    assert "| N | global batch | lr | reached | epochs to target | seconds to target | " \
           "time-to-target speedup | throughput speedup |" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| 2 | 128 |"))
    shown = fmt_ci(thr["value"], thr["lo"], thr["hi"])
    assert row.endswith(f"| {shown} |") and "3/4" in row and row.count("[") == 4, row
    assert "`ddp_spawn` in the throughput rounds (the benchmark's model and batch): " \
           "1.80 [1.70, 1.90] at N=2." in text
    assert f"{100 * TTAConfig.target:g}% accuracy on 2,000 test images" in text
    trust = text.split("## Can these numbers be trusted?")[1]
    assert "MLPerf-style epochs check: N=2" in trust and "**ok**" in trust
    # the table comes after the throughput table, before the trust section
    assert text.index("time-to-target speedup") < text.index("## Can these numbers")
    assert tta_markdown(block)[-1].startswith("- ")  # the notes (censored, failed) follow it


def _plan(*argv):
    from benchmarks.registry import Method
    from benchmarks.run import build_parser, plan_run

    def factory(ctx):
        return lambda: 0.0

    methods = {"ddp_spawn": Method("ddp_spawn", "d", factory),
               "independent": Method("independent", "d", factory)}
    return plan_run(build_parser().parse_args(list(argv)), methods)


def test_a_full_run_plans_time_to_accuracy_at_one_and_the_largest_n_and_flags_turn_it_off():
    from benchmarks.run import UsageError, tta_estimate_s

    plan = _plan("--nprocs", "1,2,4", "--rounds", "3")
    assert plan.tta_ns == [1, 4] and plan.cfg.tta and plan.cfg.tta_rounds == 3
    assert "2 time-to-accuracy launch(es) a round" in plan.text()
    without = _plan("--nprocs", "1,2,4", "--rounds", "3", "--no-tta")
    assert without.tta_ns == [] and not without.cfg.tta
    assert plan.planned_s == pytest.approx(without.planned_s + 3 * 2 * tta_estimate_s(plan.cfg))
    assert _plan("--nprocs", "1").tta_ns == []  # nothing to compare with
    assert _plan("--nprocs", "1,2", "--methods", "ddp_spawn").tta_ns == []
    asked = _plan("--nprocs", "1,2", "--methods", "ddp_spawn", "--tta-target", "0.5")
    assert asked.tta_ns == [1, 2] and asked.cfg.tta_target == 0.5
    assert _plan("--nprocs", "1,2", "--quick").cfg.tta_rounds == 3
    for bad in ("0", "1", "86", "-0.2"):
        with pytest.raises(UsageError, match="--tta-target is a test accuracy between 0 and 1"):
            _plan("--nprocs", "1,2", "--tta-target", bad)


# ------------------------------------------- lesson 11's sweep (batch_sweep.py, given code)


def _sweep_run(batch, seed, steps, rule="linear", reached=True, optimizer="sgd"):
    return {"batch": batch, "seed": seed, "rule": rule, "optimizer": optimizer, "lr": 0.02,
            "steps": steps, "samples": steps * batch, "epochs": steps * batch / 60000,
            "seconds": 1.0, "reached": reached, "accuracy": 0.85 if reached else 0.8}


def test_the_sweep_summary_gives_intervals_over_seeds_and_fits_only_runs_that_reached(
        monkeypatch):
    from tests.lessons import load

    bs = load("11_time_to_accuracy", "batch_sweep")
    runs = [_sweep_run(64, s, n) for s, n in enumerate((300, 320, 310))] + \
        [_sweep_run(1024, 0, 57), _sweep_run(1024, 1, 170), _sweep_run(1024, 2, 730, reached=False),
         _sweep_run(4096, 0, 146, rule="none", reached=False)]
    seen = []

    def fake_fit(batches, steps):  # the fit itself is task 11.9's, tested with the lesson
        seen.append(sorted(zip(batches, steps)))
        return 50.0, 400.0

    monkeypatch.setattr(bs, "critical_batch", fake_fit)
    s = bs.summarize(runs)
    rows = {(r["rule"], r["batch"]): r for r in s["rows"]}
    assert (rows["linear", 64]["steps"], rows["linear", 64]["steps_lo"],
            rows["linear", 64]["steps_hi"]) == pytest.approx(_geo_ci([300, 320, 310]))
    assert rows["linear", 1024]["reached"] == 2 and rows["linear", 1024]["seeds"] == 3
    # the missed run left out; two wide apart: the interval stays above zero
    assert (rows["linear", 1024]["steps"], rows["linear", 1024]["steps_lo"]) == pytest.approx(
        (math.sqrt(57 * 170), _geo_ci([57, 170])[1]))
    assert rows["linear", 1024]["steps_lo"] > 0  # a plain t-interval: 113 [-605, 832]
    assert rows["none", 4096]["reached"] == 0 and rows["none", 4096]["steps"] is None
    assert seen[0] == [(64, 300), (64, 310), (64, 320), (1024, 57), (1024, 170)]
    linear = next(f for f in s["critical"] if f["rule"] == "linear")
    assert (linear["s_min"], linear["b_crit"], linear["batches"]) == (50.0, 400.0, [64, 1024])
    table = bs.format_table(s)
    assert "B_crit = 400" in table and "0/1" in table

    def stub(batches, steps):
        raise NotImplementedError("Task 11.9: a straight line of steps against 1/B")

    monkeypatch.setattr(bs, "critical_batch", stub)
    assert "not fitted (Task 11.9: a straight line" in bs.format_table(bs.summarize(runs))


def test_the_sweeps_quick_run_keeps_the_flags_given_and_bad_flags_are_one_error():
    from tests.lessons import load

    bs = load("11_time_to_accuracy", "batch_sweep")
    quick = bs.parse(["--quick", "--seeds", "2"])
    assert (quick.seeds, quick.batches, quick.test_limit) == (2, [64, 256, 1024, 4096], 1000)
    assert bs.parse([]).seeds == 3
    jobs = bs.jobs_for(bs.parse(["--batches", "64", "1024", "--seeds", "2", "--optimizer",
                                 "sgd", "lamb"]))
    assert {(j["optimizer"], j["rule"]) for j in jobs} == {("sgd", "linear"), ("sgd", "none"),
                                                           ("lamb", "sqrt")}
    assert len(jobs) == 2 * 2 * 3 and jobs[0]["batch"] == 1024  # the longest runs first
    assert {j["base_lr"] for j in jobs if j["optimizer"] == "lamb"} == {0.005}
    for argv, message in ((["--target", "84"], "between 0 and 1"),
                          (["--batches", "64", "100000"], "larger than the 60000"),
                          (["--seeds", "0"], "at least 1"),
                          (["--max-epochs", "0"], "positive")):
        with pytest.raises(ValueError, match=message):
            bs.check(bs.parse(argv))
