"""Minimal reproduction of the rare SIGABRT ("terminate called without an active exception")
seen at the end of gloo ranks; not a test. Run it by hand:

    python tests/l05_ddp_from_scratch/gloo_exit_abort.py --runs 8            # aborts often
    python tests/l05_ddp_from_scratch/gloo_exit_abort.py --runs 8 --destroy  # rarer, not never

Each run starts 2 gloo ranks that launch async all-reduces of temporary tensors, drop every
Python reference to them, and exit, with or without ``dist.destroy_process_group()``. With
it the abort did not show in the runs tried here, but a harness that destroys its group still
saw it in 3 of 24 runs of lesson 05's DDP on a loaded machine: destroying makes it rarer, it
does not prevent it.

What happens (a core dump's backtrace, torch 2.14.1, Python 3.11): the interpreter is
finalizing (``Py_FinalizeEx``) while gloo's worker thread (``ProcessGroupGloo::runLoop``)
still owns the last reference to a finished ``AsyncWork``. Destroying it frees its tensors;
a tensor whose Python object is kept alive by C++ must drop that object under the GIL
(``TensorImpl::decref_pyobject`` -> ``gil_scoped_acquire``). During finalization, Python ends
any non-main thread that asks for the GIL (``take_gil`` -> ``PyThread_exit_thread`` ->
``pthread_exit``); the forced unwind meets the ``noexcept`` destructor ``~AsyncWork`` and the
C++ runtime calls ``std::terminate``. Upstream: pytorch/pytorch#190489 (open: the same
message from a missing ``destroy_process_group``) and the abandoned pytorch/pytorch#179291
(an ``atexit`` hook that destroys process groups, describing this mechanism).

Two things avoid it, and lesson 05 does both: keep a reference to every collective's tensor
until ``wait()`` has returned and beyond (persistent bucket buffers, gradients held through
their parameters), so gloo's thread never frees a tensor; and destroy the process group
before the interpreter exits (``dpt.ranks.run_distributed`` does, and a failing rank leaves
with ``os._exit``, which skips finalization).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from datetime import timedelta


def rank_main(rank: int, port: int, destroy: bool) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    for _ in range(200):  # still queued on gloo's thread when the script ends
        dist.all_reduce(torch.ones(100_000), async_op=True)  # tensor and handle dropped
    if destroy:
        dist.destroy_process_group()  # drains the queue and joins gloo's threads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--destroy", action="store_true", help="destroy the process group first")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.port, args.destroy)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from dpt.dist import find_free_port

    aborted = 0
    for i in range(args.runs):
        port = find_free_port()
        cmd = [sys.executable, __file__, "--port", str(port)] + (["--destroy"] if args.destroy else [])
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        codes = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
        bad = [(r, c, err) for r, (c, err) in enumerate(codes) if c != 0]
        aborted += bool(bad)
        for r, c, err in bad:
            first = next((line for line in err.splitlines() if "terminate" in line), "")
            print(f"run {i + 1}: rank {r} exit code {c}: {first}")
    print(f"{aborted} of {args.runs} runs had a rank abort "
          f"({'with' if args.destroy else 'without'} destroy_process_group)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
