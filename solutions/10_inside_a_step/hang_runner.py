"""Lesson 10: the hang clinic's safe runner (given code: read it, nothing to write here).

A hang is dangerous to reproduce: two ranks wait for each other forever, and a notebook or a
test that started them waits too. :func:`run_ranks` runs a rank function it is given (the
clinic's cases: ``hang_clinic.run_case`` hands them over; this module knows nothing of them)
so that every hang ends, and turns it into a report to read:

- the ranks are fresh processes (``dpt.ranks.run_distributed``) with a **short process-group
  timeout** (``timeout_s``, 3 s by default): a collective that waits longer raises on gloo;
- a **hard wall deadline** above it: a rank still running then is killed, with its stack in
  the report, and no process outlives the call;
- one diagnostic **tool** per run:

  ``timeout``  nothing more: what each rank raised when its collective gave up;
  ``detail``   ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: before every collective the ranks compare
               a fingerprint (sequence number, op, shapes, dtypes) and raise at once, naming
               both sides, when they differ;
  ``flight``   the Flight Recorder: each rank keeps its last collectives in a ring buffer
               (``TORCH_FR_BUFFER_SIZE``); the report lists them, so you can line the ranks
               up by sequence number and see where they part;
  ``stacks``   ``faulthandler`` dumps each rank's Python stack every half second; the
               report shows the last dump, taken while the rank waited: the line every
               rank is waiting on.

The clinic always runs on gloo with CPU tensors, on every machine: a hang is about control
flow, not compute, and gloo's timeouts, ``DETAIL`` checks and Flight Recorder all work there.
On NCCL the same bugs hang the same way; there the watchdog aborts after the group's timeout,
``DETAIL`` works the same, and the Flight Recorder can dump to files
(``TORCH_FR_DUMP_TEMP_FILE``) for ``python -m torch.distributed.flight_recorder.fr_trace``.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import re
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dpt.ranks import RankFailure, run_distributed

TOOLS = ("timeout", "detail", "flight", "stacks")
STARTUP_S = 30.0  # room for the ranks to start on a loaded machine, on top of the timeout
FR_ENTRIES = 12  # the last collectives of each rank the flight report shows
STACK_EVERY_S = 0.5  # how often the stacks tool dumps a rank's stack


@dataclass
class Report:
    """What one run gave: ``finished`` when every rank returned without an error."""

    name: str  # what ran, as the report's first line says ("case order (broken)")
    tool: str
    world_size: int
    finished: bool
    results: list[Any] = field(default_factory=list)  # each rank's return value (None: failed)
    pids: list[int | None] = field(default_factory=list)  # the ranks' processes (all ended)
    text: str = ""  # the diagnosis report, as printed
    seconds: float = 0.0


# --- tools that run inside a rank ------------------------------------------------------------

def flight_recorder_entries() -> list[dict] | str:
    """This process's Flight Recorder entries (oldest first), or one line saying why not.

    ``_dump_fr_trace`` is private (torch >= 2.8 records gloo collectives too); the public route
    is a dump to files read by the ``fr_trace`` analyzer, which needs NCCL's watchdog.
    """
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None:
        return f"flight recorder: not available for gloo in torch {torch.__version__}"
    try:
        trace = pickle.loads(dump())
    except Exception as e:  # noqa: BLE001 - a diagnostic must never add a failure
        return f"flight recorder: dump failed ({type(e).__name__}: {e})"
    entries = trace.get("entries", [])
    if not entries:
        return "flight recorder: no entries (was TORCH_FR_BUFFER_SIZE set before the group?)"
    return entries


def flight_text(rank: int) -> str:
    """The Flight Recorder's last entries of this rank, one collective a line."""
    entries = flight_recorder_entries()
    if isinstance(entries, str):
        return entries
    lines = [f"rank {rank} flight recorder: its last {min(len(entries), FR_ENTRIES)} of "
             f"{len(entries)} collectives, oldest first"]
    for e in entries[-FR_ENTRIES:]:
        op = str(e.get("profiling_name", "?")).removeprefix("gloo:")
        lines.append(f"  rank {rank} collective #{e.get('collective_seq_id', '?')}: {op}, "
                     f"input sizes {e.get('input_sizes', '?')}")
    return "\n".join(lines)


def last_stack(text: str, rank: int) -> str:
    """The last of faulthandler's dumps in ``text``: its main thread, cut where the runner
    called the case.

    A dump lists every thread that Python knows, newest first; on a GPU machine torch's own
    threads come before the main one (with "<no Python frame>"), so the main thread is the one
    that runs the case (``_rank_main``), else the first with a Python frame.
    """
    dumps = [d for d in text.split("Timeout (") if d.strip()]
    if not dumps:
        return f"rank {rank}: no stack (it never waited {STACK_EVERY_S} s)"
    threads = [block.splitlines() for block in dumps[-1].strip().split("\n\n")]
    threads[0] = threads[0][1:]  # without "0:00:00.5)!"
    framed = [t for t in threads if any(line.strip().startswith("File ") for line in t)]
    main = next((t for t in framed if any("in _rank_main" in line for line in t)),
                framed[0] if framed else threads[0])
    lines = main
    cut = next((i for i, line in enumerate(lines) if "in _rank_main" in line), len(lines))
    return "\n".join([f"rank {rank}'s stack, the last of {len(dumps)} dumps:", *lines[:cut]])


def leave_after_every_rank_joined(store: dist.TCPStore, world_size: int, wait_s: float) -> None:
    """Rank 0 serves the store the others read while they join the group: if it left at once
    (a case that fails before its first collective), a slow peer would die of "connection
    reset" inside ``init_process_group`` and the report would show that, not the case."""
    try:
        store.wait([f"clinic/joined/{r}" for r in range(world_size)], timedelta(seconds=wait_s))
    except Exception:  # noqa: BLE001 - a peer that never joins is reported by the runner
        pass


def _rank_main(rank: int, world_size: int, fn, tool: str, timeout_s: float,
               stack_dir: str) -> dict:
    dist.set_debug_level_from_env()  # reads TORCH_DISTRIBUTED_DEBUG, set by run_ranks's env
    # The short timeout is for the case's collectives. Joining waits for the slowest rank to
    # start, which on a loaded machine can take longer: the store that joins them waits for
    # STARTUP_S, so a late rank is not mistaken for a hang.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=max(timeout_s, STARTUP_S)))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    store.set(f"clinic/joined/{rank}", "1")  # see leave_after_every_rank_joined
    stack_path = Path(stack_dir) / f"rank{rank}.txt"
    stack_file = open(stack_path, "w")  # noqa: SIM115 - closed below, after the dump
    if tool == "stacks":  # the last dump before the collective gives up shows where it waits
        faulthandler.dump_traceback_later(min(STACK_EVERY_S, timeout_s / 4), repeat=True,
                                          file=stack_file)
    start = time.monotonic()
    result, error = None, None
    try:
        result = fn(rank, world_size)
    except Exception as e:  # noqa: BLE001 - the report is the point
        error = f"{type(e).__name__}: {e}"
    finally:
        faulthandler.cancel_dump_traceback_later()
        stack_file.close()
    out = {"rank": rank, "pid": os.getpid(), "result": result, "error": error,
           "seconds": time.monotonic() - start}
    # Kept on disk too: if another rank dies after this one has returned, the runner still
    # reports what this one did (and a stub's NotImplementedError still names its task).
    (Path(stack_dir) / f"rank{rank}.outcome").write_text(
        f"{out['seconds']:.1f}\n{error or ''}")
    if rank == 0:
        leave_after_every_rank_joined(store, world_size, max(timeout_s, STARTUP_S))
    if tool == "flight":
        out["flight"] = flight_text(rank)
    if tool == "stacks":
        out["stack"] = last_stack(stack_path.read_text(), rank)
    if error is None:
        dist.destroy_process_group()
    return out


# --- the runner --------------------------------------------------------------------------------

def tool_env(tool: str) -> dict[str, str]:
    """The environment a tool needs in the ranks, set before their process group exists."""
    if tool not in TOOLS:
        raise ValueError(f"unknown tool {tool!r}: choose one of {', '.join(TOOLS)}")
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL" if tool == "detail" else "OFF"}
    if tool == "flight":
        env["TORCH_FR_BUFFER_SIZE"] = "200"
    return env


def run_ranks(fn, name: str, tool: str = "timeout", world_size: int = 2,
              timeout_s: float = 3.0, wall_s: float | None = None) -> Report:
    """Run ``fn(rank, world_size)`` on ``world_size`` gloo ranks with ``tool``; ``name`` says
    what runs, in the report's first line.

    Never hangs: the process group gives up after ``timeout_s``, and every rank is killed
    after ``wall_s`` (default ``timeout_s`` + 30 s of start-up room). Raises the task's
    ``NotImplementedError`` when the ranks reached a task not done yet. The ranks are fresh
    processes that import ``fn`` by its module's name: a function defined at the top of a
    module, not in ``__main__`` (a script run imports itself by name and passes its own).
    """
    qualname = getattr(fn, "__qualname__", "")
    if (not callable(fn) or getattr(fn, "__module__", "__main__") == "__main__"
            or "<" in qualname):
        raise ValueError(f"the ranks cannot import {fn!r} by name: give a function defined at "
                         "the top of a module other than __main__ (not a lambda, not nested)")
    env = tool_env(tool)
    wall = wall_s if wall_s is not None else timeout_s + STARTUP_S
    head = (f"=== {name}, tool {tool}: {world_size} ranks, process-group timeout "
            f"{timeout_s:g} s ===")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hang-clinic-") as stack_dir:
        try:
            outs = run_distributed(_rank_main, world_size,
                                   args=(fn, tool, timeout_s, stack_dir),
                                   backend=None, timeout=wall, env=env, echo=False)
        except RankFailure as e:  # a rank crashed (gloo aborts on some mismatches) or hung
            returned = returned_before(stack_dir, world_size)
            raise_if_stub(error for _, error in returned.values())
            lines = [head, "a rank did not return:", str(e)]
            for rank, (seconds, error) in returned.items():
                lines.append(f"--- rank {rank} had returned: "
                             f"{'FAILED' if error else 'finished'} after {seconds} s ---")
                lines += [error] if error else []
            return Report(name, tool, world_size, False, [None] * world_size, [],
                          "\n".join(lines), time.monotonic() - start)
    raise_if_stub(o["error"] for o in outs)
    lines = [head]
    for o in outs:
        status = "finished" if o["error"] is None else "FAILED"
        lines.append(f"--- rank {o['rank']}: {status} after {o['seconds']:.1f} s ---")
        if o["error"] is not None:
            lines.append(o["error"])
        for key in ("flight", "stack"):
            if key in o:
                lines.append(o[key])
    finished = all(o["error"] is None for o in outs)
    results = [o["result"] if o["error"] is None else None for o in outs]
    return Report(name, tool, world_size, finished, results,
                  [o["pid"] for o in outs], "\n".join(lines), time.monotonic() - start)


def returned_before(stack_dir: str, world_size: int) -> dict[int, tuple[str, str]]:
    """The ranks that had returned when the run failed: rank -> (seconds, error or "")."""
    found = {}
    for rank in range(world_size):
        path = Path(stack_dir) / f"rank{rank}.outcome"
        if path.exists():
            seconds, _, error = path.read_text().partition("\n")
            found[rank] = (seconds, error)
    return found


def raise_if_stub(errors) -> None:
    """A task not done yet: say so here, as a call of the stub would."""
    for error in errors:
        if (error or "").startswith("NotImplementedError: Task "):
            raise NotImplementedError(error.removeprefix("NotImplementedError: "))


# --- comparing a diagnosis with a report -------------------------------------------------------

_VARIES = [
    (re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]"), ""),  # gloo's source locations
    (re.compile(r"File \"[^\"]*?([^\"/\\]+)\""), r'File "\1"'),  # a file's folders
    (re.compile(r",? line \d+"), ""),  # line numbers (tracebacks and faulthandler)
    (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),  # addresses, thread ids
    (re.compile(r"\[?\d+\.\d+\.\d+\.\d+\]?:\d+"), "HOST"),  # peers' addresses and ports
    (re.compile(r"\d+(?:\.\d+)?\s?(?:ms|s)\b"), "?s"),  # durations
]


def normalise(text: str) -> str:
    """``text`` without what changes from run to run (paths, lines, ports, times, spaces)."""
    for pattern, repl in _VARIES:
        text = pattern.sub(repl, text)
    return " ".join(text.split())


def evidence_found(evidence: str, report_text: str) -> bool:
    """Whether ``evidence`` (copied from a report) occurs in ``report_text``, both normalised."""
    needle = normalise(evidence)
    return bool(needle) and needle in normalise(report_text)
