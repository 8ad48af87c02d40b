"""The rank function of lesson 12's bandwidth tests (test_bandwidth.py): task 12.6 on 2 ranks.

One launch, three parts, each on its own (``rank_part``):

- ``real``: ``time_collective`` of every collective at ``SIZE`` bytes, with the
  ``torch.distributed`` calls recorded (which function, the bytes of its input and output, the
  device), so the test counts the tensors the student built;
- ``fake_device``: a pretend asynchronous device on a pretend clock, so timing mistakes show
  deterministically, whatever the machine's load. Module ``time`` and ``synchronize`` of the
  lesson are replaced on this rank: the clock stands still except when the device finishes
  work. Each broadcast (the timed operation) only *queues* ``COST`` seconds of work, which
  ``synchronize`` then waits for; the first call also queues ``SETUP`` seconds (a first NCCL
  call sets up its communicator). Rank 1 returns ``LATE`` seconds after the others from each
  call. The right time is then exactly ``COST + LATE`` on both ranks;
- ``fake_median``: the same clock, no set-up and nobody late, the calls costing ``CYCLE[0]``,
  ``CYCLE[1]``, ... in turn: any 3 consecutive calls have the median ``CYCLE`` median.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from tests.helpers import rank_part
from tests.lessons import load

LESSON = "12_step_cost"
N = 2
SIZE = 4096  # bytes: S/N = 2048 for the chunks
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
FAKE_OP, FAKE_SIZE = "broadcast", 64
COST, SETUP, LATE = 0.004, 1.0, 0.002
CYCLE = (0.003, 0.001, 0.008)  # median 0.003, mean 0.004, min 0.001
RECORDED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
            "all_gather", "reduce_scatter", "barrier")


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _in_out(name: str, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(input bytes, output bytes) of one recorded call (the same tensor in place)."""
    if name in ("all_reduce", "broadcast"):
        t = args[0] if args else kwargs.get("tensor")
        return _nbytes(t), _nbytes(t)
    if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):  # (output, input)
        out = args[0] if args else kwargs.get("output_tensor", kwargs.get("output"))
        inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
        return _nbytes(inp), _nbytes(out)
    if name == "all_gather":  # (tensor_list, tensor)
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("tensor")), _nbytes(args[0])
    if name == "reduce_scatter":  # (output, input_list)
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input_list")), _nbytes(args[0])
    return 0, 0


class Recorder:
    """Wraps ``torch.distributed``'s collectives while in use; ``after(name, args, kwargs)``
    runs after each real call."""

    def __init__(self, after=None):
        self.calls: list[dict] = []
        self.after = after
        self.real = {name: getattr(dist, name) for name in RECORDED}

    def __enter__(self):
        for name, fn in self.real.items():
            setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(dist, name, fn)

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs)
            op = args[1] if name == "all_reduce" and len(args) > 1 else kwargs.get("op")
            first = args[0] if args else next(iter(kwargs.values()), None)
            device = first.device.type if isinstance(first, torch.Tensor) else None
            inp, out = _in_out(name, args, kwargs)
            self.calls.append({"fn": name, "in": inp, "out": out, "device": device,
                               "max": op == dist.ReduceOp.MAX})
            if self.after is not None:
                self.after(name, args, kwargs)
            return result
        return wrapped


def real_part(bw) -> dict:
    from dpt.dist import rank_device

    out = {"device": rank_device().type}
    for op in OPS:
        with Recorder() as rec:
            res = bw.time_collective(op, SIZE, repeats=3, warmup=1)
        out[op] = {"result": res, "calls": [c for c in rec.calls if c["fn"] != "barrier"]}
    return out


class FakeDevice:
    """The pretend clock and device of one rank (see the module's docstring)."""

    def __init__(self, rank: int, costs, setup: float, late: float):
        self.rank, self.costs, self.setup, self.late = rank, costs, setup, late
        self.now = 100.0
        self.queued = 0.0
        self.calls = 0
        self.syncs = 0
        self.barriers = 0

    def clock(self) -> float:
        return self.now

    def synchronize(self, device=None) -> None:
        self.syncs += 1
        self.now += self.queued
        self.queued = 0.0

    def after(self, name, args, kwargs) -> None:
        if name == "barrier":
            self.barriers += 1
            return
        if name != FAKE_OP:
            return
        t = args[0] if args else kwargs.get("tensor")
        if t.numel() * t.element_size() != FAKE_SIZE:
            return  # not the timed buffer
        self.queued += self.costs[self.calls % len(self.costs)]
        if self.calls == 0:
            self.queued += self.setup
        self.calls += 1
        if self.rank == 1:
            self.now += self.late  # this rank returns later than the others


def fake_part(bw, rank: int, costs, setup: float, late: float, repeats: int,
              warmup: int) -> dict:
    fake = FakeDevice(rank, costs, setup, late)
    clock = types.SimpleNamespace(perf_counter=fake.clock, monotonic=fake.clock,
                                  time=fake.clock)
    real_time, real_sync = bw.time, bw.synchronize
    bw.time, bw.synchronize = clock, fake.synchronize
    try:
        with Recorder(after=fake.after) as rec:
            res = bw.time_collective(FAKE_OP, FAKE_SIZE, repeats=repeats, warmup=warmup)
    finally:
        bw.time, bw.synchronize = real_time, real_sync
    return {"result": res, "calls": fake.calls, "syncs": fake.syncs,
            "barriers": fake.barriers, "max_calls": sum(c["max"] for c in rec.calls)}


def bandwidth_checks(rank: int, world_size: int) -> dict:
    bw = load(LESSON, "bandwidth")
    return {"real": rank_part(real_part, bw),
            "fake_device": rank_part(fake_part, bw, rank, (COST,), SETUP, LATE, 2, 1),
            "fake_median": rank_part(fake_part, bw, rank, CYCLE, 0.0, 0.0, 3, 1)}
