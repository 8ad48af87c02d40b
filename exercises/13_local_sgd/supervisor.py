"""Lesson 13 (given): run a job of replicas, kill one, and see what a policy does about it.

The supervisor plays the part of torchft's lighthouse and of torchrun's agent at once: it
owns a ``TCPStore`` every replica connects to (the quorums of ``fault_tolerance.py`` are
agreed there), starts the replicas as processes from ``dpt.ranks.process_context()`` (a
fork server with torch imported), kills one of them on purpose (``os._exit(13)`` at the
start of one step, as lesson 04's faulty worker), and writes an event log that
``fault_tolerance.steps_lost`` scores. Two policies:

- ``ft`` (what torchft does): the survivors' step fails, nobody applies it, they agree a
  quorum of two and redo it at once; the supervisor starts a replacement, which asks to
  join; at the next step boundary the members agree (an all-reduce of MAX over the join
  count) to form a quorum of three, and ``heal`` sends the joiner the survivors' model,
  optimizer state and step. The survivors never stop.
- ``restart`` (what torchrun's elastic agent does, lesson 04): the survivors stop at the
  failed step; once every replica is down, all start again and load the last snapshot
  (written every ``snapshot_every`` steps), computing again every step since it.

Every replica trains the same float64 MLP on its own seeded batches
(``fault_tolerance.batch_for``), so a test replays a run exactly from its log. A hard
timeout stops everything (by pid) and the error shows each unfinished replica's stack::

    .venv/bin/python exercises/13_local_sgd/supervisor.py --policy ft
    .venv/bin/python exercises/13_local_sgd/supervisor.py --policy restart --snapshot-every 10
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import faulthandler
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import fault_tolerance as ft
import torch
import torch.distributed as dist

POLICIES = ("ft", "restart")
KILLED = 13  # the exit code of the replica killed on purpose
STOPPED = 3  # the exit code of a replica that stops for a restart
MAX_DEATHS = 2  # more deaths than the planned one: something else is wrong; stop


def _append(path: Path, **event) -> None:
    event.setdefault("t", time.time())
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def replica_main(replica: int, incarnation: int, cfg: dict, run_dir: str, port: int,
                 setup: tuple | None) -> None:
    """One replica's process: connect, join or start, train to ``cfg["steps"]``, save."""
    run = Path(run_dir)
    out = open(run / f"replica{replica}.{incarnation}.out", "w", buffering=1)  # noqa: SIM115
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out
    # a hung replica writes its stack and exits just before the supervisor gives up
    faulthandler.dump_traceback_later(max(1.0, cfg["timeout"] - 3), exit=True, file=out)
    try:
        if setup is not None:
            module, name, args = setup
            getattr(importlib.import_module(module), name)(*args)
        torch.set_num_threads(1)
        _train(replica, incarnation, cfg, run, port)
    except SystemExit as exc:
        out.flush()
        os._exit(exc.code if isinstance(exc.code, int) else 1)
    except BaseException:  # noqa: BLE001 - the supervisor reads it from the output file
        traceback.print_exc()
        out.flush()
        os._exit(1)
    out.flush()
    os._exit(0)


def _train(me: int, incarnation: int, cfg: dict, run: Path, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=timedelta(seconds=cfg["timeout"]))
    events = run / f"events{me}.{incarnation}.jsonl"

    def log(**event):
        _append(events, replica=me, incarnation=incarnation, **event)

    steps, policy, wait_s = cfg["steps"], cfg["policy"], cfg["wait_s"]
    fresh = policy == "ft" and incarnation > 0  # a replacement: random weights, no state
    model = ft.make_model(seed=1000 + incarnation if fresh else 0)
    state = ft.Replica(model, ft.make_optimizer(model), 0)
    admitted = 0
    if fresh:
        ticket = store.add("joins", 1)
        epoch, expected, admitted = (int(v) for v in store.get(f"admit/{ticket}").split(b","))
    else:
        epoch, expected = 1000 * incarnation, cfg["replicas"]
        snapshot = run / "snapshot.pt"
        if incarnation > 0 and snapshot.exists():
            saved = torch.load(snapshot, weights_only=False)
            state.model.load_state_dict(saved["model"])
            state.opt.load_state_dict(saved["optimizer"])
            state.step = saved["step"]
            log(event="restore", step=state.step)
    members, group = ft.agree_quorum(store, epoch, me, expected, wait_s)
    if group is None:
        raise RuntimeError(f"replica {me} is not in the quorum {members} of epoch {epoch}")
    src = ft.heal(group, members, state, have_state=not fresh)
    log(event="quorum", epoch=epoch, members=members, step=state.step)
    if fresh:
        log(event="healed", step=state.step, src=src, epoch=epoch)

    def requorum(expected: int):
        nonlocal epoch, members, group
        epoch += 1
        group = None  # never reuse a group a peer died in
        members, group = ft.agree_quorum(store, epoch, me, expected, wait_s)
        if group is None:
            raise RuntimeError(f"replica {me} is not in the quorum {members} of epoch {epoch}")
        log(event="quorum", epoch=epoch, members=members, step=state.step)

    while True:
        counts = torch.tensor([store.add("joins", 0), store.add("promised", 0)])
        try:  # every member must see the same joins at the same step: agree on them
            ft.all_reduce_(group, counts, "max")
        except RuntimeError:
            if policy == "restart":
                log(event="down")
                sys.exit(STOPPED)
            requorum(len(members) - 1)
            continue
        joins, promised = int(counts[0]), int(counts[1])
        if joins > admitted:
            if members.index(me) == 0:
                for ticket in range(admitted + 1, joins + 1):
                    store.set(f"admit/{ticket}",
                              f"{epoch + 1},{len(members) + joins - admitted},{joins}")
            expected, admitted = len(members) + joins - admitted, joins
            requorum(expected)
            ft.heal(group, members, state, have_state=True)
            continue
        if state.step >= steps:
            if promised > admitted:  # a replacement is on its way: end at full strength
                time.sleep(0.005)
                continue
            break
        step = state.step + 1
        if incarnation == 0 and [me, step] == list(cfg["kill"] or ()):
            os._exit(KILLED)
        t0 = time.time()
        ok = ft.ft_step(state.model, state.opt, ft.batch_for(me, step), group, len(members))
        log(event="step", step=step, committed=bool(ok), epoch=epoch, members=members, t0=t0)
        if ok:
            state.step = step
            if policy == "restart" and members.index(me) == 0 and step % cfg["snapshot_every"] == 0:
                tmp = run / "snapshot.tmp"
                torch.save({"model": state.model.state_dict(),
                            "optimizer": state.opt.state_dict(), "step": step}, tmp)
                os.replace(tmp, run / "snapshot.pt")
        elif policy == "restart":
            log(event="down")
            sys.exit(STOPPED)
        else:
            requorum(len(members) - 1)
        time.sleep(cfg["step_s"])
    torch.save({"model": state.model.state_dict(), "optimizer": state.opt.state_dict(),
                "step": state.step, "members": members}, run / f"final{me}.pt")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def supervise(replicas: int = 3, steps: int = 40, kill: tuple[int, int] | None = (2, 15),
              policy: str = "ft", snapshot_every: int = 10, timeout: float = 60.0,
              step_s: float = 0.01, wait_s: float = 5.0, setup: tuple | None = None) -> dict:
    """Run the job under ``policy``; returns ``{"policy", "replicas", "steps", "kill",
    "events" (every replica's and the supervisor's, in time order), "final" (replica ->
    its saved model, optimizer state, step and last members), "seconds"}``.

    ``kill=(replica, step)``: that replica dies at the start of that step (None: nobody).
    ``setup=(module, function, args)`` runs in every replica first (the tests put reference
    answers in place with it). RuntimeError, with the replica's output, when a replica fails
    otherwise or the run passes ``timeout`` seconds.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if replicas < 2 or steps < 1 or snapshot_every < 1 or timeout <= 0:
        raise ValueError("replicas must be at least 2, steps and snapshot_every at least 1, "
                         f"timeout positive: got {replicas}, {steps}, {snapshot_every}, {timeout}")
    if kill is not None and not (0 <= kill[0] < replicas and 1 <= kill[1] <= steps):
        raise ValueError(f"kill must name a replica below {replicas} and a step from 1 to "
                         f"{steps}, got {kill}")
    from dpt.ranks import process_context

    ctx = process_context()
    run = Path(tempfile.mkdtemp(prefix="dpt-ft-"))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    cfg = {"replicas": replicas, "steps": steps, "kill": list(kill) if kill else None,
           "policy": policy, "snapshot_every": snapshot_every, "timeout": timeout,
           "step_s": step_s, "wait_s": wait_s}
    sup_log = run / "events_supervisor.jsonl"
    procs: dict[int, tuple] = {}  # replica -> (process, incarnation)
    start = time.time()
    deadline = time.monotonic() + timeout

    def launch(replica: int, incarnation: int) -> None:
        p = ctx.Process(target=replica_main, daemon=True, name=f"replica{replica}",
                        args=(replica, incarnation, cfg, str(run), store.port, setup))
        p.start()
        procs[replica] = (p, incarnation)
        _append(sup_log, event="start", replica=replica, incarnation=incarnation)

    def failure(what: str, replica: int) -> RuntimeError:
        p, inc = procs[replica]
        return RuntimeError(f"replica {replica} {what}; its output:\n"
                            f"{_tail(run / f'replica{replica}.{inc}.out')}")

    try:
        for r in range(replicas):
            launch(r, 0)
        deaths, done = 0, set()
        while len(done) < replicas:
            left = deadline - time.monotonic()
            if left <= 0:
                stuck = [r for r in procs if r not in done]
                for r in stuck:  # let their stacks reach their output files
                    procs[r][0].join(timeout=3)
                raise RuntimeError(f"supervise: timed out after {timeout:.0f}s; replica(s) "
                                   f"{stuck} had not finished (a hung quorum or collective?)\n"
                                   + "\n".join(f"--- replica {r} ---\n"
                                               f"{_tail(run / f'replica{r}.{procs[r][1]}.out')}"
                                               for r in stuck))
            sentinels = {procs[r][0].sentinel: r for r in procs if r not in done}
            for s in wait(list(sentinels), timeout=left):
                r = sentinels[s]
                p, inc = procs[r]
                p.join()
                if p.exitcode == 0:
                    done.add(r)
                    continue
                if p.exitcode not in (KILLED, STOPPED) or deaths >= MAX_DEATHS:
                    raise failure(f"failed with exit code {p.exitcode}", r)
                if p.exitcode == KILLED:
                    deaths += 1
                    _append(sup_log, event="down", replica=r, incarnation=inc)
                if policy == "ft":
                    if p.exitcode != KILLED:
                        raise failure("stopped under the ft policy", r)
                    store.add("promised", 1)
                    launch(r, inc + 1)
                else:
                    restart_all(procs, r, inc, deadline, sup_log)
                    for q in range(replicas):
                        launch(q, inc + 1)
        events = _events(run)
        final = {r: torch.load(run / f"final{r}.pt", weights_only=False)
                 for r in range(replicas)}
        return {"policy": policy, "replicas": replicas, "steps": steps,
                "kill": list(kill) if kill else None, "events": events, "final": final,
                "seconds": time.time() - start}
    except RuntimeError as exc:
        exc.events = _events(run)  # what happened up to the failure, for a diagnosis
        raise
    finally:
        for p, _ in procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=2)
        shutil.rmtree(run, ignore_errors=True)


def _events(run: Path) -> list[dict]:
    """Every replica's and the supervisor's events, in time order."""
    events = []
    for path in sorted(run.glob("events*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line]
    return sorted(events, key=lambda e: e["t"])


def restart_all(procs: dict, dead: int, inc: int, deadline: float, sup_log: Path) -> None:
    """torchrun's way: once one replica died, wait until every other one has stopped (each
    stops at its failed step; one that does not within the deadline is killed)."""
    for r, (p, _) in procs.items():
        if r == dead:
            continue
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=2)
            _append(sup_log, event="down", replica=r, incarnation=inc)
    _append(sup_log, event="restart", replica=dead, incarnation=inc + 1)


def summary(result: dict) -> str:
    """The lines the command prints: the steps each replica applied, and what was lost."""
    lost = ft.steps_lost(result["events"], result["replicas"])
    finals = list(result["final"].values())
    same = all(torch.equal(a, b) for f in finals[1:]
               for a, b in zip(finals[0]["model"].values(), f["model"].values(), strict=True))
    lines = [f"policy {result['policy']}: {result['replicas']} replicas, {result['steps']} steps,"
             f" replica {result['kill'][0]} killed at step {result['kill'][1]}"
             if result["kill"] else f"policy {result['policy']}: nobody killed"]
    for r in range(result["replicas"]):
        done = [e for e in result["events"] if e["event"] == "step" and e["replica"] == r]
        failed = [e["step"] for e in done if not e["committed"]]
        healed = [e["step"] for e in result["events"]
                  if e["event"] == "healed" and e["replica"] == r]
        lines.append(f"  replica {r}: {len(done)} steps computed, failed at {failed or 'none'}"
                     + (f", healed at step {healed[0]}" if healed else ""))
    lines.append(f"steps lost ({result['policy']}): {lost['replica_steps']} replica-steps "
                 f"({lost['discarded']} discarded, {lost['rolled_back']} rolled back), "
                 f"{lost['idle_replica_s']:.2f} replica-seconds idle; final weights equal on "
                 f"every replica: {'yes' if same else 'NO'}; {result['seconds']:.1f} s")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Kill a replica of a small job and compare torchft's "
                                            "policy (ft) with torchrun's (restart).")
    p.add_argument("--policy", choices=POLICIES, default="ft")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill", default="2:15", help="REPLICA:STEP, or 'none'")
    p.add_argument("--snapshot-every", type=int, default=10)
    p.add_argument("--step-s", type=float, default=0.01, help="seconds of pause per step")
    p.add_argument("--timeout", type=float, default=60.0)
    return p


def parse_kill(text: str) -> tuple[int, int] | None:
    if text == "none":
        return None
    try:
        replica, step = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"--kill must be REPLICA:STEP (e.g. 2:15) or none, got {text!r}") from None
    return replica, step


def main(argv: list[str] | None = None) -> int:
    from dpt.errors import report_error

    args = build_parser().parse_args(argv)
    try:
        if args.step_s < 0:
            raise ValueError(f"--step-s must be at least 0, got {args.step_s}")
        result = supervise(args.replicas, args.steps, parse_kill(args.kill), args.policy,
                           args.snapshot_every, args.timeout, args.step_s)
        print(summary(result))
    except (ValueError, NotImplementedError, RuntimeError) as exc:
        return report_error(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
