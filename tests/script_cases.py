"""Run one lesson script several times in one process: ``python -m tests.script_cases``.

The tests of a script's bad input start it once per case, and each start pays for importing
torch (and Lightning) again, though every case stops at its first check. This driver imports
them once: it reads ``{"script": path, "cases": [argv, ...]}`` as JSON on stdin and runs the
script as ``__main__`` once per argv, as ``python script argv...`` would (the script's folder
first on ``sys.path``), with file descriptors 1 and 2 sent to files of their own, so that
everything the case prints, by Python or by C code or a logging handler made by an earlier case,
is its own. It writes ``[{"returncode", "stdout", "stderr"}, ...]`` as JSON to the path given
as its one argument. A case that ends in an exception gets its traceback on its stderr and
returncode 1, as the interpreter would give.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback
import warnings

_FILTERS = list(warnings.filters)  # the interpreter's own, before any script ran


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # sys.exit("message"): the interpreter prints it
    return 1


def run_case(script: str, argv: list[str]) -> dict:
    """``python script *argv`` in this process; its exit status and what it printed."""
    saved_fds = os.dup(1), os.dup(2)
    saved_path, saved_argv = list(sys.path), list(sys.argv)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = [script, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as the interpreter does
        warnings.filters[:] = _FILTERS  # each case shows its own warnings, as a fresh
        getattr(warnings, "_filters_mutated", lambda: None)()  # process would show them
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:  # noqa: BLE001 - reported as the interpreter would
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            sys.path[:], sys.argv = saved_path, saved_argv
        out.seek(0)
        err.seek(0)
        return {"returncode": code, "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")}


def main() -> None:
    request = json.load(sys.stdin)
    results = [run_case(request["script"], argv) for argv in request["cases"]]
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
