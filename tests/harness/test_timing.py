"""dpt.timing: which clock times collectives where, and how a CUDA event becomes host seconds.

No GPU here: torch.cuda's events are replaced by a fake whose device clock the test moves, and
the checks are on what the clock does with them (the stream it records on, the reference it
converts through). What the lessons' recorders read with these clocks is tested in the
lessons' folders, on tests/fake_device.py's simulated GPU.
"""

from __future__ import annotations

import time

import pytest
import torch

from dpt import timing


class _Device:
    """A GPU's timer and its current stream: ``t`` device seconds, moved by the test."""

    def __init__(self):
        self.t, self.stream, self.synchronized = 5.0, "compute", 0


@pytest.fixture
def fake_cuda(monkeypatch):
    dev = _Device()

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing, "an event that is read as a time needs enable_timing=True"
            self.t = self.stream = None

        def record(self, stream=None):
            self.t, self.stream = dev.t, stream

        def synchronize(self):
            pass

        def elapsed_time(self, end):  # ms from this event to `end`, as CUDA gives it
            return (end.t - self.t) * 1e3

    def synchronize(device=None):
        dev.synchronized += 1

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: dev.stream)
    return dev


class _Work:
    def __init__(self, future=True):
        self.future = torch.futures.Future() if future else None

    def get_future(self):
        if self.future is None:
            raise RuntimeError("this backend's work has no future")
        return self.future


def test_the_host_clock_stamps_perf_counter_and_ends_a_collective_at_its_future(monkeypatch):
    now = [10.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    clock = timing.HostClock()
    assert clock.now() == 10.0 and clock.seconds(clock.now()) == 10.0
    work, ends = _Work(), []
    assert clock.on_end(work, ends.append)
    now[0] = 12.5
    work.future.set_result(None)  # gloo: the future completes when the data has arrived
    assert ends == [12.5]
    assert not clock.on_end(_Work(future=False), ends.append), (
        "a handle without a future: on_end says so, the caller finds the end otherwise")


def test_a_cuda_stamp_is_an_event_on_the_current_stream_read_through_a_reference(
        fake_cuda, monkeypatch):
    clock = timing.CudaClock("cuda:0")
    first = clock.now()
    fake_cuda.t += 0.030  # 30 ms of work ran on the device
    second = clock.now()
    assert first.stream == "compute", "a stamp is recorded on the current (compute) stream"
    with pytest.raises(RuntimeError, match="settle"):
        clock.seconds(first)
    fake_cuda.t += 0.020
    monkeypatch.setattr(time, "perf_counter", lambda: 700.0)
    clock.settle()  # the device is done; the reference is recorded at host second 700
    assert fake_cuda.synchronized == 1
    assert clock.seconds(second) == pytest.approx(700.0 - 0.020)
    assert clock.seconds(second) - clock.seconds(first) == pytest.approx(0.030)
    assert clock.seconds(3.5) == 3.5 and clock.seconds(None) is None, (
        "host stamps (gloo's ends on a shared GPU) are already seconds")


def test_with_nccl_a_collective_ends_on_the_device_with_gloo_on_the_host(fake_cuda, monkeypatch):
    monkeypatch.setattr(time, "perf_counter", lambda: 42.0)
    nccl, gloo = timing.CudaClock("cuda:0"), timing.CudaClock("cuda:0", device_ends=False)
    ends = []
    for clock in (nccl, gloo):
        work = _Work()
        work.future.set_result(None)  # NCCL: complete at issue; the callback runs at once
        assert clock.on_end(work, ends.append)
    assert isinstance(ends[0], torch.cuda.Event), (
        "with NCCL the end must be an event recorded inside the future's callback (on the "
        "stream PyTorch made wait for the collective), not a host time")
    assert ends[1] == 42.0


def test_clock_for_picks_the_device_s_clock(monkeypatch):
    assert isinstance(timing.clock_for("cpu"), timing.HostClock)
    assert not isinstance(timing.clock_for("cpu", backend="gloo"), timing.CudaClock)
    nccl = timing.clock_for("cuda:1", backend="nccl")
    assert isinstance(nccl, timing.CudaClock) and nccl.device_ends
    assert nccl.device == torch.device("cuda", 1)
    shared = timing.clock_for("cuda:0", backend="gloo")  # ranks sharing a GPU
    assert isinstance(shared, timing.CudaClock) and not shared.device_ends
    with pytest.raises(ValueError, match="HostClock"):
        timing.CudaClock("cpu")
