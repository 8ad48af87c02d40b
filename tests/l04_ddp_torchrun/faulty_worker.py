"""Lesson 04's script with a crash the test injects (the lesson's code has no hook for it).

``DPT_FAULT=EPOCH:BATCH:RANK``: on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0),
rank RANK dies before batch BATCH of epoch EPOCH the way a killed worker does: ``os._exit``,
no cleanup, no goodbye to the other ranks. torchrun then restarts every worker. The lesson
comes from the tree under test (``$DPT_TARGET``, which the test's environment passes on).
"""

import os
import sys

from dpt.lessons import load

lesson = load("04_ddp_torchrun", "ddp_torchrun")

FAULT_EXIT_CODE = 13  # so that the log tells the injected crash from a bug
EPOCH, BATCH, RANK = (int(v) for v in os.environ["DPT_FAULT"].split(":"))
_run_epoch, _run_batch = lesson.Trainer._run_epoch, lesson.Trainer._run_batch


def run_epoch(self, epoch, limit_batches=None):
    self.fault_position = [epoch, 0]
    return _run_epoch(self, epoch, limit_batches)


def run_batch(self, source, targets):
    epoch, batch = self.fault_position
    self.fault_position[1] += 1
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and (epoch, batch, int(os.environ["RANK"])) == (EPOCH, BATCH, RANK):
        print(f"[rank {RANK}] injected fault: exiting at epoch {epoch} batch {batch}",
              file=sys.stderr, flush=True)
        os._exit(FAULT_EXIT_CODE)
    return _run_batch(self, source, targets)


lesson.Trainer._run_epoch, lesson.Trainer._run_batch = run_epoch, run_batch

if __name__ == "__main__":
    sys.exit(lesson.cli.main(lesson.main, lesson.build_parser()))
