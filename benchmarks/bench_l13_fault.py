"""Lesson 13: what a lost replica costs, under each policy, with the real torchrun beside them.

One job (``solutions/13_local_sgd/supervisor.py``'s: 3 replicas of a float64 MLP, 40 steps,
replica 2 killed at the start of step 15, a snapshot every 10 steps) run three ways, each
scored by the lesson's own ``fault_tolerance.steps_lost`` (task 13.14) from the run's events:

- ``ft``: the supervisor's torchft-like policy (a quorum per membership, the survivors go on,
  the replacement heals from a live peer);
- ``restart``: the supervisor's imitation of torchrun (every replica stops, all start again
  and load the snapshot);
- ``torchrun``: the real thing, as in lesson 04: ``torchrun --max-restarts=1`` over a worker
  (this file, ``--worker``) that trains the same replicas with the same steps on the default
  gloo group, dies the same way and resumes from the same snapshot. Its idle time includes
  what the imitation leaves out: the agent noticing the death, stopping the survivors,
  starting 3 fresh Python processes that import torch, and the new rendezvous.

``--rounds`` repeats each (95% t-intervals over them, ``dpt.stats.mean_ci``); the final
weights must be equal on every replica, and torchrun's equal to the imitation's (the same
arithmetic in float64; ``ft`` averages over two members until the replacement joins).
torchft itself runs in ``make check-tools`` (``torchft_job.py``).

    python benchmarks/bench_l13_fault.py              # about 1 min on 2 idle cores
    python benchmarks/bench_l13_fault.py --rounds 5

Writes benchmarks/runs/lessons/l13_fault.json (git-ignored; the committed result is in
benchmarks/reference/lessons/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run by torchrun as a script: the repo is not on the path
    sys.path.insert(0, str(REPO))

from dpt.lessons import load  # noqa: E402

OUT = REPO / "benchmarks" / "runs" / "lessons"  # git-ignored; committed: reference/lessons
JOB = {"replicas": 3, "steps": 40, "kill": (2, 15), "snapshot_every": 10, "step_s": 0.005}
WORKER_VAR = "DPT_L13_TORCHRUN_JOB"


def worker(run: Path, steps: int, kill: tuple[int, int], snapshot_every: int,
           step_s: float) -> int:
    """One torchrun worker: the supervisor's replica on the default gloo group, events in
    the supervisor's format (``incarnation`` = torchrun's restart count)."""
    import torch
    import torch.distributed as dist

    sv = load("13_local_sgd", "supervisor", "solutions")  # its event log and exit codes
    ft = load("13_local_sgd", "fault_tolerance", "solutions")
    me, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inc = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    events = run / f"events{me}.{inc}.jsonl"

    def log(**event):
        sv._append(events, replica=me, incarnation=inc, **event)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    model = ft.make_model(seed=0)
    opt, done = ft.make_optimizer(model), 0
    snapshot = run / "snapshot.pt"
    if inc > 0 and snapshot.exists():
        saved = torch.load(snapshot, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        done = saved["step"]
        log(event="restore", step=done)
    group = dist.group.WORLD
    for step in range(done + 1, steps + 1):
        if inc == 0 and [me, step] == list(kill):
            log(event="down")
            os._exit(sv.KILLED)
        t0 = time.time()
        ok = ft.ft_step(model, opt, ft.batch_for(me, step), group, n)
        log(event="step", step=step, committed=bool(ok), t0=t0)
        if not ok:  # a peer died: stop, as a torchrun worker does, and wait to be restarted
            log(event="down")
            os._exit(sv.STOPPED)
        if me == 0 and step % snapshot_every == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "step": step}, run / "snapshot.tmp")
            os.replace(run / "snapshot.tmp", snapshot)
        time.sleep(step_s)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": steps},
               run / f"final{me}.pt")
    dist.destroy_process_group()
    return 0


def run_torchrun(replicas: int = 3, steps: int = 40, kill: tuple[int, int] = (2, 15),
                 snapshot_every: int = 10, step_s: float = 0.005,
                 timeout: float = 180.0) -> dict:
    """The job under ``torchrun --max-restarts=1``; the result in ``supervise``'s shape."""
    import torch

    from dpt.dist import find_free_port

    run = Path(tempfile.mkdtemp(prefix="dpt-torchrun-ft-"))
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # re-rendezvous on gloo
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    # the worker's settings go in the environment: torchrun's parser would take (or refuse
    # as ambiguous) options after the script that look like its own
    env[WORKER_VAR] = json.dumps({"run": str(run), "steps": steps, "kill": list(kill),
                                  "snapshot_every": snapshot_every, "step_s": step_s})
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={replicas}",
           "--max-restarts=1", "--monitor-interval=0.1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{find_free_port()}", __file__]
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.time() - start
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed (exit {proc.returncode}):\n"
                           + "\n".join((proc.stdout + proc.stderr).splitlines()[-30:]))
    sv = load("13_local_sgd", "supervisor", "solutions")
    final = {r: torch.load(run / f"final{r}.pt", weights_only=False) for r in range(replicas)}
    return {"policy": "torchrun", "replicas": replicas, "steps": steps, "kill": list(kill),
            "events": sv._events(run), "final": final, "seconds": seconds}


def weights_equal(a: dict, b: dict) -> bool:
    import torch

    return all(torch.equal(x, y) for x, y in zip(a["model"].values(), b["model"].values(),
                                                 strict=True))


def measure(rounds: int, job: dict = JOB, timeout: float = 180.0) -> dict:
    """Every way ``rounds`` times: steps lost, idle replica-seconds, seconds, weights."""
    from dpt.stats import mean_ci, positive_ci

    sv = load("13_local_sgd", "supervisor", "solutions")
    ft = load("13_local_sgd", "fault_tolerance", "solutions")
    ways = {"ft": [], "restart": [], "torchrun": []}
    finals: dict[str, list] = {way: [] for way in ways}
    sv.supervise(policy="ft", timeout=timeout, **{**job, "kill": None, "steps": 2})  # warm-up
    for rnd in range(1, rounds + 1):
        for way in ways:
            if way == "torchrun":
                result = run_torchrun(timeout=timeout, **job)
            else:
                result = sv.supervise(policy=way, timeout=timeout, **job)
            lost = ft.steps_lost(result["events"], result["replicas"])
            ranks = list(result["final"].values())
            same = all(weights_equal(ranks[0], f) for f in ranks[1:])
            finals[way].append(ranks[0])
            ways[way].append({**lost, "seconds": result["seconds"], "equal_on_every_replica": same})
            print(f"round {rnd} {way:8}: {lost['replica_steps']:3d} replica-steps lost "
                  f"({lost['discarded']} discarded, {lost['rolled_back']} rolled back), "
                  f"{lost['idle_replica_s']:6.2f} replica-seconds idle, "
                  f"{result['seconds']:5.1f} s; equal on every replica: {same}", flush=True)
    summary = {}
    for way, runs in ways.items():
        row = {}
        for key in ("replica_steps", "discarded", "rolled_back", "idle_replica_s", "seconds"):
            m, lo, hi = (positive_ci if key == "seconds" else mean_ci)([r[key] for r in runs])
            row[key] = {"mean": m, "lo": lo, "hi": hi}
        row["equal_on_every_replica"] = all(r["equal_on_every_replica"] for r in runs)
        summary[way] = row
    return {"job": {**job, "kill": list(job["kill"])}, "rounds": rounds, "runs": ways,
            "summary": summary,
            # the same arithmetic: restarting by hand and by torchrun end on the same weights
            # (ft does not: its survivors average over two members until the replacement joins)
            "torchrun_equals_restart": all(weights_equal(finals["restart"][0], f)
                                           for f in finals["restart"] + finals["torchrun"])}


def table(result: dict) -> str:
    def cell(d: dict, fmt: str) -> str:
        if d["lo"] is None:
            return format(d["mean"], fmt)
        return f"{d['mean']:{fmt}} [{d['lo']:{fmt}}, {d['hi']:{fmt}}]"

    lines = ["| way | replica-steps lost | idle replica-seconds | run seconds |",
             "|---|---|---|---|"]
    for way, row in result["summary"].items():
        lines.append(f"| {way} | {cell(row['replica_steps'], '.1f')} | "
                     f"{cell(row['idle_replica_s'], '.2f')} | {cell(row['seconds'], '.1f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="lesson 13: steps lost to a dead replica, under "
                                             "torchft's policy, torchrun's imitated and torchrun")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    import torch

    load_before = os.getloadavg()
    result = measure(args.rounds)
    result.update(torch=torch.__version__, load_average_before_after=[load_before,
                                                                       os.getloadavg()],
                  how="each way run --rounds times on the same job; replica-steps lost and "
                      "idle replica-seconds scored by fault_tolerance.steps_lost (13.14) from "
                      "the events; intervals: 95% t over the rounds (dpt.stats.mean_ci)")
    print(table(result))
    print("final weights of torchrun equal to the imitated restart's, bit for bit: "
          f"{result['torchrun_equals_restart']}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "l13_fault.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {OUT / 'l13_fault.json'}")
    return 0


if __name__ == "__main__":
    if WORKER_VAR in os.environ:  # started by run_torchrun's torchrun
        cfg = json.loads(os.environ[WORKER_VAR])
        sys.exit(worker(Path(cfg["run"]), cfg["steps"], tuple(cfg["kill"]),
                        cfg["snapshot_every"], cfg["step_s"]))
    sys.exit(main())
