"""Step 3 of lesson 05: overlap communication with the backward pass.

The naive wrapper waits until backward is over, then sends every gradient. But the gradient
of the last layer is ready long before backward reaches the first one. Here each parameter
gets a hook that fires the moment its gradient is accumulated
(``Tensor.register_post_accumulate_grad_hook``) and launches an *asynchronous* all-reduce of
that gradient (``async_op=True`` returns a handle at once). Backward goes on computing while
the network works. ``finish_gradient_synchronization()`` waits on every handle, then divides.

Without the wait, ``optimizer.step()`` could read a gradient the network has not finished
summing; dividing before the wait would divide a gradient the network is still writing.
Frozen parameters get no hook (``register_post_accumulate_grad_hook`` refuses them); a tied
parameter gets one hook, which fires once per backward, after both uses are summed.

A parameter that gets no gradient in a step never fires its hook; the finish call then raises
a ``RuntimeError`` naming it instead of leaving ranks waiting on each other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ddp_base import DDPBase
from torch import nn


class OverlapDDP(DDPBase):
    def __init__(self, module: nn.Module):
        super().__init__(module)
        # (handle, parameter) per launched all-reduce. Holding the parameter keeps its .grad,
        # the tensor being reduced, alive until wait() has returned.
        self.pending: list[tuple[dist.Work, nn.Parameter]] = []
        self.hook_handles = []
        self._register_hooks()

    def _register_hooks(self) -> None:
        """Hook every parameter of ``self.params`` so that, when its gradient is ready and
        ``self.require_sync`` is True, an async all-reduce of that gradient is launched and
        recorded in ``self.pending`` as ``(handle, parameter)``."""
        # BEGIN SOLUTION 05.4: a post-accumulate-grad hook per parameter launches an async all-reduce
        def hook(param: torch.Tensor) -> None:
            if self.require_sync:
                work = dist.all_reduce(param.grad, async_op=True)
                self.pending.append((work, param))

        for p in self.params:
            self.hook_handles.append(p.register_post_accumulate_grad_hook(hook))
        # END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Once it returns, every ``.grad`` of ``self.params`` is the mean over the ranks and
        ``self.pending`` is empty. A parameter that launched nothing raises a RuntimeError
        naming it. Does nothing when ``self.require_sync`` is False."""
        if not self.require_sync:
            return
        # BEGIN SOLUTION 05.5: check every parameter launched; finish each pending all-reduce; average
        launched = {id(p) for _, p in self.pending}
        missing = [self.names.get(id(p), "?") for p in self.params if id(p) not in launched]
        if missing:
            for work, _ in self.pending:  # let the launched ones finish before dropping them
                work.wait()
            self.pending.clear()
            raise RuntimeError(f"parameters got no gradient in this step (unused in forward?): "
                               f"{missing}; every rank must use every trainable parameter")
        for work, p in self.pending:
            work.wait()
            p.grad.div_(self.world_size)
        self.pending.clear()
        # END SOLUTION
