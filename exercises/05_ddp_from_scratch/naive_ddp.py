# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Step 2 of lesson 05: the smallest DDP that is correct.

:class:`ddp_base.DDPBase` starts every rank from rank 0's weights. What is left is to make the
ranks take the same step: after ``loss.backward()``, one call all-reduces every trainable
gradient and divides it by the world size (task 05.3).

Frozen parameters (``requires_grad=False``) are broadcast but never reduced. A parameter used
by two modules (tied weights) is one ``Parameter``: it is reduced once. A parameter that got
no gradient in this step is reduced as zeros, so every rank makes the same calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ddp_base import DDPBase


class NaiveDDP(DDPBase):
    def finish_gradient_synchronization(self) -> None:
        """Make each ``p.grad`` of ``self.params`` the mean of that gradient over the ranks.

        A parameter whose ``.grad`` is None counts as a zero gradient. Does nothing when
        ``self.require_sync`` is False.
        """
        if not self.require_sync:
            return
        raise NotImplementedError("Task 05.3: sum each trainable gradient over ranks, then take the mean")
