"""A GPU and NCCL, simulated on the CPU, for the tests of what the lessons time on a device.

NCCL's handles tell the host nothing about the device: ``get_future()`` is completed when the
collective is queued (its callbacks run at once) and ``wait()`` returns at once, after making
the compute stream wait for the collective. A recorder that reads the host's clock at those
moments sees every collective end when it is issued and no time spent waiting.

:class:`FakeDevice` keeps two clocks, in seconds, that move only when a test says so:
``stream``, where the work queued on the compute stream so far ends on the device, and
``host``, the host's clock (which an NCCL-like program barely moves: it only queues work).
:class:`NcclLikeWork` is a handle as NCCL gives it, carrying the true end of its collective.
:class:`FakeDeviceClock` is ``dpt.timing.CudaClock`` on that device (stamps mark where the
compute stream is; a collective's end comes from its future's callback, which on CUDA runs on
a stream that waits for the collective), and :class:`FakeHostClock` is ``dpt.timing.HostClock``
on the device's host clock: what a recorder read before it timed the device.
"""

from __future__ import annotations

import torch

from dpt.timing import HostClock


class FakeDevice:
    def __init__(self, host: float = 100.0):
        self.stream = 0.0  # device seconds: the end of the work queued on the compute stream
        self.comm = 0.0  # the end of the collectives queued on the communication stream
        self.host = host  # host seconds

    def compute(self, seconds: float) -> None:
        """Queue a kernel of ``seconds`` on the compute stream (the host does not wait)."""
        self.stream += seconds

    def collective(self, seconds: float) -> NcclLikeWork:
        """Issue a collective of ``seconds`` on the communication stream: it starts once the
        compute queued so far and the collectives issued before it are done."""
        self.comm = max(self.stream, self.comm) + seconds
        return NcclLikeWork(self, self.comm)


class NcclLikeWork:
    """A handle complete as soon as it is issued; ``wait()`` returns at once and makes the
    compute stream wait for ``end``, the collective's true end on the device."""

    def __init__(self, device: FakeDevice, end: float):
        self.device, self.end = device, end
        self.future = torch.futures.Future()
        self.future.set_result(None)
        self.waited = 0

    def get_future(self):
        return self.future

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None) -> bool:
        self.waited += 1
        self.device.stream = max(self.device.stream, self.end)
        return True


class FakeStamp:
    """A CUDA event of the fake device: where the stream it was recorded on had got to."""

    def __init__(self, t: float):
        self.t = t


class FakeDeviceClock(HostClock):
    name = "cuda"
    on_device = True

    def __init__(self, device: FakeDevice, offset: float = 1000.0):
        self.device, self.offset = device, offset  # device second 0 is host second `offset`
        self.settled = False

    def now(self):
        return FakeStamp(self.device.stream)

    def host_now(self) -> float:
        return self.device.host

    def on_end(self, work, note) -> bool:
        # the callback runs at once, on a stream made to wait for the collective's kernels
        work.get_future().then(lambda _fut: note(FakeStamp(work.end)))
        return True

    def settle(self) -> None:
        self.settled = True

    def seconds(self, stamp):
        if stamp is None or isinstance(stamp, (int, float)):
            return None if stamp is None else float(stamp)
        assert self.settled, "a device stamp was read before settle(): the device may not be done"
        return self.offset + stamp.t


class FakeHostClock(HostClock):
    """The host's clock of a :class:`FakeDevice`."""

    def __init__(self, device: FakeDevice):
        self.device = device

    def now(self) -> float:
        return self.device.host

    def host_now(self) -> float:
        return self.device.host
