"""Lesson 03's script with a fault the test injects: rank 1 raises as its first epoch starts.

The lesson's code has no hook for this. ``mp.spawn`` starts each process by importing this
file again (as ``__mp_main__``), so the patch below is in place in every rank. The lesson comes
from the tree under test (``$DPT_TARGET``, which the test's environment passes on).
"""

import sys

import torch.distributed as dist

from dpt.lessons import load

ddp_spawn = load("03_ddp_spawn", "ddp_spawn")

_real_run_epoch = ddp_spawn.Trainer._run_epoch


def _run_epoch(self, epoch, limit_batches=None):
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose (a fault the test injects)")
    return _real_run_epoch(self, epoch, limit_batches)


ddp_spawn.Trainer._run_epoch = _run_epoch

if __name__ == "__main__":
    cli = ddp_spawn.cli
    sys.exit(cli.main(cli.with_free_port(ddp_spawn.launch), ddp_spawn.build_parser()))
