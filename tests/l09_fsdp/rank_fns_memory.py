"""Rank functions for lesson 09's memory tests (run by dpt.ranks.run_distributed).

They load the lesson code through tests.lessons.load inside the rank, and measure with
``dpt.memory.MemoryTracker``, which counts the bytes of live tensors exactly (the same count
on every machine).
"""

from __future__ import annotations

from tests.lessons import load

LESSON = "09_fsdp"


def measure(rank, world_size, method, batch=1, config=None):
    """The lesson's ``measure_worker`` (given code): one step of ``method``, its bytes."""
    mt = load(LESSON, "memory_table")
    return mt.measure_worker(rank, world_size, method=method, batch=batch, config=config)


def checkpointing_per_rank(rank, world_size, **kwargs):
    """The lesson's ``compare_worker`` under DDP: each rank's peak with and without
    checkpointing."""
    ac = load(LESSON, "activation_checkpointing")
    return ac.compare_worker(rank, world_size, **kwargs)
