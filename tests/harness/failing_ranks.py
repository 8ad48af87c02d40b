"""Rank functions that fail on purpose, for test_rank_errors.py (importable, so the ranks of
dpt.ranks.run_distributed can find them by name)."""

import torch.distributed as dist

STUB = "Task 99.1: write the sum of the shards"
PLANTED = "shapes do not match:\n  got [3, 4]\n  expected [4, 3]"


def stub_on_rank_1(rank, world_size):
    """Rank 1 reaches a task not done yet (an exercise's stub); rank 0 has nothing to do."""
    if rank == 1:
        raise NotImplementedError(STUB)
    return rank


def stub_on_rank_1_while_rank_0_waits(rank, world_size):
    """Rank 1 reaches a stub while rank 0 waits for it in a collective: rank 0 then fails too,
    with a connection error, and may report first."""
    if rank == 1:
        raise NotImplementedError(STUB)
    dist.barrier()
    return rank


def divide_by_zero_on_rank_1(rank, world_size):
    if rank == 1:
        return 1 / 0
    return rank


def multiline_error_on_rank_1(rank, world_size):
    """The message's first line ends at a colon: the cause is on the lines after it."""
    if rank == 1:
        raise RuntimeError(PLANTED)
    return rank
