"""Rank functions and shared data for lesson 13's compression tests (test_compress.py).

The tensors: the shapes of ``Linear(10, 7)`` and ``Linear(7, 3)``'s parameters, 101 values (odd,
and 3 int8 blocks of 32 plus one of 5). Every rank's values are a function of (rank, kind), so
the test recomputes every rank's input and the exact mean in its own process.

One launch, two parts in this order, each on its own (``rank_part``):

- ``cast``: the student's 13.8, fp16 and bf16, on values of 3e4 (the sum of 3 overflows fp16)
  and on random ones, every collective counted (``local_sgd.CommCounter``);
- ``int8``: the student's 13.10 with 13.9's reference, on float64 values whose size differs
  by rank (each rank's scales differ), an outlier of 1e3 in rank 0's first block.
"""

from __future__ import annotations

import torch

from tests.helpers import rank_part
from tests.lessons import load
from tests.references import put

LESSON = "13_local_sgd"
N = 3
SHAPES = ((7, 10), (7,), (3, 7), (3,))
NUMEL = 101
BLOCK = 32
BIG = 3e4  # 3 x 3e4 = 9e4 > 65504, fp16's largest


def values(rank: int, kind: str) -> torch.Tensor:
    """Rank ``rank``'s 101 values, flat: ``"big"`` 3e4 everywhere (float32), ``"random"``
    N(0, (rank + 1)²) (float32), ``"int8"`` N(0, (1 + 4·rank)²) float64 with 1e3 at index 5 of
    rank 0."""
    if kind == "big":
        return torch.full((NUMEL,), BIG)
    g = torch.Generator().manual_seed(100 * (rank + 1) + len(kind))
    if kind == "random":
        return torch.randn(NUMEL, generator=g) * (rank + 1)
    x = torch.randn(NUMEL, generator=g, dtype=torch.float64) * (1 + 4 * rank)
    if rank == 0:
        x[5] = 1e3
    return x


def tensors(rank: int, kind: str) -> list[torch.Tensor]:
    flat, out, start = values(rank, kind), [], 0
    for shape in SHAPES:
        n = torch.Size(shape).numel()
        out.append(flat[start:start + n].reshape(shape).clone())
        start += n
    return out


def _counted(fn, *args, **kwargs) -> dict:
    ls = load(LESSON, "local_sgd")
    with ls.CommCounter() as counter:
        sent = fn(*args, **kwargs)
    return {"sent": sent, "records": [(op, str(dt), b) for op, dt, b in counter.records],
            "wire": counter.wire(N)}


def _cast(rank: int) -> dict:
    cp = load(LESSON, "compress")
    out = {}
    for kind in ("big", "random"):
        for dtype in (torch.float16, torch.bfloat16):
            ts = tensors(rank, kind)
            res = _counted(cp.average_cast_, ts, dtype)
            res["result"] = torch.cat([t.reshape(-1) for t in ts])
            res["dtypes"] = sorted({str(t.dtype) for t in ts})
            out[f"{kind}/{str(dtype).split('.')[-1]}"] = res
    return out


def _int8(rank: int) -> dict:
    cp = load(LESSON, "compress")
    ts = tensors(rank, "int8")
    res = _counted(cp.average_int8_, ts, block=BLOCK)
    res["result"] = torch.cat([t.reshape(-1) for t in ts])
    res["dtypes"] = sorted({str(t.dtype) for t in ts})
    return res


def compress_checks(rank: int, world_size: int) -> dict:
    put(LESSON, ("13.1",))
    out = {"cast": rank_part(_cast, rank)}
    put(LESSON, ("13.9",))
    out["int8"] = rank_part(_int8, rank)
    return out
