"""One ``error:`` line for what stopped a lesson script, a failed rank's cause included.

A lesson script's ``main`` catches what it expects (a bad flag, a broken checkpoint, a rank
that raised) and ends with :func:`report_error`, which prints one line and returns the exit
code 2. For a rank that raised, the line names the rank and the cause, not just "failed"::

    error: rank 1 of 2 failed: NotImplementedError: Task 09.2: gather the unit's shards ...

It is the line of the failure that names a task when there is one (a stub's message is
``Task NN.K: hint``), else the exception's type and its whole message on one line. With
``DPT_TRACEBACK=1`` in the environment the rank's traceback and output come above it. The
benchmark records :func:`one_line` as a failed method's ``error``.
"""

from __future__ import annotations

import os
import re
import sys
import traceback as tb
from typing import TextIO

import torch.distributed as dist

from dpt.ranks import RankFailure

TRACEBACK_VAR = "DPT_TRACEBACK"
MAX_CHARS = 500  # a message longer than this is cut, "..." at the end: the traceback has it all
TASK = re.compile(r"Task \d\d\.\d+[a-z]?: ")


def wants_traceback() -> bool:
    """Whether ``DPT_TRACEBACK`` asks for the whole traceback (set, and not 0)."""
    return os.environ.get(TRACEBACK_VAR, "").strip() not in ("", "0")


def _flat(text: str) -> str:
    """A message on one line: its lines joined, cut at ``MAX_CHARS``."""
    line = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return line if len(line) <= MAX_CHARS else line[:MAX_CHARS - 3].rstrip() + "..."


def task_line(text: str, top_level_only: bool = False) -> str | None:
    """The first line of ``text`` that names a task (``Task NN.K: ...``), or None.

    ``top_level_only`` skips indented lines: in a traceback those are source lines, such as
    the stub's own ``raise NotImplementedError("Task NN.K: ...")``, not what was raised.
    """
    for line in text.splitlines():
        if top_level_only and line[:1].isspace():
            continue
        if TASK.search(line):
            return line.strip()
    return None


def _cause(failure: RankFailure) -> str | None:
    """What one rank's failure was, in one line; None when the RankFailure says nothing."""
    if failure.kind is None:
        return failure.message
    task = task_line(failure.message or "")
    if task is not None:
        return _flat(task if task.startswith(failure.kind) else f"{failure.kind}: {task}")
    chained = task_line(failure.traceback or "", top_level_only=True)  # e.g. `raise ... from`
    if chained is not None:
        return _flat(chained)
    message = _flat(failure.message or "")
    return f"{failure.kind}: {message}" if message else failure.kind


def _rank_line(exc: RankFailure) -> str:
    """``rank R of N failed: <cause>``; a peer's failure when it names a task and this one
    does not (a rank that lost its peer in a collective reports first, the peer's stub is the
    cause)."""
    for failure in (exc, *exc.peers):
        cause = _cause(failure)
        if failure.kind is not None and cause is not None and TASK.search(cause):
            break
    else:
        failure, cause = exc, _cause(exc)
    if cause is None:  # a RankFailure made elsewhere (the benchmark's torchrun launcher)
        text = str(exc).strip()
        found = task_line(text, top_level_only=True)
        return _flat(found if found is not None else
                     (text.splitlines()[-1] if text else type(exc).__name__))
    if failure.rank is None:
        return cause
    where = f"rank {failure.rank} of {failure.world_size}"
    return f"{where} failed: {cause}" if failure.kind is not None else f"{where} {cause}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """What stopped the script, in one line, without the ``error:`` in front.

    A :class:`~dpt.ranks.RankFailure`: the rank, then its task's line or its exception's type
    and message (``rank 1 of 2 failed: ZeroDivisionError: division by zero``), or how it
    ended (``rank 0 of 2 hung and was stopped``). Anything else: its message's line that names
    a task, else its first line, else its type's name.
    """
    if isinstance(exc, RankFailure):
        return _rank_line(exc)
    if isinstance(exc, dist.DistNetworkError):
        return (f"lost or never reached the rendezvous at {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')} ({_first_line(exc)[:100]})")
    text = str(exc).strip()
    found = task_line(text)
    return found if found is not None else _first_line(exc)


def report_error(exc: BaseException, file: TextIO | None = None) -> int:
    """Print ``error: <one_line(exc)>`` to stderr and return 2, the exit code for it.

    With ``DPT_TRACEBACK=1``: the traceback first (a failed rank's own, with its output, and
    any other rank's that failed too). Without it, a rank's failure says how to get it.
    """
    file = sys.stderr if file is None else file
    line = one_line(exc)
    if wants_traceback():
        text = str(exc) if isinstance(exc, RankFailure) else "".join(
            tb.format_exception(type(exc), exc, exc.__traceback__))
        print(text.rstrip(), file=file)
    elif isinstance(exc, RankFailure):
        line += f" ({TRACEBACK_VAR}=1 for the traceback)"
    print(f"error: {line}", file=file, flush=True)
    return 2
