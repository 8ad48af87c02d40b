"""Lesson 09: what schedule.py's recorder reads, on the host and on a (simulated) GPU.

With NCCL a collective's handle completes when the collective is queued and ``wait()`` returns
at once: a recorder that stamps ends in a future callback and waits with the host's clock sees
every gather end when it is issued and the compute never wait, with or without prefetch.
These tests run the recorder's own code (``schedule.Timeline``, the wrappers ``schedule.record``
puts on an FSDP object and its units from outside, around the given ``fsdp_by_hand.Unit.wait``)
on tests/fake_device.py's NCCL-like handles, whose collectives end at known device times, once
on the host's clock and once on the device's. Nothing here depends on the machine's speed.
"""

from __future__ import annotations

import types

import pytest

from tests.fake_device import FakeDevice, FakeDeviceClock, FakeHostClock
from tests.lessons import load

LESSON = "09_fsdp"
GATHER_S = 0.050  # each all-gather takes 50 ms on the device


def one_step(device, clock, prefetch: bool) -> list[dict]:
    """Two blocks' forward as FSDP runs it, 30 ms of compute each, every gather 50 ms:
    the recorder's events, in seconds."""
    schedule = load(LESSON, "schedule")
    timeline = schedule.Timeline(clock=clock)
    timeline.on = True
    units = [fake_unit(f"blocks.{i}", device) for i in range(2)]
    for unit in units:
        schedule.watch_unit(unit, timeline)
    for i, unit in enumerate(units):
        if unit.handle is None:
            unit.handle = unit.gather()
        if prefetch and i + 1 < len(units):
            units[i + 1].handle = units[i + 1].gather()
        unit.wait()  # the given wait, wrapped: the handle waited, the wait logged
        timeline.open(unit.name, "forward")
        device.compute(0.030)
        timeline.close(unit.name, "forward")
    return timeline.events


def fake_unit(name: str, device):
    """A unit whose collectives run on the fake device, with fsdp_by_hand's given waits."""
    fbh = load(LESSON, "fsdp_by_hand")
    unit = types.SimpleNamespace(name=name, handle=None, grad_handle=None, grad_full=None)
    unit.gather = lambda: device.collective(GATHER_S)
    unit.reduce_scatter = lambda: device.collective(GATHER_S / 2)
    unit.free = lambda: None
    unit.wait = types.MethodType(fbh.Unit.wait, unit)
    unit.wait_grad = types.MethodType(fbh.Unit.wait_grad, unit)
    return unit


def waiting(events) -> float:
    return sum(e["end"] - e["start"] for e in events if e["kind"] == "wait")


def test_on_an_nccl_like_handle_the_host_clock_sees_no_waiting():
    """What the recorder read on a GPU before it timed the device (the host's clock): every
    gather ends when it is issued, and the compute never waits."""
    device = FakeDevice()
    events = one_step(device, FakeHostClock(device), prefetch=False)
    gathers = [e for e in events if e["kind"] == "gather"]
    assert [e["end"] - e["start"] for e in gathers] == [0.0, 0.0]
    assert waiting(events) == 0.0
    assert device.stream == pytest.approx(2 * (GATHER_S + 0.030)), (
        "the simulated device did wait: the host's clock cannot see it")


@pytest.mark.parametrize("prefetch, blocked", [(False, 2 * GATHER_S),
                                               (True, GATHER_S + (GATHER_S - 0.030))])
def test_on_the_device_clock_gathers_end_and_waits_last_as_on_the_device(prefetch, blocked):
    """The same step on the device's clock: the gathers end where they ended on the device,
    and the compute waits for what it did not hide (without prefetch every gather; with it,
    the first one and the 20 ms of the second that 30 ms of compute did not cover)."""
    schedule = load(LESSON, "schedule")
    device = FakeDevice()
    clock = FakeDeviceClock(device)
    events = one_step(device, clock, prefetch)
    gathers = [e for e in events if e["kind"] == "gather"]
    # without prefetch: 0-50 ms, then (after 30 ms of compute) 80-130; with it, one after the
    # other on the communication stream: 0-50 and 50-100
    ends = [0.050, 0.100] if prefetch else [0.050, 0.130]
    assert [e["end"] - clock.offset for e in gathers] == pytest.approx(ends), (
        f"gathers {gathers}: a collective's end must be its end on the device (the clock's "
        "on_end), not the moment its NCCL-like future completed")
    assert all(not e.get("end_at_wait") for e in gathers)
    assert waiting(events) == pytest.approx(blocked), (
        f"waits {[e for e in events if e['kind'] == 'wait']}: a wait lasts from the moment the "
        "compute stream reached wait() to the moment it went on")
    assert schedule.summary(events)["waiting"] == pytest.approx(blocked)
    assert {e["clock"] for e in events} == {"cuda"}
    assert all(isinstance(e[k], float) for e in events for k in ("start", "end")), (
        "Timeline.events must hand out seconds, not the clock's stamps")
    assert min(e["start"] for e in events) == pytest.approx(clock.offset), (
        "the stamps are read through the clock's seconds()")
    assert "cuda" in schedule.clock_of(events) or "GPU" in schedule.clock_of(events)


def test_prefetch_shows_on_the_device_clock_only():
    """The lesson's claim, on a simulated GPU: prefetch cuts the waiting on the device's clock;
    on the host's it reads zero either way."""
    host = {p: waiting(one_step(d, FakeHostClock(d), p)) for p, d in
            ((True, FakeDevice()), (False, FakeDevice()))}
    dev = {p: waiting(one_step(d, FakeDeviceClock(d), p)) for p, d in
           ((True, FakeDevice()), (False, FakeDevice()))}
    assert host == {True: 0.0, False: 0.0}
    assert dev[True] < dev[False]


def test_a_gloo_handle_without_a_future_ends_at_its_wait():
    """gloo's reduce-scatter handles have no future: the end is first seen at the wait, and
    the event says so (end_at_wait) on the host's clock."""
    schedule = load(LESSON, "schedule")

    class NoFuture:
        def get_future(self):
            raise RuntimeError("no future for this work")

        def is_completed(self):
            return False

        def wait(self):
            device.host += 0.004

    device = FakeDevice()
    timeline = schedule.Timeline(clock=FakeHostClock(device))
    timeline.on = True
    timeline.issued("blocks.0", "reduce_scatter", timeline.now(), NoFuture())
    with timeline.waiting("blocks.0"):
        NoFuture().wait()
    sent, wait = timeline.events
    assert sent["end"] == wait["end"] == pytest.approx(device.host) and sent["end_at_wait"]


def test_nothing_is_logged_or_stamped_while_recording_is_off():
    schedule = load(LESSON, "schedule")
    device = FakeDevice()
    timeline = schedule.Timeline(clock=FakeDeviceClock(device))
    assert timeline.now() is None
    with timeline.waiting("root"):
        pass
    timeline.open("root", "forward")
    timeline.close("root", "forward")
    assert timeline.events == []


def test_the_prefetch_panels_share_one_time_axis(monkeypatch, tmp_path):
    """schedule.py's figure: prefetch on and off one above the other, on one x scale (a step
    twice as long must look twice as long)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedule = load(LESSON, "schedule")

    def step(ms):
        return [{"unit": "blocks.0", "kind": "compute", "phase": "forward", "start": 1.0,
                 "end": 1.0 + ms / 1e3, "clock": "host"}]

    monkeypatch.setattr(schedule, "record_step",
                        lambda n, prefetch, **kw: [step(100 if prefetch else 200)] * n)
    plt.close("all")
    assert schedule.main(["--out", str(tmp_path / "s.png")]) == 0
    top, bottom = plt.figure(plt.get_fignums()[-1]).axes
    assert top.get_xlim() == bottom.get_xlim() and top.get_xlim()[1] >= 200, (
        f"x ranges {top.get_xlim()} and {bottom.get_xlim()}: panels that are compared must share "
        "their time axis (sharex=True)")
    plt.close("all")


def fake_fsdp_class(device):
    """An FSDP-shaped class (the root and two blocks) whose step runs on the fake device, with
    the hooks called through the object, as fsdp_by_hand's module hooks call them."""

    class FakeFSDP:
        def __init__(self):
            self.root = fake_unit("root", device)
            self.units = [fake_unit(f"blocks.{i}", device) for i in range(2)]
            self.all_units = [self.root, *self.units]

        def forward(self):
            self.root.handle = self.root.gather()
            self.root.wait()
            for unit in self.units:
                self._pre_forward(unit)
                device.compute(0.030)
                self._post_forward(unit, None)

        def backward(self):
            for unit in reversed(self.units):
                self._pre_backward(unit)
                device.compute(0.030)
                self._post_backward(unit)
            self._post_backward(self.root)
            for unit in self.all_units:
                unit.wait_grad()

        def _pre_forward(self, unit):
            unit.handle = unit.gather()
            unit.wait()

        def _post_forward(self, unit, output):
            unit.free()

        def _pre_backward(self, unit):
            unit.handle = unit.gather()
            unit.wait()

        def _post_backward(self, unit):
            unit.grad_handle = unit.reduce_scatter()
            unit.free()

    return FakeFSDP


def test_record_wraps_one_object_from_outside_and_logs_its_step():
    """schedule.record(fsdp) logs one object's gathers, computes, frees, reduce-scatters and
    waits, each in its phase, without touching the class (fsdp_by_hand.py knows nothing of
    the recorder) or any other object; once per object; nothing while paused."""
    schedule = load(LESSON, "schedule")
    device = FakeDevice()
    FakeFSDP = fake_fsdp_class(device)
    written = {name: FakeFSDP.__dict__[name] for name in ("forward", *schedule.HOOKS)}
    fsdp, other = FakeFSDP(), FakeFSDP()
    timeline = schedule.record(fsdp, clock=FakeHostClock(device))
    fsdp.forward()
    fsdp.backward()
    other.forward()
    other.backward()
    assert {name: FakeFSDP.__dict__[name] for name in written} == written, (
        "record() changed the class: it must wrap the one object it is given")
    seen = [(e["kind"], e["unit"], e["phase"]) for e in timeline.events if e["kind"] != "wait"]
    f, b = "forward", "backward"
    assert seen == [
        ("gather", "root", f),
        ("gather", "blocks.0", f), ("compute", "blocks.0", f), ("free", "blocks.0", f),
        ("gather", "blocks.1", f), ("compute", "blocks.1", f), ("free", "blocks.1", f),
        ("gather", "blocks.1", b), ("compute", "blocks.1", b),
        ("reduce_scatter", "blocks.1", b), ("free", "blocks.1", b),
        ("gather", "blocks.0", b), ("compute", "blocks.0", b),
        ("reduce_scatter", "blocks.0", b), ("free", "blocks.0", b),
        ("reduce_scatter", "root", b), ("free", "root", b),
    ], seen
    waits = [e["unit"] for e in timeline.events if e["kind"] == "wait"]
    assert waits == ["root", "blocks.0", "blocks.1", "blocks.1", "blocks.0",
                     "root", "blocks.0", "blocks.1"], waits
    timeline.events.clear()
    fsdp.forward()  # after a backward: forward() starts the forward phase again
    assert timeline.events[0]["kind"] == "gather" and timeline.events[0]["phase"] == f
    timeline.events.clear()
    timeline.on = False
    fsdp.forward()
    assert timeline.events == []
    with pytest.raises(ValueError, match="already recorded"):
        schedule.record(fsdp)
