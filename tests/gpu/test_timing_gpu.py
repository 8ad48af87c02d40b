"""dpt.timing on a real GPU: an NCCL collective's end comes from the device.

NCCL's handle completes when the collective is queued: a host stamp in its future's callback
reads the issue. The collective itself waits for the compute queued before it, so on the
device it ends after that compute. One rank (a world of one on NCCL) is enough to see it.
Skipped without CUDA; `make gpu-check` runs it with the other GPU tests.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_an_nccl_collective_ends_after_the_compute_queued_before_it(monkeypatch):
    import torch.distributed as dist

    from dpt.dist import group_of_one
    from dpt.timing import CudaClock

    monkeypatch.delenv("DPT_SHARE_GPU", raising=False)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with group_of_one(device):
        assert dist.get_backend() == "nccl"
        clock = CudaClock(device)
        a = torch.randn(4096, 4096, device=device)
        x = torch.ones(2**20, device=device)
        dist.all_reduce(x)  # NCCL's communicator is made on first use
        torch.cuda.synchronize(device)
        start = clock.now()
        for _ in range(40):  # tens of ms of compute, queued in well under one
            a = a @ a / 64
        computed = clock.now()
        work = dist.all_reduce(x, async_op=True)
        ends, host_ends = [], []
        assert clock.on_end(work, ends.append)
        work.get_future().then(lambda _fut: host_ends.append(time.perf_counter()))
        before = clock.now()
        work.wait()
        after = clock.now()
        clock.settle()
    sec = clock.seconds
    compute_s = sec(computed) - sec(start)
    assert compute_s > 0.005, f"the matmuls took {compute_s * 1e3:.2f} ms: too short to tell"
    assert host_ends and host_ends[0] < sec(computed) - compute_s / 2, (
        "the host callback was expected to run at issue, long before the device got there")
    assert ends and sec(ends[0]) >= sec(computed) - 1e-4, (
        f"the all-reduce ended at {sec(ends[0]) - sec(start):.4f} s on the device clock, before "
        f"the compute queued before it ({compute_s:.4f} s): the end must be the device's")
    assert sec(after) >= sec(ends[0]) - 1e-4 and sec(after) >= sec(before)
