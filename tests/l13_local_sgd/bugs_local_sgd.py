"""Planted bugs of lesson 13, local_sgd.py (format: tests/planted.py)."""

from tests.planted import Bug

S = "13_local_sgd/local_sgd.py"
T = "tests/l13_local_sgd/test_local_sgd.py::"
AVERAGE = T + "test_average_is_the_mean_with_one_all_reduce"
H1 = T + "test_local_sgd_h1_equals_ddp"
BYTES = T + "test_bytes_are_ddps_over_h"
AGREE = T + "test_ranks_agree_exactly_at_every_h_th_step"
ONE_BUFFER = """    buffer = flat(tensors)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    buffer /= dist.get_world_size(group)
    unflat_(buffer, tensors)
    return buffer.numel() * buffer.element_size()
"""
PER_TENSOR = """    sent = 0
    with torch.no_grad():
        for t in tensors:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
            t /= dist.get_world_size(group)
            sent += t.numel() * t.element_size()
    return sent
"""

BUGS = [
    # --- 13.1 average_ ------------------------------------------------------------------------
    Bug("13.1-no-divide", S, where="13.1",
        find="    buffer /= dist.get_world_size(group)\n", replace="",
        tests=(AVERAGE, H1),
        expect=r"the weights are N times the average: divide the sum by the group's size",
        why="an all-reduce SUMs: without the division every rank holds N times the mean"),
    Bug("13.1-per-tensor", S, where="13.1",
        find=ONE_BUFFER, replace=PER_TENSOR,
        tests=(AVERAGE,),
        expect=r"3 all-reduces per sync: one flat buffer",
        why="one all-reduce per parameter tensor: the same bytes, but a latency (α) per "
            "tensor, which is what a slow network charges most for"),
    # --- 13.2 PeriodicSync._after_step ----------------------------------------------------------
    Bug("13.2-no-reset", S, where="13.2",
        find="            self.local_step = 0\n", replace="",
        tests=(BYTES, AGREE),
        expect=r"got 1: reset the count after a sync",
        why="the count is never reset: one sync at step H, then never again"),
    Bug("13.2-ge-no-reset", S, where="13.2",
        find="        if self.local_step == self.sync_every:\n            self.sync()\n"
             "            self.syncs += 1\n            self.local_step = 0\n",
        replace="        if self.local_step >= self.sync_every:\n            self.sync()\n"
                "            self.syncs += 1\n",
        tests=(BYTES,),
        expect=r"reset the count after a sync \(it keeps syncing at every step after the H-th\)",
        why="'>=' and no reset: a sync at every step from the H-th on, DDP's bytes again"),
    Bug("13.2-off-by-one", S, where="13.2",
        find="        if self.local_step == self.sync_every:\n",
        replace="        if self.local_step > self.sync_every:\n",
        tests=(BYTES, AGREE),
        expect=r"sync at the H-th step, not after H \+ 1",
        why="syncs after H + 1 inner steps: 12, not 15, syncs in 60 steps at H=4"),
]
