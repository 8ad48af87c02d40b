"""One rank of a benchmark method launched by torchrun (``launcher="torchrun"`` methods).

    torchrun --nproc-per-node N -m benchmarks.torchrun_worker METHOD OUT_DIR

``benchmarks.run`` writes ``OUT_DIR/config.json`` and starts this under torchrun. Each rank
joins the process group the way lesson 04 does (its ``torchrun_env`` reads RANK, LOCAL_RANK,
WORLD_SIZE; ``dpt.dist.setup`` picks the device and backend), runs the harness's
``bench_rank``, and writes ``OUT_DIR/rank<R>.json``, or ``rank<R>.error`` with its traceback.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    name, out = argv[0], Path(argv[1])
    rank = "unknown"
    try:
        from benchmarks.registry import load_all
        from benchmarks.run import bench_rank
        from dpt.dist import cleanup, setup

        load_all()  # puts the lesson folders on sys.path
        from ddp_torchrun import torchrun_env  # lesson 04

        env = torchrun_env()
        rank = env.rank
        cfg = json.loads((out / "config.json").read_text())
        setup(env.rank, env.world_size, env.local_rank, threads=cfg["threads_per_rank"],
              timeout_s=max(10.0, cfg["timeout"]))
        try:
            result = bench_rank(env.rank, env.world_size, name, cfg)
        finally:
            cleanup()
        (out / f"rank{env.rank}.json").write_text(json.dumps(result))
        return 0
    except BaseException:  # noqa: BLE001 - report everything to the parent
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    sys.exit(main())
