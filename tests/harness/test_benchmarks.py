"""The benchmark harness: files, failure handling, timeouts and the cost model (not speed)."""

import csv
import json
import os
import subprocess
import sys

import pytest

from benchmarks.costmodel import RingModel, fit_ring
from tests.helpers import run_script
from tests.lessons import REPO

TINY = ["--batch-size", "8", "--steps", "2", "--repeats", "2", "--warmup", "1", "--no-sweep"]


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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_writes_json_csv_and_plots(tmp_path):
    proc = _bench(tmp_path, "--methods", "independent,ddp_no_buffer_broadcast", "--nprocs", "1,2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "latest.json").read_text())
    assert result["machine"]["threads_per_rank"] == 1 and result["machine"]["cores"] >= 1
    assert "torch" in result["machine"] and "cpu_flags" in result["machine"]
    recs = {(r["method"], r["nprocs"]): r for r in result["records"]}
    assert set(recs) == {(m, n) for m in ("independent", "ddp_no_buffer_broadcast") for n in (1, 2)}
    for r in recs.values():
        assert r["status"] == "ok", _why(r)
        for key in ("samples_per_s", "step_s", "peak_mem_mb", "final_loss", "speedup",
                    "efficiency", "threads_per_rank"):
            assert key in r, key
        assert r["samples_per_s"] > 0 and r["step_s_min"] <= r["step_s"] <= r["step_s_max"]
    assert "comm_s" in recs[("ddp_no_buffer_broadcast", 2)]
    assert result["cost_model"]["bandwidth_Bps"] > 0
    rows = list(csv.DictReader(open(tmp_path / "latest.csv")))
    assert len(rows) == 4 and {"method", "nprocs", "samples_per_s", "speedup"} <= set(rows[0])
    for png in ("speedup.png", "efficiency.png", "throughput.png", "memory.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, png
    assert "| independent | 2 | ok |" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failing_and_a_hanging_method_are_recorded_and_the_sweep_goes_on(tmp_path):
    proc = _bench(tmp_path, "--methods", "broken,stuck,independent", "--nprocs", "1",
                  "--timeout", "15")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = {r["method"]: r for r in json.loads((tmp_path / "latest.json").read_text())["records"]}
    assert recs["broken"]["status"] == "failed"
    assert "broken on purpose" in recs["broken"]["detail"]
    assert recs["stuck"]["status"] == "timeout"
    assert recs["independent"]["status"] == "ok"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_and_lightning_methods_run_and_a_torchrun_failure_names_its_rank(tmp_path):
    proc = _bench(tmp_path, "--methods", "ddp_torchrun,lightning_ddp,ddp_spawn,broken_torchrun",
                  "--nprocs", "2", "--timeout", "120")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = {r["method"]: r for r in json.loads((tmp_path / "latest.json").read_text())["records"]}
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


@pytest.mark.timeout(120)
def test_a_run_with_no_success_keeps_the_previous_good_results(tmp_path):
    (tmp_path / "latest.json").write_text('{"good": true}')
    proc = _bench(tmp_path, "--methods", "broken", "--nprocs", "1")
    assert proc.returncode == 1
    assert json.loads((tmp_path / "latest.json").read_text()) == {"good": True}
    assert "left as they were" in proc.stderr


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
