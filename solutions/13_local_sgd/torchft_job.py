"""Lesson 13 (optional): the fault-tolerant job with torchft, where torchft installs.

torchft (github.com/pytorch/torchft) does per step what ``fault_tolerance.py`` does by hand: a
*lighthouse* (here in this process) forms a quorum of the replicas that are alive at each
step; each replica's ``Manager`` joins it, all-reduces the gradients over the live replicas
only (``torchft.DistributedDataParallel``: torch's DDP with a comm hook calling
``manager.allreduce``), and ``torchft.Optimizer`` steps only when ``manager.should_commit()``
says every participant's all-reduce succeeded. A replica that joins late is *healed*: it
receives the weights and the optimizer state from a live peer (``recover_src_replica_rank``,
over HTTP) and goes on in lockstep. Nobody restarts; the survivors lose no step.

The job: 3 replicas (processes) train a 784-128-10 MLP with AdamW on random batches; replica 2
dies (``os._exit``) at step ``--kill``; a replacement starts at once, heals, and all three end
with bitwise-identical weights. Measured here (2 shared cores, load 5): the survivors went on
at once with 2 participants, the replacement's first step came 9.4 s after the death (start
and imports), about 30 ms a step of quorum and commit round trips under that load.

torchft ships wheels for Linux x86_64 only (Python 3.11-3.13, no source distribution) and its
quantised all-reduce needs a GPU (triton kernels); the lesson's tasks write what it does by
hand, and this file is given code::

    pip install torchft                     # Linux x86_64 only (in the `dev` extra there)
    .venv/bin/python solutions/13_local_sgd/torchft_job.py      # ~30-90 s
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

VICTIM = 2
REPLICAS = 3


def replica(idx: int, lighthouse: str, attempt: int, q, steps: int, kill: int,
            pace: float) -> None:
    """One replica: its own store and Manager, DDP and optimizer wrapped by torchft."""
    import torch
    import torch.nn.functional as F
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(1)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=2,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"r{idx}", store_addr="localhost", store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=lighthouse, hostname="localhost",
                      timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=30),
                      connect_timeout=timedelta(seconds=10))
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    g = torch.Generator().manual_seed(100 * idx + attempt)
    log = []  # (step, participants)
    while manager.current_step() < steps:
        if idx == VICTIM and attempt == 0 and manager.current_step() == kill:
            q.put({"idx": idx, "attempt": attempt, "died_at": kill, "t": time.time()})
            q.close()
            q.join_thread()  # the message must leave before the process does
            os._exit(13)
        x = torch.randn(64, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (64,), generator=g)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        time.sleep(pace)  # the survivors must still be training when the replacement arrives
        log.append((manager.current_step(), manager.num_participants()))
    w = torch.cat([p.detach().flatten() for p in model.parameters()])
    q.put({"idx": idx, "attempt": attempt, "log": log, "weights_sum": float(w.double().sum()),
           "weights_head": w[:4].tolist(), "t": time.time()})
    manager.shutdown(wait=False)


def run_job(steps: int = 400, kill: int = 40, pace: float = 0.03, timeout: float = 240.0
            ) -> dict:
    """Run the job; returns per replica (``"0"``, ``"1"``, ``"2"`` the replacement) its steps,
    participants per step and final weights, and the death's step and time."""
    from torchft._torchft import LighthouseServer

    if not 0 < kill < steps:
        raise ValueError(f"--kill must be between 0 and --steps ({steps}), got {kill}")
    ctx = mp.get_context("spawn")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200,
                                  heartbeat_timeout_ms=1000)
    q = ctx.Queue()
    t0 = time.time()
    args = (steps, kill, pace)
    procs = [ctx.Process(target=replica, args=(i, lighthouse.address(), 0, q, *args))
             for i in range(REPLICAS)]
    for p in procs:
        p.start()
    done, death = {}, None
    try:
        while len(done) < REPLICAS:
            if time.time() - t0 > timeout:
                raise RuntimeError(f"the torchft job did not finish in {timeout:.0f} s "
                                   f"(finished: {sorted(done)})")
            try:
                msg = q.get(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty: keep waiting
                continue
            if "died_at" in msg:
                death = {"step": msg["died_at"], "t": msg["t"] - t0}
                procs[VICTIM].join(5)
                procs.append(ctx.Process(target=replica,
                                         args=(VICTIM, lighthouse.address(), 1, q, *args)))
                procs[-1].start()
                death["restarted_t"] = time.time() - t0
            else:
                done[str(msg["idx"])] = msg
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    for r in done.values():
        r["t"] -= t0
        r["participants"] = {str(k): sum(1 for _, n in r["log"] if n == k)
                             for k in sorted({n for _, n in r["log"]})}
        r["first_step"] = r["log"][0][0] if r["log"] else None
    return {"steps": steps, "kill": kill, "pace_s": pace, "death": death, "replicas": done,
            "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> int:
    from dpt.errors import report_error

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--kill", type=int, default=40, help="the step at which replica 2 dies")
    ap.add_argument("--pace", type=float, default=0.03, help="seconds of sleep per step")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--out", default=None, help="write the result (JSON) here")
    args = ap.parse_args(argv)
    try:
        import torchft  # noqa: F401
    except ImportError:
        print("error: torchft is not installed: `pip install torchft` (wheels for Linux x86_64 "
              "only); the lesson's fault_tolerance.py does the same by hand", file=sys.stderr)
        return 2
    try:
        result = run_job(args.steps, args.kill, args.pace, args.timeout)
    except (ValueError, RuntimeError, OSError) as exc:
        return report_error(exc)
    death = result["death"]
    print(f"replica {VICTIM} died at step {death['step']} ({death['t']:.1f} s); a replacement "
          f"started {death['restarted_t'] - death['t']:.2f} s later")
    for idx, r in sorted(result["replicas"].items()):
        who = "replacement" if idx == str(VICTIM) else "survivor"
        print(f"  replica {idx} ({who}): steps {r['first_step']}-{r['log'][-1][0]}, steps per "
              f"participant count {r['participants']}, weights sum {r['weights_sum']:.12f}")
    same = len({r["weights_sum"] for r in result["replicas"].values()}) == 1
    print(f"final weights {'bitwise equal' if same else 'DIFFER'} on all replicas "
          f"({result['seconds']:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
