"""The benchmark harness: files, failure handling, timeouts, intervals, the busy-machine
check and the cost model (never speed: this machine is shared)."""

import csv
import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks.analysis import BUSY, add_speedups, judge, machine_load, ratio_ci, read_proc_stat
from benchmarks.costmodel import RingModel, fit_ring
from tests.helpers import run_script
from tests.lessons import REPO

TINY = ["--batch-size", "8", "--steps", "2", "--repeats", "2", "--warmup", "1", "--no-sweep",
        "--rounds", "2"]


def _latest(out):
    """The results of the last good run under ``out`` (``out/latest`` -> ``out/<stamp>``)."""
    return json.loads((out / "latest" / "results.json").read_text())


def _why(rec: dict) -> str:
    """A record's status with its whole error text, for an assertion message."""
    return (f"{rec['method']} at N={rec['nprocs']}: {rec['status']}\n"
            f"{rec.get('detail') or rec.get('error') or '(no error text)'}")


def _bench(tmp_path, *args, timeout=240):
    """Run the harness CLI in a subprocess, as `make benchmark` does."""
    env = dict(os.environ, DPT_BENCH_EXTRA="tests.harness.bench_methods", MPLBACKEND="Agg",
               TQDM_DISABLE="1")
    return subprocess.run([sys.executable, "-m", "benchmarks.run", "--out", str(tmp_path),
                           *TINY, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_writes_json_csv_and_plots_into_its_own_folder(tmp_path):
    proc = _bench(tmp_path, "--methods", "ddp_no_buffer_broadcast", "--nprocs", "1,2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = [p for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink()]
    assert len(runs) == 1 and (tmp_path / "latest").resolve() == runs[0].resolve()
    result = _latest(tmp_path)
    assert result["machine"]["threads_per_rank"] == 1 and result["machine"]["cores"] >= 1
    assert "torch" in result["machine"] and "cpu_flags" in result["machine"]
    recs = {(r["method"], r["nprocs"]): r for r in result["records"]}
    # The control is added to a subset and timed in the same rounds.
    assert set(recs) == {(m, n) for m in ("independent", "ddp_no_buffer_broadcast") for n in (1, 2)}
    for r in recs.values():
        assert r["status"] == "ok", _why(r)
        for key in ("samples_per_s", "step_s", "peak_mem_mb", "final_loss", "speedup",
                    "efficiency", "threads_per_rank", "reliability", "flags"):
            assert key in r, key
        assert r["samples_per_s"] > 0 and r["step_s_min"] <= r["step_s"] <= r["step_s_max"]
        assert [x["round"] for x in r["rounds"]] == [0, 1]
        assert r["samples_per_s_lo"] <= r["samples_per_s"] <= r["samples_per_s_hi"]
        for x in r["rounds"]:  # the machine's load around every launch
            assert x["load"]["wall_s"] > 0 and "foreign_cores" in x["load"]
    for m in ("independent", "ddp_no_buffer_broadcast"):
        r = recs[(m, 2)]
        assert r["speedup_lo"] <= r["speedup"] <= r["speedup_hi"] and r["speedup_rounds"] == 2
    assert "comm_s" in recs[("ddp_no_buffer_broadcast", 2)]
    for r in recs.values():  # MFU: the model's FLOPs at the measured rate over the probe's peak
        assert r["compute_dtype"] == "fp32" and r["flops_seen"] == r["flops_per_step"] > 0
        assert r["mfu"] == pytest.approx(r["flops_per_sample"] * r["samples_per_s"]
                                         / (r["peak_tflops"] * 1e12 * r["nprocs"]))
    assert "measured peak, matmul probe" in result["mfu"]["peaks"]["fp32"]["label"]
    assert [c["nprocs"] for c in result["verdict"]["control"]] == [2]
    assert result["cost_model"]["bandwidth_Bps"] > 0
    run = tmp_path / "latest"
    rows = list(csv.DictReader((run / "results.csv").read_text().splitlines()))
    assert len(rows) == 4 and {"method", "nprocs", "samples_per_s", "speedup", "speedup_lo",
                               "speedup_hi", "reliability", "achieved_tflops", "mfu",
                               "peak_tflops"} <= set(rows[0])
    for png in ("speedup.png", "efficiency.png", "throughput.png", "memory.png",
                "step_split.png", "costmodel.png"):
        data = (run / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, png
    assert not (run / "scaling.png").exists()  # lines over N only beyond 2 devices
    summary = (run / "summary.md").read_text()
    assert "| independent | 2 | ok |" in summary and "Can these numbers be trusted?" in summary
    assert "| MFU |" in summary and "measured peak, matmul probe" in summary
    # The end of the run says in words whether the machine was busy.
    assert "control `independent`" in proc.stdout


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_time_to_accuracy_trains_n_1_and_n_2_to_the_target_in_flipped_rounds(tmp_path):
    from benchmarks.time_to_accuracy import VERDICTS

    proc = _bench(tmp_path, "--methods", "ddp_spawn", "--nprocs", "1,2", "--tta-target", "0.5")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = _latest(tmp_path)
    tta = result["time_to_accuracy"]
    assert tta["config"]["target"] == 0.5
    # round 1 launches N = 1 then N = 2, round 2 the other way round; seed = round
    assert [(r["round"], r["nprocs"]) for r in tta["runs"]] == [(0, 1), (0, 2), (1, 2), (1, 1)]
    for r in tta["runs"]:
        assert r["status"] == "ok" and r["reached"], r
        assert r["seed"] == r["round"] and r["global_batch"] == 64 * r["nprocs"]
        assert r["final_accuracy"] >= 0.5 and r["seconds"] > 0 and r["load"]["wall_s"] > 0
        # N ranks evaluate every 24 / N steps: the same samples between evaluations at every N
        assert r["steps"] % (24 // r["nprocs"]) == 0 and r["samples"] == r["steps"] * 64 * \
            r["nprocs"] and r["epochs"] == pytest.approx(r["samples"] / 60000)
    assert [r["lr"] for r in tta["runs"]][:2] == pytest.approx([0.02, 0.04])  # linear rule
    for b in tta["by_n"]:
        assert b["reached"] == b["rounds"] == 2
        assert b["seconds_lo"] <= b["seconds"] <= b["seconds_hi"]
    (sp,) = tta["speedup"]
    assert sp["nprocs"] == 2 and sp["rounds"] == 2 and sp["lo"] <= sp["value"] <= sp["hi"]
    assert tta["throughput_speedup"][0]["nprocs"] == 2
    assert tta["epochs_check"]["verdict"] in VERDICTS
    data = (tmp_path / "latest" / "time_to_accuracy.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    summary = (tmp_path / "latest" / "summary.md").read_text()
    assert "| 2 | 128 | 0.04 | 2/2 |" in summary and "MLPerf-style epochs check" in summary
    assert "time to accuracy N=2 round 2" in proc.stdout + proc.stderr  # progress per launch


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failing_and_a_hanging_method_are_recorded_and_the_sweep_goes_on(tmp_path):
    proc = _bench(tmp_path, "--methods", "broken,stuck,independent", "--nprocs", "1",
                  "--timeout", "15")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = {r["method"]: r for r in _latest(tmp_path)["records"]}
    assert recs["broken"]["status"] == "failed"
    assert "broken on purpose" in recs["broken"]["detail"]
    assert recs["stuck"]["status"] == "timeout"
    assert recs["independent"]["status"] == "ok"


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_and_lightning_methods_run_and_a_torchrun_failure_names_its_rank(tmp_path):
    # --min-repeat 0: the floor sizes each repeat from the measured step time, so two methods
    # would train different numbers of steps and their final losses could not be compared.
    proc = _bench(tmp_path, "--methods", "ddp_torchrun,lightning_ddp,ddp_spawn,broken_torchrun",
                  "--nprocs", "2", "--timeout", "120", "--rounds", "1", "--no-control",
                  "--min-repeat", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = {r["method"]: r for r in _latest(tmp_path)["records"]}
    for name in ("ddp_torchrun", "lightning_ddp", "ddp_spawn"):
        assert recs[name]["status"] == "ok", _why(recs[name])
        assert recs[name]["samples_per_s"] > 0 and "comm_s" in recs[name]
    # Same model, same start, same data, same optimizer: the launcher or the wrapper must not
    # change what is trained.
    assert recs["ddp_torchrun"]["final_loss"] == pytest.approx(recs["ddp_spawn"]["final_loss"],
                                                               rel=1e-4)
    assert recs["lightning_ddp"]["final_loss"] == pytest.approx(recs["ddp_spawn"]["final_loss"],
                                                                rel=1e-4)
    bad = recs["broken_torchrun"]
    assert bad["status"] == "failed" and "rank1" in bad["detail"]
    assert "broken on purpose under torchrun" in bad["error"]


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lesson07_speed_script_times_both_loops_and_its_diagnostic_removes_the_broadcast(
        tmp_path):
    """A smoke run of benchmarks/bench_l07_lightning_vs_raw.py (a few steps: not a measurement)."""
    proc = run_script(REPO / "benchmarks" / "bench_l07_lightning_vs_raw.py", "--repeats", "1",
                      "--steps", "6", "--sigterm-diagnostic", "--out", str(tmp_path),
                      timeout=280, env={"MPLBACKEND": "Agg"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "l07_lightning_vs_raw_sigterm.json").read_text())
    assert result["steps_per_rank"] == {"raw": 6, "lightning": 6, "lightning_nobcast": 6}
    # Lightning's per-step SIGTERM broadcast happens once per step; the diagnostic removes it.
    assert result["sigterm_broadcasts_per_epoch"] == {"lightning": 6, "lightning_nobcast": 0}
    med = result["median_step_ms"]
    assert set(med) == {"raw", "lightning", "lightning_nobcast"} and min(med.values()) > 0
    assert result["median_step_ratio"] == pytest.approx(med["raw"] / med["lightning"])
    assert len(result["paired_ratios"]) == 1
    png = (tmp_path / "l07_lightning_vs_raw_sigterm.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_with_no_success_keeps_the_previous_good_results(tmp_path):
    good = tmp_path / "20000101-000000"
    good.mkdir()
    (good / "results.json").write_text('{"good": true}')
    (tmp_path / "latest").symlink_to(good.name)
    proc = _bench(tmp_path, "--methods", "broken", "--nprocs", "1")
    assert proc.returncode == 1
    assert _latest(tmp_path) == {"good": True}
    assert "still points at the last good run" in proc.stderr


def test_a_slow_step_gets_fewer_timed_steps_and_every_rank_takes_the_same_number():
    from benchmarks.run import steps_within_budget

    # bf16 emulated on a CPU without avx512_bf16: 1.3 s a step, 6 asked, about 3 s a repeat
    assert steps_within_budget(1.3, 6, 3.0) == 2
    assert steps_within_budget(0.19, 6, 3.0) == 6  # fp32 on the same CPU: left alone
    assert steps_within_budget(0.7, 6, 3.0) == 4
    assert steps_within_budget(30.0, 6, 3.0) == 2  # never under 2 steps...
    assert steps_within_budget(30.0, 1, 3.0) == 1  # ...nor over what was asked
    assert steps_within_budget(1.3, 6, 0) == 6 and steps_within_budget(1.3, 6, None) == 6


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_ranks_agree_on_the_slowest_ranks_step_count_and_the_summary_says_so(tmp_path):
    # rank 0 steps in 0.05 s, rank 1 in 0.2 s: a 0.5 s budget allows rank 0 alone its 6 steps,
    # and 2 to rank 1, so at N=2 both ranks must take 2 (the slowest rank's count).
    proc = _bench(tmp_path, "--methods", "slow_step", "--nprocs", "1,2", "--no-control",
                  "--steps", "6", "--warmup", "2", "--rounds", "1", "--repeat-budget", "0.5")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = _latest(tmp_path)
    recs = {r["nprocs"]: r for r in result["records"]}
    assert all(r["status"] == "ok" for r in recs.values()), [_why(r) for r in recs.values()]
    assert recs[1]["rounds"][0]["timed_steps"] == [6] and recs[1]["timed_steps"] == 6
    assert recs[2]["rounds"][0]["timed_steps"] == [2, 2] and recs[2]["timed_steps"] == 2
    assert result["config"]["repeat_budget_s"] == 0.5
    summary = (tmp_path / "latest" / "summary.md").read_text()
    # The line that names the cut results (on a busy machine the verdict names both Ns too).
    cut = [line for line in summary.splitlines() if line.startswith("Slow steps")]
    assert len(cut) == 1 and "slow_step N=2: 2" in cut[0] and "slow_step N=1" not in cut[0], cut
    rows = list(csv.DictReader((tmp_path / "latest" / "results.csv").read_text().splitlines()))
    assert sorted(r["timed_steps"] for r in rows) == ["2", "6"]
    # A negative budget is refused in one line.
    bad = _bench(tmp_path, "--repeat-budget", "-1", timeout=60)
    assert bad.returncode == 2 and "--repeat-budget" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_bad_arguments_get_one_clear_line(tmp_path):
    proc = _bench(tmp_path, "--methods", "no_such_method", timeout=60)
    assert proc.returncode == 2 and "unknown method" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cost_model_matches_a_hand_computed_example():
    # alpha = 1 ms, 1 GB/s, 4 ranks, 1 MB of gradients, 10 ms of compute:
    # all-reduce = 1 ms + 2*3/4 * 1e6 / 1e9 s = 2.5 ms; step = 12.5 ms; speedup = 4*10/12.5.
    model = RingModel(alpha_s=1e-3, bandwidth_Bps=1e9)
    assert model.allreduce_s(4, 1e6) == pytest.approx(2.5e-3)
    assert model.allreduce_s(1, 1e6) == 0.0
    assert model.speedup(4, 10e-3, 1e6) == pytest.approx(3.2)
    assert model.efficiency(4, 10e-3, 1e6) == pytest.approx(0.8)


def test_fit_recovers_latency_and_bandwidth():
    truth = RingModel(alpha_s=50e-6, bandwidth_Bps=2e9)
    sizes = [2**k for k in range(10, 26, 3)]
    fitted = fit_ring(sizes, [truth.allreduce_s(2, s) for s in sizes], n=2)
    assert fitted.alpha_s == pytest.approx(50e-6, rel=1e-6)
    assert fitted.bandwidth_Bps == pytest.approx(2e9, rel=1e-6)
    with pytest.raises(ValueError):
        fit_ring([1, 2], [0.1, 0.1], n=1)


# ----------------------------------------------------------- intervals and a busy machine


def _rec(method, n, thr, foreign=0.0, sweep=None):
    """A record as the harness builds it, from synthetic per-round throughputs."""
    from benchmarks.analysis import summarize_record

    rec = {"method": method, "nprocs": n, "status": "ok", "rounds": [
        {"round": i, "status": "ok", "samples_per_s": t, "step_times": [64 * n / t],
         "load": {"wall_s": 1.0, "foreign_cores": foreign, "steal": 0.0, "load1": 0.5,
                  "cpus": 2}} for i, t in enumerate(thr)]}
    if sweep is not None:
        rec["sweep"] = sweep
    summarize_record(rec)
    return rec


def test_paired_ratio_interval_matches_a_hand_computed_t_interval():
    # Ratios 1.8, 2.0, 1.9 (paired by round): logs' mean m and sd s; 95% t with 2 df = 4.303.
    ci = ratio_ci([180.0, 210.0, 190.0], [100.0, 105.0, 100.0])
    logs = [math.log(1.8), math.log(2.0), math.log(1.9)]
    m = sum(logs) / 3
    s = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    assert ci["value"] == pytest.approx(math.exp(m))
    assert ci["lo"] == pytest.approx(math.exp(m - 4.303 * s / math.sqrt(3)))
    assert ci["hi"] == pytest.approx(math.exp(m + 4.303 * s / math.sqrt(3)))
    assert ci["n"] == 3 and ci["lo"] < ci["value"] < ci["hi"]


def test_mean_interval_is_a_t_interval_and_conservative_between_rows_of_the_table():
    from dpt.stats import mean_ci, t975

    m, lo, hi = mean_ci([1.0, 2.0, 3.0])  # mean 2, sd 1, 2 df: t = 4.303
    assert m == pytest.approx(2.0)
    assert (lo, hi) == (pytest.approx(2.0 - 4.303 / math.sqrt(3)),
                        pytest.approx(2.0 + 4.303 / math.sqrt(3)))
    assert mean_ci([5.0]) == (5.0, None, None)  # no interval from one value
    # 11 df lies between the table's rows 10 (2.228) and 12 (2.179); the exact quantile is
    # 2.201: the interval must not be narrower than that, so the row of 10 df is used
    assert t975(11) == pytest.approx(2.228) and t975(11) >= 2.201
    assert t975(40) == pytest.approx(2.021, abs=0.01)  # exact: 2.021
    with pytest.raises(ValueError, match="at least 2 samples"):
        t975(0)


def test_a_positive_interval_is_a_t_interval_on_logs_and_never_below_zero():
    from dpt.stats import mean_ci, positive_ci

    # comm_hooks.py --seeds 2 printed a step time of 5.192 [-27.843, 38.226] ms: two seeds,
    # 2.6 and 7.8 ms, and a plain t-interval with 1 degree of freedom (t = 12.706)
    times = [2.6, 7.784]
    assert mean_ci(times)[1] < 0  # the plain interval of a time goes below zero
    g, lo, hi = positive_ci(times)
    assert g == pytest.approx(math.sqrt(2.6 * 7.784))  # the geometric mean
    logs = [math.log(t) for t in times]
    _, log_lo, log_hi = mean_ci(logs)
    assert (lo, hi) == (pytest.approx(math.exp(log_lo)), pytest.approx(math.exp(log_hi)))
    assert 0 < lo < min(times) and max(times) < hi and lo * hi == pytest.approx(g * g)
    assert positive_ci([4.0]) == (4.0, None, None)
    assert positive_ci([3.0, 3.0, 3.0]) == (pytest.approx(3.0), pytest.approx(3.0),
                                            pytest.approx(3.0))
    for bad in ([1.0, 0.0], [2.0, -1.0], [1.0, float("nan")], []):
        with pytest.raises(ValueError):
            positive_ci(bad)


def test_pairing_cancels_a_drift_that_hits_both_sides_of_a_round():
    # The machine slows down 2x between rounds; within each round the speedup is exactly 1.9.
    one, two = [100.0, 50.0, 25.0], [190.0, 95.0, 47.5]
    ci = ratio_ci(two, one)
    assert ci["value"] == pytest.approx(1.9) and ci["hi"] - ci["lo"] == pytest.approx(0.0)
    single = ratio_ci([190.0], [100.0])
    assert single["value"] == pytest.approx(1.9) and single["lo"] is None  # no interval from one


def test_each_round_launches_every_method_once_in_a_new_order_and_flips_n():
    from benchmarks.run import round_schedule

    rounds = [round_schedule(15, r) for r in range(5)]
    for r, sched in enumerate(rounds):
        assert sorted(g for g, _ in sched) == list(range(15))  # every method, once
        assert all(flip == (r % 2 == 1) for _, flip in sched)  # N=1 first, then N=k first
    assert round_schedule(15, 3) == rounds[3]  # a rerun repeats the order
    # A disturbance that recurs at the same offset into every round must not land on the same
    # method each time (that biases one method and leaves its interval narrow).
    for pos in range(15):
        assert len({sched[pos][0] for sched in rounds}) > 1, f"position {pos} never moves"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs sched_setaffinity and 2 cores")
def test_each_rank_and_every_thread_it_has_are_pinned_to_a_core_of_its_own():
    from dpt.ranks import run_distributed
    from tests.harness import rank_fns

    ranks = run_distributed(rank_fns.pin_and_report, world_size=2, args=(1,), echo=False)
    allowed = sorted(os.sched_getaffinity(0))
    assert [r["cores"] for r in ranks] == [allowed[:1], allowed[1:2]]
    for r in ranks:  # gloo's threads (started before pinning) and one started after
        assert len(r["threads"]) > 2
        assert all(c == r["cores"] for c in r["threads"].values()), r["threads"]
    # More threads than the cores can take: nothing is pinned.
    ranks = run_distributed(rank_fns.pin_and_report, world_size=2, args=(len(allowed),),
                            echo=False)
    assert all(r["cores"] is None for r in ranks)
    assert all(c == allowed for r in ranks for c in r["threads"].values())


@pytest.mark.timeout(120)
def test_the_no_buffer_broadcast_method_turns_off_ddps_per_forward_broadcast_without_a_warning():
    from dpt.ranks import run_distributed
    from tests.harness import rank_fns

    plain = run_distributed(rank_fns.buffer_after_forward, world_size=2, args=(False,),
                            echo=False)
    assert plain[1]["mean"] < 100  # the check can fail: default DDP overwrites rank 1's mark
    kept = run_distributed(rank_fns.buffer_after_forward, world_size=2, args=(True,),
                           echo=False)
    assert kept[1]["mean"] > 100, "rank 0's buffers were broadcast at the forward"
    # torch 2.15 renamed broadcast_buffers: the method must use the name this torch has.
    assert not [w for r in kept for w in r["warnings"] if "deprecated" in w], kept


def test_speedups_pair_rounds_and_carry_their_intervals():
    recs = [_rec("independent", 1, [100, 102, 98]), _rec("independent", 2, [190, 196, 188]),
            _rec("ddp_spawn", 1, [90, 92, 91]), _rec("ddp_spawn", 2, [160, 170, 150]),
            _rec("ddp_spawn", 1, [300, 310, 305], sweep=32),
            _rec("ddp_spawn", 2, [400, 420, 390], sweep=32)]
    add_speedups(recs)
    ind2, ddp1, ddp2, sw2 = recs[1], recs[2], recs[3], recs[5]
    assert ddp1["speedup"] == 1.0 and ddp1["speedup_lo"] is None
    assert ddp2["speedup_vs"] == "ddp_spawn"  # its own N = 1, not the control's
    assert ddp2["speedup_lo"] < ddp2["speedup"] < ddp2["speedup_hi"]
    assert ddp2["efficiency"] == pytest.approx(ddp2["speedup"] / 2)
    assert ind2["speedup"] == pytest.approx(ratio_ci([190, 196, 188], [100, 102, 98])["value"])
    assert sw2["speedup"] == pytest.approx(ratio_ci([400, 420, 390], [300, 310, 305])["value"])
    verdict = judge(recs)
    assert not verdict["busy"] and all(r["reliability"] == "ok" for r in recs)
    assert "No sign of a busy machine" in verdict["messages"][-1]


def test_a_busy_control_flags_every_speedup_and_the_run_says_so():
    # The control reaches 1.2x of 2 (efficiency 0.6): other work was taking the cores.
    recs = [_rec("independent", 1, [100, 101, 99]), _rec("independent", 2, [120, 122, 118]),
            _rec("ddp_spawn", 1, [90, 91, 92]), _rec("ddp_spawn", 2, [150, 152, 149])]
    add_speedups(recs)
    verdict = judge(recs, control_floor=0.85)
    assert verdict["busy"] and verdict["control"][0]["short"]
    for r in recs:
        if r["nprocs"] == 2:
            assert r["reliability"] == BUSY and "control `independent`" in r["flags"][0]
        else:
            assert r["reliability"] == "ok"
    assert any("SHORT, the machine was busy" in m for m in verdict["messages"])
    assert any(BUSY in m and "ddp_spawn N=2" in m for m in verdict["messages"])


def test_a_speedup_above_ideal_beyond_its_interval_is_flagged():
    recs = [_rec("independent", 1, [100, 101, 99]), _rec("independent", 2, [190, 192, 189]),
            # N = 1 was slowed down in every round: 2.4x on 2 ranks, a tight interval.
            _rec("ddp_overlap", 1, [80, 81, 79]), _rec("ddp_overlap", 2, [192, 195, 190]),
            # Above 2 but within its (wide) interval: not flagged.
            _rec("ddp_naive", 1, [100, 60, 100]), _rec("ddp_naive", 2, [205, 190, 180])]
    add_speedups(recs)
    judge(recs)
    over = recs[3]
    assert over["speedup_lo"] > 2 and over["reliability"] == BUSY
    assert "above the ideal 2" in over["flags"][0]
    wide = recs[5]
    assert wide["speedup"] > 2 and wide["speedup_lo"] < 2 and wide["reliability"] == "ok"
    assert recs[1]["reliability"] == "ok"  # the control itself is fine


def test_other_processes_on_the_cpu_flag_a_result_and_its_speedup():
    recs = [_rec("independent", 1, [100, 101, 99]), _rec("independent", 2, [190, 192, 189]),
            _rec("ddp_spawn", 1, [90, 91, 92], foreign=1.2), _rec("ddp_spawn", 2, [170, 171, 172])]
    add_speedups(recs)
    judge(recs)
    assert recs[2]["reliability"] == BUSY and "1.20 cores" in recs[2]["flags"][0]
    assert recs[3]["reliability"] == BUSY and "N=1 run" in recs[3]["flags"][0]


def test_machine_load_separates_other_processes_from_ours():
    # 2 CPUs, 100 ticks/s, 1 s: 150 ticks busy (user+system), 10 stolen; ours used 0.5 s.
    before = {"t": 0.0, "stat": read_proc_stat("cpu 1000 0 500 5000 0 0 0 0"), "load1": 1.0}
    after = {"t": 1.0, "stat": read_proc_stat("cpu 1100 0 550 5040 0 0 0 10"), "load1": 2.0}
    load = machine_load(before, after, ours_cpu_s=0.5, hz=100)
    assert load["cpus"] == 2 and load["load1"] == 2.0
    assert load["foreign_cores"] == pytest.approx(1.0)
    assert load["steal"] == pytest.approx(10 / 200)
    assert read_proc_stat("intr 1 2 3") is None


def test_the_reference_results_carry_intervals_a_verdict_and_ddp_against_the_control():
    """The committed reference is a run with rounds: the README and notebook 10 show it."""
    from benchmarks.run import REFERENCE, summary_markdown

    result = json.loads((REFERENCE / "results.json").read_text())
    assert result["config"]["rounds"] >= 3 and result["verdict"]["messages"]
    text = summary_markdown(result)
    row = next(line for line in text.splitlines() if line.startswith("| ddp_spawn | 2 | ok |"))
    assert row.count("[") >= 2, row  # throughput and speedup, each with its interval
    assert "| ddp_spawn over independent | 2 |" in text
    assert "Can these numbers be trusted?" in text
    # Time to accuracy (lesson 11): the largest N against N = 1, with its interval, beside the
    # same runs' throughput speedup, and the epochs check's verdict.
    tta = result["time_to_accuracy"]
    nmax = max(result["config"]["nprocs"])
    speed = next(s for s in tta["speedup"] if s["nprocs"] == nmax)
    assert speed["lo"] is not None and speed["lo"] <= speed["value"] <= speed["hi"], speed
    assert speed["throughput"]["lo"] is not None, speed
    assert tta["epochs_check"], "no epochs check in the reference's time to accuracy"
    assert "Time to accuracy (" in text and "time-to-target speedup" in text
    # MFU (lesson 12): every timed row has achieved FLOP/s and MFU against a named peak.
    timed = [r for r in result["records"] if r["status"] == "ok" and "sweep" not in r]
    assert timed and all(r.get("mfu") for r in timed), [
        r["method"] for r in timed if not r.get("mfu")]
    assert result["mfu"].get("peaks"), result["mfu"]
    assert "MFU = achieved FLOP/s" in text
    # Every method registered then is in it: run or skipped, each with its reason.
    from benchmarks.registry import load_all

    lessons = {n for n, m in load_all().items() if m.factory.__module__.startswith("benchmarks.")}
    missing = lessons - {r["method"] for r in result["records"]}
    assert not missing, f"the reference predates these methods: {sorted(missing)}"
    assert all(r.get("error") for r in result["records"] if r["status"] == "skipped")


# ------------------------------------------------------- a run leaves tracked files alone


def test_runs_go_to_an_ignored_folder_and_the_reference_is_shown_until_there_is_one(tmp_path):
    from benchmarks.run import REFERENCE, RUNS, build_parser, latest_results

    assert build_parser().parse_args([]).out == RUNS
    probe = RUNS.relative_to(REPO) / "20990101-000000" / "results.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=REPO)
    assert ignored.returncode == 0, f"{probe} is not ignored by git"
    tracked = subprocess.run(["git", "ls-files", str(REFERENCE.relative_to(REPO))], cwd=REPO,
                             capture_output=True, text=True).stdout.split()
    assert "benchmarks/reference/results.json" in tracked
    path, what = latest_results(tmp_path / "runs", REFERENCE)
    assert path == REFERENCE / "results.json" and "reference" in what
    run = tmp_path / "runs" / "20990101-000000"
    run.mkdir(parents=True)
    (run / "results.json").write_text("{}")
    (tmp_path / "runs" / "latest").symlink_to(run.name)
    assert latest_results(tmp_path / "runs", REFERENCE) == ((run / "results.json").resolve(),
                                                              "your latest run")


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_tiny_run_writes_only_under_out_and_leaves_git_status_alone(tmp_path):
    def state():
        """Changes to the committed results, and files git would list as new."""
        git = ["git", "-c", "core.quotepath=off"]
        changed = subprocess.run([*git, "status", "--porcelain", "--", "benchmarks/reference",
                                  "benchmarks/reference/lessons"], cwd=REPO, capture_output=True,
                                 text=True).stdout
        new = subprocess.run([*git, "ls-files", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True).stdout
        return changed, new

    before = state()
    proc = _bench(tmp_path, "--methods", "independent", "--nprocs", "1", "--rounds", "1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "latest" / "results.json").is_file()
    assert state() == before


@pytest.mark.timeout(120)
def test_plots_draw_lines_over_n_only_beyond_two_devices(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from benchmarks.run import make_plots

    def result(ns):
        recs = [_rec(m, n, [100.0 * n * f, 98.0 * n * f, 101.0 * n * f])
                for m, f in (("independent", 1.0), ("ddp_spawn", 0.9)) for n in ns]
        for r in recs:
            r.update(peak_mem_mb=100.0, mem_kind="process peak RSS", per_rank_batch=64)
        add_speedups(recs)
        return {"machine": {"label": "test"}, "config": {"rounds": 3}, "records": recs,
                "verdict": judge(recs)}

    four, two = tmp_path / "four", tmp_path / "two"
    four.mkdir()
    two.mkdir()
    assert {p.name for p in make_plots(result([1, 2, 4]), four)} >= {
        "speedup.png", "efficiency.png", "throughput.png", "memory.png", "scaling.png"}
    names = {p.name for p in make_plots(result([1, 2]), two)}
    assert "speedup.png" in names and "scaling.png" not in names


# ------------------------------------------- torchrun: a failure names its rank and signal

# The end of torchrun's report when a rank aborted (seen in a benchmark run, 2026-11-23).
TORCHRUN_ABORT_LOG = """terminate called without an active exception
E1123 23:47:24.987000 15384 torch/distributed/elastic/multiprocessing/api.py:1002] failed
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
benchmarks.torchrun_worker FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_23:47:24
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 15389)  (SIGTERM)
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_23:47:24
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 15388)  (SIGABRT)
  error_file: <N/A>
=======================================================
"""


def test_a_torchrun_failure_is_named_by_its_root_cause_not_a_line_of_equals_signs(tmp_path):
    from benchmarks.run import torchrun_results
    from dpt.ranks import RankFailure

    (tmp_path / "rank1.json").write_text(json.dumps({"rank": 1}))  # rank 0 wrote nothing
    with pytest.raises(RankFailure) as info:
        torchrun_results(tmp_path, 2, -6, TORCHRUN_ABORT_LOG)
    last = str(info.value).strip().splitlines()[-1]  # what the record's `error` shows
    assert "rank 0 died with SIGABRT" in last, last
    assert "terminate called without an active exception" in last, last
    assert "=====" not in last


def test_a_rank_that_crashes_after_writing_its_results_keeps_the_round_with_a_note(tmp_path):
    from benchmarks.run import torchrun_results

    for r in range(2):
        (tmp_path / f"rank{r}.json").write_text(json.dumps({"rank": r}))
    ranks = torchrun_results(tmp_path, 2, -6, TORCHRUN_ABORT_LOG)
    assert [r["rank"] for r in ranks] == [0, 1]
    (note,) = ranks[0]["notes"]
    assert "rank 0 died with SIGABRT" in note and "at exit" in note
    assert torchrun_results(tmp_path, 2, 0, "")[0].get("notes") is None  # a clean exit: none


# ------------------------------------------------------ do two runs agree? (benchmarks.compare)


def _run(*recs):
    return {"stamp": "x", "records": [
        {"method": m, "nprocs": 2, "speedup": v, "speedup_lo": lo, "speedup_hi": hi,
         "reliability": BUSY if busy else "ok", "flags": ["the hypervisor stole 40%"] if busy
         else []} for m, v, lo, hi, busy in recs]}


def test_compare_counts_overlapping_intervals_and_leaves_busy_results_out(tmp_path, capsys):
    from benchmarks.compare import compare, main

    a = _run(("ddp", 1.7, 1.6, 1.8, False), ("fsdp", 1.5, 1.4, 1.6, False),
             ("naive", 1.6, 1.5, 1.7, False))
    b = _run(("ddp", 1.75, 1.7, 1.9, False), ("fsdp", 1.8, 1.7, 1.9, False),
             ("naive", 1.2, 1.0, 1.3, True))
    rows = {r["method"]: r for r in compare(a, b)}
    assert rows["ddp"]["overlap"] is True
    assert rows["fsdp"]["overlap"] is False  # [1.4, 1.6] against [1.7, 1.9]
    assert rows["naive"]["overlap"] is None and rows["naive"]["raw_overlap"] is False
    for name, run in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(run))
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1  # fsdp disagrees
    out = capsys.readouterr().out
    assert "**disagree**" in out and "not counted (busy" in out
    assert "1 of 2 comparable results agree" in out
    assert main([str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    with pytest.raises(SystemExit) as bad:
        main([str(tmp_path / "missing"), str(tmp_path / "a")])
    assert bad.value.code == 2 and "error: cannot read" in capsys.readouterr().err


def _rounds_run(stamp, **ratios):
    """A run whose method m ran at N=1 at 100 samples/s and at N=2 at 100 x ratio in each
    round; a method named ``busy_*`` is marked busy at N=2."""
    from benchmarks.analysis import add_speedups

    recs = []
    for m, rs in ratios.items():
        for n, thr in ((1, [100.0] * len(rs)), (2, [100.0 * x for x in rs])):
            recs.append({"method": m, "nprocs": n, "status": "ok", "samples_per_s": thr[0],
                         "rounds": [{"round": i, "status": "ok", "samples_per_s": t}
                                    for i, t in enumerate(thr)],
                         "reliability": BUSY if n == 2 and m.startswith("busy") else "ok"})
    add_speedups(recs)
    return {"stamp": stamp, "records": recs}


def test_pooling_runs_takes_every_round_of_every_run_and_leaves_busy_ones_out(tmp_path, capsys):
    from benchmarks.compare import main, pool

    a = _rounds_run("A", ddp=[1.8, 1.9, 2.0], busy_naive=[2.5, 2.6])
    b = _rounds_run("B", ddp=[1.7, 1.75], busy_naive=[1.6, 1.7])
    rows = {r["method"]: r for r in pool([a, b])}
    want = ratio_ci([180.0, 190.0, 200.0, 170.0, 175.0], [100.0] * 5)
    assert rows["ddp"]["rounds"] == 5
    assert rows["ddp"]["speedup"] == pytest.approx(want["value"])
    assert (rows["ddp"]["lo"], rows["ddp"]["hi"]) == pytest.approx((want["lo"], want["hi"]))
    # Rounds weigh alike, so the pool is not the mean of the two runs' own speedups.
    own = [next(r["speedup"] for r in run["records"] if r["method"] == "ddp" and r["nprocs"] == 2)
           for run in (a, b)]
    assert len(rows["ddp"]["runs"]) == 2
    assert rows["ddp"]["speedup"] != pytest.approx(sum(own) / 2, abs=1e-3)
    assert rows["busy_naive"]["rounds"] == 0 and rows["busy_naive"]["left_out"] == ["A", "B"]
    for name, run in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(run))
    assert main(["--pool", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "Pooled over 2 runs" in out and "left out (busy): A, B" in out
    line = next(x for x in out.splitlines() if x.startswith("| ddp |"))
    assert "| 5 |" in line
    # Comparing (not pooling) still takes exactly two runs, and says so in one line.
    with pytest.raises(SystemExit) as bad:
        main([str(tmp_path / "a")])
    assert bad.value.code == 2 and "comparing takes two runs" in capsys.readouterr().err


# ------------------------------------------- GPU machines, faked on the CPU (monkeypatch)


def _fake_gpus(monkeypatch, count: int, backend: str | None = None, share: bool = False):
    """This process sees ``count`` CUDA GPUs; DPT_TEST_BACKEND and DPT_SHARE_GPU as given."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if backend is None:
        monkeypatch.delenv("DPT_TEST_BACKEND", raising=False)
    else:
        monkeypatch.setenv("DPT_TEST_BACKEND", backend)
    if share:
        monkeypatch.setenv("DPT_SHARE_GPU", "1")
    else:
        monkeypatch.delenv("DPT_SHARE_GPU", raising=False)


def test_the_suites_gloo_runs_every_n_on_the_cpu_of_a_one_gpu_machine(monkeypatch):
    from benchmarks.registry import load_all
    from benchmarks.run import skip_reason

    methods = load_all()
    _fake_gpus(monkeypatch, 1, backend="gloo")  # what tests/conftest.py sets, on one GPU
    assert skip_reason(methods["ddp_spawn"], 2) is None, (
        "the suite forces gloo on the CPU, yet N=2 is refused for the GPU count: "
        + str(skip_reason(methods["ddp_spawn"], 2)))
    from benchmarks.run import default_nprocs, rank_placement
    from dpt.dist import cpu_budget

    assert rank_placement(2) == ("gloo", "cpu")
    assert len(default_nprocs()) == cpu_budget().bit_length()  # 1, 2, 4, ... up to the cores
    # A CUDA-only method is skipped: its ranks would be on the CPU.
    assert "needs a CUDA GPU" in skip_reason(methods["amp_fp16"], 1)
    # Without the suite's override, NCCL takes one rank per GPU: N=2 is refused in one line.
    _fake_gpus(monkeypatch, 1)
    assert rank_placement(2) == ("nccl", "cuda")
    assert "N=2 exceeds the 1 GPUs" in skip_reason(methods["ddp_spawn"], 2)
    assert skip_reason(methods["ddp_spawn"], 1) is None and default_nprocs() == [1]


def test_ranks_sharing_one_gpu_run_at_n_2_and_4_with_gloo_on_it(monkeypatch):
    from benchmarks.registry import load_all
    from benchmarks.run import skip_reason

    methods = load_all()
    _fake_gpus(monkeypatch, 1, share=True)
    assert skip_reason(methods["ddp_spawn"], 4) is None, skip_reason(methods["ddp_spawn"], 4)
    from benchmarks.run import default_nprocs, rank_placement

    assert rank_placement(4) == ("gloo", "cuda")
    assert default_nprocs() == [1, 2, 4] and default_nprocs(quick=True) == [1, 4]
    assert skip_reason(methods["amp_fp16"], 2) is None  # the ranks are on the GPU
    assert "needs 2 CUDA GPUs" in skip_reason(methods["dp"], 1)
    _fake_gpus(monkeypatch, 1, backend="gloo", share=True)  # the suite's gloo, GPU shared
    assert rank_placement(2) == ("gloo", "cuda")


def _run_worker(monkeypatch, tmp_path) -> tuple[dict, list]:
    """benchmarks.torchrun_worker in this process as rank 0 of 2, every step spied on."""
    import torch

    import benchmarks.run
    import dpt.dist
    from benchmarks import torchrun_worker

    (tmp_path / "config.json").write_text(json.dumps({"threads_per_rank": 1, "timeout": 60}))
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    joined, events = {}, []
    result_file = tmp_path / "rank0.json"

    def setup(*args, **kwargs):
        joined.update(kwargs)
        events.append("setup")
        return torch.device("cpu")

    def bench_rank(rank, world_size, name, cfg):
        events.append("bench")
        return {"rank": rank}

    def exit_(code):
        events.append(f"exit {code}")
        raise SystemExit(code)

    monkeypatch.setattr(dpt.dist, "setup", setup)
    monkeypatch.setattr(dpt.dist, "barrier", lambda: events.append(
        "barrier, result written" if result_file.exists() else "barrier, no result yet"))
    monkeypatch.setattr(dpt.dist, "cleanup", lambda: events.append("destroy"))
    monkeypatch.setattr(benchmarks.run, "bench_rank", bench_rank)
    monkeypatch.setattr(os, "_exit", exit_)
    try:
        torchrun_worker.main(["independent", str(tmp_path)])
    except SystemExit:
        pass
    return joined, events


def test_the_torchrun_worker_joins_where_the_spawned_ranks_do_then_leaves_in_order(
        monkeypatch, tmp_path):
    from dpt.device import backend_for, pick_device

    _fake_gpus(monkeypatch, 2, backend="gloo")
    joined, events = _run_worker(monkeypatch, tmp_path)
    device = pick_device(joined.get("device", "auto"), distributed=True)
    assert device.type == "cpu", (
        f"the torchrun worker joins on {device} ({backend_for(device)}) while "
        "DPT_TEST_BACKEND=gloo puts the spawned ranks (ddp_spawn) on the CPU")
    # Result on disk, a barrier (no peer still talking), the group destroyed, then os._exit
    # (no interpreter teardown with gloo's threads alive).
    assert events == ["setup", "bench", "barrier, result written", "destroy", "exit 0"], events
    # Ranks sharing a GPU: the worker joins on it, with gloo.
    _fake_gpus(monkeypatch, 1, share=True)
    joined, _ = _run_worker(monkeypatch, tmp_path)
    assert joined["device"] == "cuda" and backend_for(pick_device("cuda")) == "gloo"


def test_a_fast_step_is_repeated_until_a_repeat_times_enough_work(monkeypatch):
    import statistics
    from dataclasses import asdict

    from benchmarks.run import Config, bench_rank, steps_within_budget

    monkeypatch.setenv("DPT_BENCH_EXTRA", "tests.harness.bench_methods")
    # A GPU step of about 1 ms: 6 steps time 6 ms, which the clock's noise swamps.
    cfg = asdict(Config(steps=6, repeats=2, warmup=3, pin=False))
    out = bench_rank(0, 1, "fast_step", cfg)
    per_repeat = out["steps"] * statistics.median(out["step_times"])
    # The count is planned from the warm-up's steps, which a loaded machine stretches (a 1 ms
    # sleep can take 3-5): so check the steps taken, far more than the 6 asked, rather than
    # the time the (faster) timed steps then add up to.
    assert out["steps"] >= 18, (
        f"a repeat took {out['steps']} steps ({1000 * per_repeat:.1f} ms of work): a 1 ms "
        "step must be repeated until a repeat times about 0.1 s")
    assert steps_within_budget(0.0015, 6, 3.0, floor_s=0.1) == 67
    # A CPU step (tens of ms and more) keeps the steps asked for, and the cut of a slow one.
    assert steps_within_budget(0.19, 6, 3.0, floor_s=0.1) == 6
    assert steps_within_budget(1.3, 6, 3.0, floor_s=0.1) == 2
    assert steps_within_budget(0.001, 6, 0.05, floor_s=0.1) == 50  # never past the budget


@pytest.mark.tools
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_one_device_projects_n_gpus_onto_a_named_interconnect_and_says_so(tmp_path):
    # One device (one GPU, or N=1 only): no all-reduce to time, as `make benchmark` on Colab.
    proc = _bench(tmp_path, "--methods", "ddp_spawn", "--nprocs", "1", "--rounds", "1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = _latest(tmp_path)
    cm = result.get("cost_model")
    assert cm, "no cost model in the results of a one-device run"
    from benchmarks.costmodel import PRESETS, default_interconnect
    from benchmarks.run import Config, cost_model_of

    preset = default_interconnect(result["machine"]["cuda_devices"])
    assert cm["source"] == "projection" and cm["preset"] == preset
    link = PRESETS[preset]
    assert cm["bandwidth_Bps"] == link.bandwidth_GBps * 1e9
    assert cm["alpha_s"] == pytest.approx(link.latency_us * 1e-6)
    c, b, a, bw = cm["compute_s"], cm["grad_bytes"], cm["alpha_s"], cm["bandwidth_Bps"]
    for n in (2, 4, 8):  # weak scaling: N * c / (c + alpha + 2 (N-1)/N * bytes / bandwidth)
        want = n * c / (c + a + 2 * (n - 1) / n * b / bw)
        assert cm["predicted_speedup"][str(n)] == pytest.approx(want)
    summary = (tmp_path / "latest" / "summary.md").read_text()
    assert "PROJECTED, not measured" in summary and link.label in summary
    # --interconnect chooses the preset, even where a curve was measured
    chosen = cost_model_of([(4096, 1e-4), (2**20, 1e-3)], 2, result["records"], Config(),
                           result["machine"], "nvlink3", {})
    assert chosen["source"] == "projection" and chosen["preset"] == "nvlink3"
    assert chosen["bandwidth_Bps"] == PRESETS["nvlink3"].bandwidth_GBps * 1e9
    measured = cost_model_of([(4096, 1e-4), (2**20, 1e-3)], 2, result["records"], Config(),
                             result["machine"], None, {})
    assert measured["source"] == "measured" and measured["fit_nprocs"] == 2


def test_the_default_projection_follows_the_gpus_name():
    from benchmarks.costmodel import default_interconnect

    assert default_interconnect(["NVIDIA H100 80GB HBM3"]) == "nvlink4"
    assert default_interconnect(["NVIDIA A100-SXM4-40GB"]) == "nvlink3"
    assert default_interconnect(["NVIDIA H100 PCIe"]) == "pcie5x16"
    assert default_interconnect(["Tesla T4"]) == default_interconnect([]) == "pcie4x16"


def test_the_strong_scaling_cost_model_splits_the_batch_and_the_plot_draws_it(
        tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from benchmarks.run import make_plots

    drawn = {}
    plot = Axes.plot

    def spy(self, *args, **kwargs):
        if len(args) >= 2:
            drawn[kwargs.get("label")] = list(args[1])
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    # lesson 12's crossover beside it: real models only (counting the course's models' FLOPs
    # takes seconds; tests/harness/test_costmodel_crossover.py tests that panel)
    import functools

    from benchmarks import costmodel, run

    monkeypatch.setattr(run, "crossover_from_lesson", functools.partial(
        costmodel.crossover_from_lesson, course_models=False))
    recs = [_rec("ddp_spawn", n, [100.0 * n, 98.0 * n, 101.0 * n]) for n in (1, 2)]
    for r in recs:
        r.update(peak_mem_mb=100.0, mem_kind="process peak RSS", per_rank_batch=64 // r["nprocs"])
    add_speedups(recs)
    # alpha 1 ms, 1 GB/s, 1 MB of gradients, 10 ms of compute for the whole global batch
    cm = {"alpha_s": 1e-3, "bandwidth_Bps": 1e9, "compute_s": 10e-3, "grad_bytes": 1e6,
          "fit_nprocs": 2, "compute_from": "ddp_spawn", "projections": {}}
    result = {"machine": {"label": "test"}, "config": {"rounds": 3, "scaling": "strong"},
              "records": recs, "verdict": judge(recs), "cost_model": cm}
    ns = (1, 2, 4, 8)
    make_plots(result, tmp_path, project_ns=ns)
    (line,) = [y for label, y in drawn.items() if label and label.startswith("predicted, this")]
    # strong: each rank computes 10/N ms; speedup = 10 / (10/N + all-reduce(N)) (ms)
    want = [10 / (10 / n + (0 if n == 1 else 1 + 2 * (n - 1) / n * 1)) for n in ns]
    assert line == pytest.approx(want), f"plotted {line}, strong scaling gives {want}"
    # at N=4: 10/4 + 1 + 1.5 = 5 ms a step for the same global batch: 2x
    assert RingModel(1e-3, 1e9).speedup(4, 10e-3, 1e6, strong=True) == pytest.approx(2.0)


class _VirtualClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _fake_launch(clock, spawn_s, torchrun_s):
    """A launch that costs ``spawn_s``/``torchrun_s`` of virtual time and returns a result
    shaped as benchmarks.run.launch's."""
    from benchmarks.registry import load_all

    methods = load_all()

    def launch(name, n, cfg, methods_=None, round_no=0):
        cost = torchrun_s if methods[name].launcher == "torchrun" else spawn_s
        clock.t += cost
        step = 0.002 * (1.05 if n > 1 else 1.0)
        return {"round": round_no, "status": "ok", "wall_s": cost, "per_rank_batch": 128,
                "step_times": [step], "timed_steps": [50] * n,
                "samples_per_s": 128 * n / step, "peak_mem_mb": 100.0,
                "mem_kind": "cuda max_memory_allocated", "peak_mem_mb_devices": {},
                "final_loss": 2.3, "threads": 1, "cores": [None] * n,
                "load": {"wall_s": cost, "foreign_cores": 0.0, "steal": 0.0, "load1": 0.1,
                         "cpus": 16}}

    return launch


def test_quick_leaves_out_full_run_methods_unless_named():
    """Methods registered with quick=False are in the full run and in --list, not in --quick,
    except when --methods names them."""
    from benchmarks.registry import Method
    from benchmarks.run import build_parser, plan_run

    def factory(ctx):
        return lambda: 0.0

    methods = {"fast": Method("fast", "d", factory), "slow": Method("slow", "d", factory,
                                                                     quick=False)}
    def plan(*argv):
        return plan_run(build_parser().parse_args([*argv, "--nprocs", "1"]), methods)
    assert plan("--quick").names == ["fast"]
    assert plan().names == ["fast", "slow"]
    assert plan("--quick", "--methods", "slow").names == ["slow"]


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_bf16_methods_are_left_out_where_a_cpu_emulates_bf16_unless_named(monkeypatch,
                                                                          fast_bf16):
    """On a CPU without bf16 instructions a bf16 method times the emulation (lesson 09's FSDP
    took 25 s a step on an AVX2 host): the default run skips it with that reason; --methods
    runs it and says so in its record. A CPU with AVX512-BF16 or AMX runs it by default."""
    import dpt.precision
    from benchmarks.registry import load_all
    from benchmarks.run import build_parser, plan_run, skip_reason

    methods = load_all()
    _fake_gpus(monkeypatch, 0)
    monkeypatch.setattr(dpt.precision, "cpu_has_fast_bf16", lambda: fast_bf16)
    bf16 = ["amp_bf16", "fsdp_by_hand_bf16", "fsdp2_bf16"]
    for name in bf16:
        why = skip_reason(methods[name], 2)
        assert (why is None) == fast_bf16, (name, why)
        if not fast_bf16:
            assert "emulated" in why and "--methods" in why
        assert skip_reason(methods[name], 2, named=True) is None
    # fp32 methods and the bf16 *compression* hook (a cast, no bf16 arithmetic) are unaffected
    for name in ("ddp_spawn", "ddp_bf16_hook", "fsdp2"):
        assert skip_reason(methods[name], 2) is None, name

    def records(*argv):
        plan = plan_run(build_parser().parse_args([*argv, "--nprocs", "1,2", "--no-tta"]),
                        methods)
        return {(r["method"], r["nprocs"]): r for r in plan.records}

    default = records()
    named = records("--methods", "amp_bf16,ddp_spawn")
    for n in (1, 2):
        assert (default["amp_bf16", n]["status"] == "skipped") != fast_bf16
        assert named["amp_bf16", n]["status"] == "ok"
        assert any("emulated" in x for x in named["amp_bf16", n].get("notes", [])) != fast_bf16
        assert "notes" not in named["ddp_spawn", n]


def test_a_figure_flags_busy_results_only_when_it_draws_one():
    """costmodel.png draws ddp_spawn and the control only: a busy result elsewhere in the run
    must not mark its measured points unreliable (the other figures hatch their busy bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.analysis import BUSY
    from benchmarks.run import _busy_note

    result = {"verdict": {"busy": ["ddp_adam N=2"]}}
    ok, busy = {"method": "ddp_spawn"}, {"method": "ddp_spawn", "reliability": BUSY}
    for shown, flagged in ((None, True), ([ok], False), ([ok, busy], True)):
        fig = plt.figure()
        _busy_note(fig, result, "measured points", shown)
        assert any(BUSY in t.get_text() for t in fig.texts) == flagged, shown
        plt.close(fig)


def test_list_marks_full_run_methods(capsys):
    from benchmarks.run import load_all, main

    slow = [m.name for m in load_all().values() if not m.quick]
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in slow:
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert "not in --quick" in line


@pytest.mark.timeout(240)
@pytest.mark.parametrize("slowdown", [1, 3])
def test_quick_on_an_8_gpu_machine_plans_and_keeps_under_5_minutes(
        monkeypatch, tmp_path, capsys, slowdown):
    """QUICK=1 runs in gpu_check under a 900 s limit; on 8 GPUs it must end within 5 minutes,
    even when every launch costs 3x what was planned."""
    import benchmarks.run as run
    import dpt.ranks

    _fake_gpus(monkeypatch, 8)
    clock = _VirtualClock()
    spawn_s, torchrun_s = 5.0 * slowdown, 12.0 * slowdown  # a GPU launch, start-up included

    def curve(fn, world_size, args=(), **kw):
        clock.t += 10.0 * slowdown
        return [[(s, 2e-5 + s / 100e9) for s in args[0]]] * world_size

    monkeypatch.setattr(run, "_clock", clock, raising=False)
    monkeypatch.setattr(run, "launch", _fake_launch(clock, spawn_s, torchrun_s))
    monkeypatch.setattr(run, "machine_info", lambda *a, **k: {
        "label": "8 GPU(s), NCCL (faked)", "cpu": "test", "torch": "test", "cores": 16,
        "cuda_devices": ["NVIDIA H100 80GB HBM3"] * 8})
    monkeypatch.setattr(dpt.ranks, "run_distributed", curve)
    monkeypatch.setattr(dpt.ranks, "restart_fork_server", lambda: True)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    # every method of the quick run (the lessons' own, not this suite's, which other tests load)
    real = [m.name for m in run.load_all().values()
            if m.factory.__module__.startswith("benchmarks.") and m.quick]
    start = clock.t
    assert run.main(["--quick", "--out", str(tmp_path), "--methods", ",".join(real)]) == 0
    took = clock.t - start
    out = capsys.readouterr()
    assert took <= 300, f"--quick on 8 GPUs took {took:.0f} s of launches"
    result = _latest(tmp_path)
    assert result["config"]["nprocs"] == [1, 8]
    assert "plan:" in out.out and "min" in out.out.split("plan:")[1].splitlines()[0]
    assert result["config"]["planned_s"] <= 300
    recs = result["records"]
    assert not [r for r in recs if r["status"] in ("failed", "timeout")]
    if slowdown == 1:  # as planned: every method that can run here ran
        assert all(r["status"] == "ok" or "time budget" not in r.get("error", "")
                   for r in recs), [r["error"] for r in recs if r["status"] != "ok"]
    else:  # three times slower: launches stop at the budget, and the records say why
        assert any("time budget" in r.get("error", "") for r in recs)
        assert "time budget" in out.err
    assert result["cost_model"]["source"] == "measured"


def test_a_round_of_h_inner_steps_is_timed_per_inner_step_and_its_sync_is_the_difference(
        monkeypatch):
    """Lesson 13's methods time a round (H optimizer steps, then one sync) per call: a step
    time per call would make LocalSGD at H = 8 look 8 times slower than DDP."""
    import types
    from dataclasses import asdict

    import benchmarks.run
    from benchmarks.run import Config, bench_rank
    from tests.harness import bench_methods

    monkeypatch.setenv("DPT_BENCH_EXTRA", "tests.harness.bench_methods")
    clock = bench_methods.CLOCK
    monkeypatch.setattr(benchmarks.run, "time",
                        types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cfg = asdict(Config(steps=6, repeats=2, warmup=2, pin=False, min_repeat_s=0.0))
    out = bench_rank(0, 1, "round_of_4", cfg)
    # A round on the fake clock: 4 inner steps of 1 s, then a sync of 2 s
    assert out["step_times"] == [1.5, 1.5], (
        f"step times {out['step_times']}: a call of a method with extras['inner_steps'] = 4 "
        "is 4 optimizer steps; divide its time by 4 (6 s a round / 4 = 1.5 s a step)")
    assert out["compute_s"] == 1.0 and out["inner_steps"] == 4, (
        f"compute {out.get('compute_s')} s, inner_steps {out.get('inner_steps')}: the round "
        "without its sync is 4 s, 1 s a step, and the record says it timed rounds of 4")
    with pytest.raises(ValueError, match=r"inner_steps.*whole number"):
        bench_rank(0, 1, "bad_inner_steps", cfg)
