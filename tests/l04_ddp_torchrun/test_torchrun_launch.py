"""Lesson 04 launched for real: torchrun with an elastic restart, two "nodes" on one machine,
the SLURM script with fake SLURM tools, and a corrupted snapshot.

Each run is a subprocess of ``python -m torch.distributed.run`` (torchrun) with a timeout.
Starting Python + torch per worker dominates, so runs are tiny and mostly concurrent; these
tests are marked slow.

Under load (other jobs keeping every core busy) these runs once failed now and then. What
this file does about it, cause by cause:

- worker start-up is slow and uneven (importing torch, loading the data), so a rank can wait
  minutes for another at the first collective: the lesson's collective timeout here is
  generous (``--timeout 300``), and so are the tests' own limits. Time limits are for hangs;
  these tests check correctness, not speed;
- a port chosen by one process (bind to port 0, release) and bound later by another can be
  taken in between, by another test or by an outgoing connection. Single-node runs therefore
  use ``--standalone`` (torchrun picks its own port) instead of a port the test picked;
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (needed for restarts on torch 2.14 with gloo, see the
  troubleshooting table in docs/troubleshooting.md) makes the agent of rank 0 choose a fresh port for the
  workers' store in every rendezvous round, with the same window; a collision there shows up
  as ``EADDRINUSE`` in a worker's log, which ``_wait`` prints in full.
"""

from __future__ import annotations

import os
import re
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

# The lesson's default dataset is MNIST (as in the tutorials it follows); the tests use
# Fashion-MNIST, which `make test` always provides (MNIST needs `make data`).
FASHION = ("--dataset", "fashion-mnist")
TINY = [*FASHION, "--epochs", "3", "--limit-batches", "5", "--train-limit", "1024", "--test-limit", "200",
        "--batch-size", "32", "--threads", "1", "--no-progress", "--timeout", "300",
        "--device", "cpu"]  # cpu: two "nodes" on one GPU machine would share cuda:0
WAIT = 420  # seconds: a loaded 2-core machine starts each torch process in tens of seconds
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _env(**extra) -> dict:
    # The course sets this wherever it launches torchrun (see the lesson README).
    return dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS="1", TQDM_DISABLE="1", **extra)


def _start(args, log: Path, env=None) -> subprocess.Popen:
    with open(log, "w") as out:  # the child has its own copy of the descriptor
        return subprocess.Popen([str(a) for a in args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO, env=env or _env(), start_new_session=True)


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


def _standalone(*extra, worker=None) -> list:
    return [*TORCHRUN, "--standalone", "--nproc-per-node=2", *extra,
            worker or script(LESSON, "ddp_torchrun.py")]


def _same_weights(a: Path, b: Path) -> None:
    wa = torch.load(a, weights_only=True)["model"]
    wb = torch.load(b, weights_only=True)["model"]
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, k=k: f"{k} differs between the run that "
                                   f"was restarted and the one that never failed: {m}")


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(WAIT + 60)
def test_torchrun_restarts_after_a_fault_and_matches_a_run_that_never_failed(tmp_path):
    # --deterministic: on a GPU, cuDNN would otherwise pick kernels whose sums vary by run
    clean = _start([*_standalone(), *TINY, "--deterministic", "--snapshot",
                    tmp_path / "clean.pt"], tmp_path / "clean.log")
    faulty = _start([*_standalone("--max-restarts=2", worker=Path(__file__).with_name(
                     "faulty_worker.py")), *TINY, "--deterministic",
                     "--snapshot", tmp_path / "faulty.pt"], tmp_path / "faulty.log",
                    env=_env(DPT_FAULT="1:3:1"))
    logs = _wait({"clean run": (clean, tmp_path / "clean.log"),
                  "faulty run": (faulty, tmp_path / "faulty.log")}, timeout=WAIT)
    log = logs["faulty run"]
    assert "injected fault: exiting at epoch 1 batch 3" in log
    resumed = set(re.findall(r"resumed from snapshot .+? at epoch (\d+)", log))
    assert resumed == {"1"}, (
        f"the restarted workers resumed at epoch {', '.join(sorted(resumed)) or 'never'}, not 1: "
        "the snapshot written after epoch 0 holds the number of epochs done (1), and "
        "training goes on from there")
    assert "resumed" not in logs["clean run"]
    _same_weights(tmp_path / "clean.pt", tmp_path / "faulty.pt")


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(WAIT + 60)
def test_two_nodes_on_one_machine_train_together(tmp_path):
    port = find_free_port()
    procs = {}
    for node in (0, 1):
        cmd = [*TORCHRUN, "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=l04-test",
               script(LESSON, "ddp_torchrun.py"), *TINY, "--epochs", "1",
               "--snapshot", tmp_path / "snap.pt"]
        log = tmp_path / f"node{node}.log"
        procs[f"node {node}"] = (_start(cmd, log), log)
    logs = _wait(procs, timeout=WAIT)
    both = logs["node 0"] + logs["node 1"]
    assert "world size 2" in both, "the two torchrun agents did not form one world of 2"
    assert "test accuracy" in both
    assert torch.load(tmp_path / "snap.pt", weights_only=True)["world_size"] == 2


# A real allocation can list many nodes. Far more than a pipe holds (64 KiB): a script that
# stops reading after the first line (`| head -n 1`) kills this writer with SIGPIPE.
FAKE_SCONTROL = """\
#!/bin/bash
echo "$@" >> "$FAKE_LOG/scontrol.args"
[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: unexpected $*" >&2; exit 1; }
printf '127.0.0.1\\n'
for ((i = 2; i <= 20000; i++)); do printf 'fake-node-%d\\n' "$i"; done
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
@pytest.mark.timeout(WAIT + 60)
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
    proc = subprocess.run(["bash", str(sbatch), *TINY, "--epochs", "1"], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=WAIT)
    nodes = "".join((tmp_path / f"node{n}.log").read_text() for n in (0, 1)
                    if (tmp_path / f"node{n}.log").exists())
    assert proc.returncode == 0, proc.stdout + proc.stderr + nodes[-4000:]
    assert (tmp_path / "scontrol.args").read_text().split() == ["show", "hostnames",
                                                                "fake-node-[1-2]"]
    srun = (tmp_path / "srun.args").read_text()
    for piece in ("--nnodes=2", "--nproc-per-node=1", "--rdzv-id=4242", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint=127.0.0.1:{env['RDZV_PORT']}", "--max-restarts=0"):
        assert piece in srun, f"{piece} missing from the torchrun line: {srun}"
    assert "world size 2" in nodes and "test accuracy" in nodes
    assert (tmp_path / "snap.pt").is_file()


def test_the_sbatch_script_takes_the_first_of_many_nodes_without_sigpipe(tmp_path):
    """The head-node line of torchrun.sbatch, run alone against a node list of 20000 lines."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(textwrap.dedent(FAKE_SCONTROL))
    (bin_dir / "scontrol").chmod(0o755)
    text = script(LESSON, "torchrun.sbatch").read_text()
    start = text.index("set -euo pipefail")
    end = text.index("RDZV_PORT=")
    probe = text[start:end] + 'echo "head=$head_node"\n'
    proc = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
                                   FAKE_LOG=str(tmp_path), SLURM_JOB_NODELIST="fake-[1-20000]"))
    assert proc.returncode == 0, (
        f"exit {proc.returncode} (141 is SIGPIPE: a reader that stops early under pipefail)\n"
        f"{proc.stderr}")
    assert proc.stdout.strip() == "head=127.0.0.1"


@requires_data
@pytest.mark.slow
@pytest.mark.timeout(WAIT + 60)
def test_a_corrupted_snapshot_is_one_clear_line(tmp_path):
    snap = tmp_path / "snap.pt"
    snap.write_bytes(b"\x80\x02 half a pickle")
    # A world of one, with the variables torchrun would set (no launcher output to wade through).
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}
    proc = run_script(script(LESSON, "ddp_torchrun.py"), *FASHION, *TINY, "--snapshot", str(snap),
                      timeout=WAIT, env=env)
    line = one_line_error(proc)
    assert str(snap) in line and "corrupted" in line
    assert proc.returncode == 2
