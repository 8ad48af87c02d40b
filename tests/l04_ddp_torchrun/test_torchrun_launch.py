"""Lesson 04 launched for real: torchrun with an elastic restart, two "nodes" on one machine,
the SLURM script with fake SLURM tools, and a corrupted snapshot.

Each run is a subprocess of ``python -m torch.distributed.run`` (torchrun) with a free port and
a timeout. Starting Python + torch per worker dominates, so runs are tiny and mostly
concurrent; these tests are marked slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dpt.dist import find_free_port
from tests.helpers import one_line_error, requires_data, run_script
from tests.lessons import REPO, script

LESSON = "04_ddp_torchrun"
TINY = ["--epochs", "3", "--limit-batches", "5", "--train-limit", "1024", "--test-limit", "200",
        "--batch-size", "32", "--threads", "1", "--no-progress", "--timeout", "30"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _env(**extra) -> dict:
    # The course sets this wherever it launches torchrun (see the lesson README).
    return dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS="1", TQDM_DISABLE="1", **extra)


def _start(args, log: Path, env=None) -> subprocess.Popen:
    return subprocess.Popen([str(a) for a in args], stdout=open(log, "w"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, cwd=REPO, env=env or _env(),
                            start_new_session=True)


def _wait(procs: dict[str, tuple[subprocess.Popen, Path]], timeout: float) -> dict[str, str]:
    """Wait for every process; on timeout kill them all (their whole session) and fail."""
    import signal

    logs = {}
    try:
        for name, (proc, log) in procs.items():
            proc.wait(timeout=timeout)
            logs[name] = log.read_text()
    except subprocess.TimeoutExpired:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("torchrun did not finish in time:\n" + "\n".join(
            f"--- {n} ---\n{log.read_text()[-3000:]}" for n, (_, log) in procs.items()))
    for name, (proc, _) in procs.items():
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{logs[name][-4000:]}"
    return logs


def _standalone(port: int, *extra) -> list:
    return [*TORCHRUN, "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", *extra, script(LESSON, "ddp_torchrun.py")]


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, k=k: f"{k} differs: {m}")


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_restarts_after_a_fault_and_matches_a_run_that_never_failed(tmp_path):
    clean = _start([*_standalone(find_free_port()), *TINY, "--snapshot", tmp_path / "clean.pt",
                    "--out", tmp_path / "clean_w.pt"], tmp_path / "clean.log")
    faulty = _start([*_standalone(find_free_port(), "--max-restarts=2"), *TINY,
                     "--snapshot", tmp_path / "faulty.pt", "--out", tmp_path / "faulty_w.pt",
                     "--fail-at", "1:3", "--fail-rank", "1"], tmp_path / "faulty.log")
    logs = _wait({"clean run": (clean, tmp_path / "clean.log"),
                  "faulty run": (faulty, tmp_path / "faulty.log")}, timeout=200)
    log = logs["faulty run"]
    assert "injected fault: exiting at epoch 1 batch 3" in log
    assert "attempt 1:" in log, "torchrun did not restart the workers"
    assert "resumed from snapshot" in log and "at epoch 1" in log, \
        "the restarted workers did not resume from the epoch-1 snapshot"
    assert "resumed" not in logs["clean run"]
    _same_weights(tmp_path / "clean_w.pt", tmp_path / "faulty_w.pt")


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_nodes_on_one_machine_train_together(tmp_path):
    port = find_free_port()
    procs = {}
    for node in (0, 1):
        cmd = [*TORCHRUN, "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=l04-test",
               script(LESSON, "ddp_torchrun.py"), *TINY, "--epochs", "1",
               "--out", tmp_path / "w.pt"]
        log = tmp_path / f"node{node}.log"
        procs[f"node {node}"] = (_start(cmd, log), log)
    logs = _wait(procs, timeout=160)
    both = logs["node 0"] + logs["node 1"]
    assert "rank 0 of 2" in both, "the two torchrun agents did not form one world of 2"
    assert "test accuracy" in both
    assert (tmp_path / "w.pt").is_file()


FAKE_SCONTROL = """\
#!/bin/bash
echo "$@" >> "$FAKE_LOG/scontrol.args"
[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: unexpected $*" >&2; exit 1; }
printf '127.0.0.1\\nfake-node-2\\n'
"""

# srun on a 2-node allocation runs the command once per node; here, twice on this machine.
FAKE_SRUN = """\
#!/bin/bash
echo "$@" >> "$FAKE_LOG/srun.args"
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$FAKE_LOG/node$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_sbatch_script_launches_torchrun_on_every_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(textwrap.dedent(text))
        (bin_dir / name).chmod(0o755)
    sbatch = script(LESSON, "torchrun.sbatch")
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(tmp_path),
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="fake-node-[1-2]", SLURM_NNODES="2",
               SLURM_SUBMIT_DIR=str(REPO), SLURM_CPUS_PER_TASK="1", NPROC_PER_NODE="1",
               PYTHON=sys.executable, RDZV_PORT=str(find_free_port()),
               LESSON_TREE=str(sbatch.parent.parent),
               SNAPSHOT=str(tmp_path / "snap.pt"), MAX_RESTARTS="0")
    proc = subprocess.run(["bash", str(sbatch), *TINY, "--epochs", "1", "--out",
                           str(tmp_path / "w.pt")], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=160)
    nodes = "".join((tmp_path / f"node{n}.log").read_text() for n in (0, 1)
                    if (tmp_path / f"node{n}.log").exists())
    assert proc.returncode == 0, proc.stdout + proc.stderr + nodes[-4000:]
    assert (tmp_path / "scontrol.args").read_text().split() == ["show", "hostnames",
                                                                "fake-node-[1-2]"]
    srun = (tmp_path / "srun.args").read_text()
    for piece in ("--nnodes=2", "--nproc-per-node=1", "--rdzv-id=4242", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint=127.0.0.1:{env['RDZV_PORT']}", "--max-restarts=0"):
        assert piece in srun, f"{piece} missing from the torchrun line: {srun}"
    assert "rank 0 of 2" in nodes and "test accuracy" in nodes
    assert (tmp_path / "snap.pt").is_file() and (tmp_path / "w.pt").is_file()


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_corrupted_snapshot_is_one_clear_line(tmp_path):
    snap = tmp_path / "snap.pt"
    snap.write_bytes(b"\x80\x02 half a pickle")
    # A world of one, with the variables torchrun would set (no launcher output to wade through).
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}
    proc = run_script(script(LESSON, "ddp_torchrun.py"), *TINY, "--snapshot", str(snap),
                      timeout=90, env=env)
    line = one_line_error(proc)
    assert str(snap) in line and "corrupted" in line
    assert proc.returncode == 2
