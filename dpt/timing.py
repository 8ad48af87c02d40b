"""Clocks for timing collectives where they run: the host's on the CPU, CUDA events on a GPU.

A host stamp (``time.perf_counter()``) says when the host did something. With gloo on the CPU
that is when the work ran, and a collective's handle completes when its data has arrived. On a
GPU the host only queues kernels, and NCCL's handles say nothing about the device: the future
of ``Work.get_future()`` is completed when the collective is queued (its callbacks run at
once) and ``Work.wait()`` only makes the current stream wait. Every collective then "ends"
when it is issued, and no host stamp sees the compute stream sitting at a wait.

A clock hands out *stamps* and turns them into seconds on one axis, the host's
``time.perf_counter()`` (which the processes of one machine share), so that every rank and
every kind of stamp can be drawn together:

- :class:`HostClock` (gloo, CPU tensors): stamps are ``time.perf_counter()`` floats; a
  collective ends when its future's callback runs.
- :class:`CudaClock` (CUDA tensors): a stamp is a CUDA event recorded on the current stream,
  so it marks when the *device* reached that point of the work queued. With NCCL a
  collective's end is an event recorded inside a callback of its future: PyTorch runs such a
  callback on streams it has made wait for the collective's kernels (see
  ``torch.futures.Future.then``), so the event completes when the collective does, and the
  compute stream is not held up. With gloo on CUDA tensors (ranks sharing a GPU,
  ``DPT_SHARE_GPU=1``) a collective runs on gloo's CPU thread: its end stays the host's stamp.

What blocks compute at a wait, on a GPU: a stamp just before ``wait()`` and one just after it,
both on the current stream; the second completes when the stream has passed the wait, that is
when the collective has ended (or at once, if it had). Their difference is the time the
stream sat there, ``max(0, end of the collective - the moment the stream reached the wait)``.
On the host the same two stamps time the host blocked in ``wait()``.

Device stamps are read after the work is done: :meth:`CudaClock.settle` synchronizes and
records a reference event at a known host instant; a stamp's seconds are that instant minus
the device time between the stamp and the reference. Every clock can be replaced by a test's
fake: a recorder asks its clock for everything (``now``, ``host_now``, ``on_end``, ``seconds``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class HostClock:
    """Stamps are ``time.perf_counter()`` seconds: when the host did something. The right clock
    for gloo with CPU tensors, where the host does the work."""

    name = "host"
    on_device = False

    def now(self) -> float:
        """A stamp of now (read at call time: a test's patched ``time.perf_counter`` is used)."""
        return time.perf_counter()

    def host_now(self) -> float:
        """Now on the host, whatever the clock: when the host saw something happen."""
        return time.perf_counter()

    def on_end(self, work, note: Callable[[Any], None]) -> bool:
        """Call ``note(stamp)`` when the collective of handle ``work`` has ended: here, when
        its future completes (at once, if it has). False where the handle has no future (the
        caller must find the end otherwise: ``is_completed()``, or its wait)."""
        try:
            future = work.get_future()
        except (RuntimeError, AttributeError):
            return False
        future.then(lambda _fut: note(self.host_now()))
        return True

    def settle(self) -> None:
        """Make every stamp taken so far readable (nothing to do on the host)."""

    def seconds(self, stamp) -> float | None:
        """A stamp as ``time.perf_counter()`` seconds (None stays None)."""
        return None if stamp is None else float(stamp)


class CudaClock(HostClock):
    """Stamps are CUDA events recorded on the current stream of ``device``: when the device
    reached that point. ``device_ends``: a collective's end comes from the device (NCCL); else
    (gloo on CUDA tensors, which communicates on the CPU) it is the host's stamp when its
    future completes."""

    name = "cuda"
    on_device = True

    def __init__(self, device: torch.device | str | int | None = None, device_ends: bool = True):
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaClock times CUDA work, not {self.device}: use HostClock")
        self.device_ends = device_ends
        self._reference: tuple[Any, float] | None = None

    def now(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def on_end(self, work, note: Callable[[Any], None]) -> bool:
        try:
            future = work.get_future()
        except (RuntimeError, AttributeError):
            return False
        if self.device_ends:
            # the callback runs on streams made to wait for the collective's kernels: an event
            # recorded there completes when the collective does
            future.then(lambda _fut: note(self.now()))
        else:
            future.then(lambda _fut: note(self.host_now()))
        return True

    def settle(self) -> None:
        """Wait for the device, then record a reference event at a known host instant."""
        torch.cuda.synchronize(self.device)
        reference = torch.cuda.Event(enable_timing=True)
        reference.record(torch.cuda.current_stream(self.device))
        reference.synchronize()
        self._reference = (reference, time.perf_counter())

    def seconds(self, stamp) -> float | None:
        """A stamp as ``time.perf_counter()`` seconds: a host float as it is, an event through
        the reference of the last :meth:`settle` (taken after every event read)."""
        if stamp is None or isinstance(stamp, (int, float)):
            return None if stamp is None else float(stamp)
        if self._reference is None:
            raise RuntimeError("CudaClock.seconds before settle(): call settle() once the "
                               "work timed is queued, then read the stamps")
        reference, host = self._reference
        return host - stamp.elapsed_time(reference) / 1e3


def clock_for(device: torch.device | str | None = None, backend: str | None = None):
    """The clock for work on ``device`` (default: this rank's, ``dpt.dist.rank_device()``)
    under ``backend`` (default: the process group's, if there is one): :class:`CudaClock` for
    CUDA tensors, with device ends for NCCL only; :class:`HostClock` otherwise."""
    import torch.distributed as dist

    if device is None:
        from dpt.dist import rank_device

        device = rank_device()
    device = torch.device(device)
    if device.type != "cuda":
        return HostClock()
    if backend is None and dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
    return CudaClock(device, device_ends=backend == "nccl")
