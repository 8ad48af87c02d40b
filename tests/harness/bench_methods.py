"""Benchmark methods that misbehave on purpose, for the harness's own tests."""

import time

from benchmarks.registry import method


@method("broken", "raises on construction (test only)")
def broken(ctx):
    raise RuntimeError("this method is broken on purpose")


@method("stuck", "never finishes a step (test only)")
def stuck(ctx):
    def step():
        time.sleep(3600)

    return step


@method("broken_torchrun", "raises on rank 1 under torchrun (test only)", launcher="torchrun")
def broken_torchrun(ctx):
    if ctx.rank == 1:
        raise RuntimeError("rank 1 is broken on purpose under torchrun")

    def step():
        return 0.0

    return step
