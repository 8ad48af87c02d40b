"""One rank of a benchmark method launched by torchrun (``launcher="torchrun"`` methods).

    torchrun --nproc-per-node N -m benchmarks.torchrun_worker METHOD OUT_DIR

``benchmarks.run`` writes ``OUT_DIR/config.json`` and starts this under torchrun. Each rank
joins the process group the way lesson 04 does (its ``torchrun_env`` reads RANK, LOCAL_RANK,
WORLD_SIZE; ``dpt.dist.setup`` joins), on the device and backend the harness's other
launcher would use (``benchmarks.run.rank_placement``: DPT_TEST_BACKEND and DPT_SHARE_GPU
count here too), runs the harness's ``bench_rank``, and writes ``OUT_DIR/rank<R>.json``, or
``rank<R>.error`` with its traceback.

Teardown, in this order: the result is on disk; a barrier, so that no rank leaves while a
peer still talks to it; the group destroyed; then the process ends with ``os._exit``, with
its output flushed. Leaving through the interpreter's own exit ran C++ destructors while
gloo's threads could still be alive, and a rank aborted now and then with "terminate called
without an active exception" after its results were written.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from dpt.lessons import load


def run(argv: list[str]) -> int:
    """Join, measure, write the result, leave the group; the exit code (no exit here)."""
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    name, out = argv[0], Path(argv[1])
    rank = "unknown"
    try:
        from benchmarks.registry import load_all
        from benchmarks.run import bench_rank, rank_placement
        from dpt.dist import barrier, cleanup, setup

        load_all()
        torchrun_env = load("04_ddp_torchrun", "ddp_torchrun", "solutions").torchrun_env

        env = torchrun_env()
        rank = env.rank
        cfg = json.loads((out / "config.json").read_text())
        _, device = rank_placement(env.world_size)
        setup(env.rank, env.world_size, env.local_rank, device=device,
              threads=cfg["threads_per_rank"], timeout_s=max(10.0, cfg["timeout"]))
        result = bench_rank(env.rank, env.world_size, name, cfg)
        (out / f"rank{env.rank}.json").write_text(json.dumps(result))
        barrier()  # every rank has its result and no collective of its own left
        cleanup()
        return 0
    except BaseException:  # noqa: BLE001 - report everything to the parent
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        traceback.print_exc()
        return 1


def main(argv: list[str] | None = None) -> None:
    code = run(sys.argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: nothing of gloo's is left to destroy at exit


if __name__ == "__main__":
    main()
