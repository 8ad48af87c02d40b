"""Lesson 13: fewer bytes per sync, the pseudo-gradient sent in 16 or 8 bits.

DiLoCo's Δ̄ (``diloco.py``) is an average of N tensors of P fp32 values. The outer optimizer
does not need all 24 bits of their mantissas: OpenDiLoCo (arXiv 2407.07852) all-reduced it in
fp16 "without loss", Streaming DiLoCo (arXiv 2501.18512) in 4-bit floats, torchft quantises it
to fp8 (int8 before Hopper) in GPU kernels. This file sends it three ways, each counted:

- **fp16 / bf16** (:func:`average_cast_`): cast, all-reduce, cast back: half the bytes. fp16
  keeps 10 mantissa bits but tops out at 65504: the *sum* of N values overflows long before
  one does (3 ranks at 3e4: 9e4 is ``inf``, measured on gloo). Divide by N in fp32 first, then
  cast: the all-reduce sums values whose total is the mean. bf16 has fp32's range (no
  overflow) and 7 mantissa bits (a relative error up to 2⁻⁸ per cast).
- **int8 with a scale per block** (:func:`quantize_int8`, :func:`average_int8_`): per block
  of ``block`` values, ``scale = max|x| / 127``, ``q = round(x / scale)`` in [−127, 127];
  ``x̂ = q · scale`` is within ``scale / 2`` of x (rounding, not truncation, which errs up to
  a whole scale). The largest value of the block maps to ±127 exactly; an all-zero block gets
  scale 1 (0/0 would be NaN). An outlier only spoils its own block. A quarter of the bytes,
  plus 4 bytes of scale per block: ``n + 4·⌈n/block⌉``.

int8 cannot be *summed* on the wire: an int8 all-reduce wraps around (gloo: 100 + 100 = −56;
and every rank has its own scales, so the q's are not even in the same unit). So each rank
all-gathers every rank's q and scales, dequantises each in fp32 and averages them itself. The
payload is a quarter; the wire is not: an all-gather of ``B`` bytes per rank sends ``(N−1)·B``
per rank on a ring, where an all-reduce of ``4B`` sends ``2(N−1)/N·4B``. At N = 3 that is
2·117 = 234 bytes against 538.7 for fp32's 404 (the lesson's 101 values); at N = 9, 936
against 718: the all-gather's cost grows with N. torchft's quantised all-reduce keeps
``2(N−1)/N`` of the int8 size (an all-to-all of chunks, each rank reducing its own chunk in
fp32, then an all-gather of the int8 results: a reduce-scatter by hand) and needs a GPU.
``local_sgd.CommCounter.wire`` gives both figures.

Your tasks:

- 13.8 :func:`average_cast_`: the average sent in fp16 or bf16, divided by N before the cast;
- 13.9 :func:`quantize_int8` and :func:`dequantize_int8`: per-block int8 with its error bound;
- 13.10 :func:`average_int8_`: the average of int8 payloads, gathered and summed in fp32.

Given: the CLI: on ``--nproc`` ranks it averages the same random pseudo-gradient (one rank's
values 10x the others', an outlier in its first block) with fp32 (13.1), fp16, bf16 and int8,
and prints the bytes each rank puts in and sends, and the error against the exact mean::

    .venv/bin/python solutions/13_local_sgd/compress.py --nproc 3
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import sys
import time
from collections.abc import Sequence

import local_sgd  # the lesson's sibling, by module name: flat, unflat_, average_, CommCounter
import torch
import torch.distributed as dist

from dpt.cli import check_averaging_ranks

BLOCK = 256  # values per int8 scale (a block of 256 fp32 values: 1 KB -> 260 bytes)
CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in CAST:
            raise ValueError(f"unknown dtype {dtype!r}: fp16 or bf16")
        return CAST[dtype]
    if dtype not in CAST.values():
        raise ValueError(f"average_cast_ sends fp16 or bf16, got {dtype}")
    return dtype


# --- 13.8 half the bytes ---------------------------------------------------------------------------

def average_cast_(tensors: Sequence[torch.Tensor], dtype: torch.dtype | str, group=None) -> int:
    """Replace each tensor by its mean over the ranks, the all-reduce done in ``dtype``
    (``torch.float16``/``"fp16"`` or ``torch.bfloat16``/``"bf16"``): one flat buffer
    (``local_sgd.flat``), divided by the group's size BEFORE the cast (fp16 overflows at
    65504), cast, all-reduced, cast back into the tensors (``local_sgd.unflat_``). Returns the
    bytes this rank put in: numel × 2."""
    dtype = _dtype(dtype)
    if not tensors:
        return 0
    # BEGIN SOLUTION 13.8: cast to fp16/bf16 AFTER dividing by N (fp16 overflows at 65504), all_reduce, cast back into the fp32 tensors; return bytes (half of 13.1's)
    buffer = local_sgd.flat(tensors)
    buffer = (buffer / dist.get_world_size(group)).to(dtype)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    local_sgd.unflat_(buffer, tensors)  # copy_ casts back to the tensors' dtype
    return buffer.numel() * buffer.element_size()
    # END SOLUTION


# --- 13.9 int8 with a scale per block ---------------------------------------------------------------

def quantize_int8(t: torch.Tensor, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` flattened, in blocks of ``block`` values (the last one shorter): per block
    ``scale = max|x| / 127`` as fp32 (1 for an all-zero block), ``q = round(x / scale)``
    clamped to [−127, 127] as int8. Returns ``(q, scales)``: ``q`` of ``t.numel()`` int8
    values, ``scales`` of ``⌈numel / block⌉`` fp32 values. Every value then comes back from
    :func:`dequantize_int8` within ``scale / 2`` of itself; the largest of a block as ±127."""
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    # BEGIN SOLUTION 13.9: per block of `block` elements: scale = absmax/127 (1 for an all-zero block), q = round(x/scale) clamped to ±127, int8; error per element ≤ scale/2
    work = torch.promote_types(t.dtype, torch.float32)  # fp64 stays fp64, the rest fp32
    x = t.detach().reshape(-1).to(work)
    n = x.numel()
    nblocks = -(-n // block)
    padded = torch.zeros(nblocks * block, dtype=work)
    padded[:n] = x
    rows = padded.view(nblocks, block)
    scales = (rows.abs().amax(dim=1) / 127).float()
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / scales.to(work)[:, None]).clamp_(-127, 127)
    return q.to(torch.int8).reshape(-1)[:n], scales
    # END SOLUTION


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, shape: Sequence[int] | torch.Size,
                    block: int = 256, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q · scale`` of its block, in ``dtype`` (None: fp32), shaped ``shape`` (the inverse
    of :func:`quantize_int8` up to its rounding, with the same ``block``)."""
    dtype = torch.float32 if dtype is None else dtype
    n = q.numel()
    if scales.numel() != -(-n // block):
        raise ValueError(f"{n} values in blocks of {block} need {-(-n // block)} scales, got "
                         f"{scales.numel()}: the same block as quantize_int8?")
    # BEGIN SOLUTION 13.9: each value times its block's scale (value i is in block i // block), in dtype, reshaped
    per_value = scales.to(dtype).repeat_interleave(block)[:n]
    return (q.to(dtype) * per_value).reshape(shape)
    # END SOLUTION


def payload_bytes(n: int, block: int = 256) -> int:
    """The bytes of one rank's int8 payload for ``n`` values: n of q, 4 per block's scale."""
    return n + 4 * -(-n // block)


# --- 13.10 the int8 average ---------------------------------------------------------------------------

def average_int8_(tensors: Sequence[torch.Tensor], group=None, block: int = 256) -> int:
    """Replace each tensor by its mean over the ranks, each rank sending its values as int8
    with a scale per block (:func:`quantize_int8`): ONE ``dist.all_gather`` of
    one int8 payload per rank (its scales' bytes and its q), then every rank's q dequantised
    with THAT rank's scales and the N results averaged in fp32 (fp64 tensors: fp64). Never an
    int8 all-reduce: the sums wrap. Returns the payload bytes, ``n + 4·⌈n/block⌉``."""
    if not tensors:
        return 0
    # BEGIN SOLUTION 13.10: quantise (13.9), all_gather every rank's q and scales, dequantise each and average in fp32; never all_reduce int8 (gloo wraps: measured 100+100 = −56); return payload bytes n + 4·⌈n/block⌉
    x = local_sgd.flat(tensors)
    n, world = x.numel(), dist.get_world_size(group)
    q, scales = quantize_int8(x, block)
    payload = torch.cat([scales.view(torch.int8), q])  # 4 bytes a scale, then n of q
    gathered = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(gathered, payload, group=group)
    work = torch.promote_types(x.dtype, torch.float32)
    total = torch.zeros(n, dtype=work)
    k = 4 * scales.numel()
    for row in gathered:  # rank r's payload: its scales, then its q
        total += dequantize_int8(row[k:], row[:k].view(torch.float32), (n,), block, work)
    local_sgd.unflat_(total / world, tensors)
    return payload.numel()
    # END SOLUTION


# --- given: the CLI ---------------------------------------------------------------------------------

def pseudo_gradient(rank: int, numel: int, seed: int = 0) -> torch.Tensor:
    """A made-up Δ of rank ``rank``: N(0, 1e-3²) values, rank 1's ten times larger, and an
    outlier of 0.5 in rank 0's first block (an outlier spoils only its own block)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = 1e-3 * torch.randn(numel, generator=g) * (10 if rank == 1 else 1)
    if rank == 0:
        x[3] = 0.5
    return x


def compare_worker(rank: int, world_size: int, numel: int, block: int) -> dict:
    """Each method's payload bytes, ring bytes and error against the exact mean (fp64)."""
    exact = sum(pseudo_gradient(r, numel).double() for r in range(world_size)) / world_size
    out = {}
    methods = {"fp32": lambda t: local_sgd.average_([t]),
               "fp16": lambda t: average_cast_([t], torch.float16),
               "bf16": lambda t: average_cast_([t], torch.bfloat16),
               "int8": lambda t: average_int8_([t], block=block)}
    for name, fn in methods.items():
        t = pseudo_gradient(rank, numel)
        with local_sgd.CommCounter() as counter:
            fn(t)
        err = (t.double() - exact).abs()
        out[name] = {"bytes": counter.bytes, "wire": counter.wire(world_size),
                     "max_err": err.max().item(), "mean_err": err.mean().item(),
                     "ops": sorted({op for op, _, _ in counter.records})}
    # int8's bound: per value, the sum over the ranks of their block's scale/2, over N
    scales = torch.stack([quantize_int8(pseudo_gradient(r, numel), block)[1]
                          for r in range(world_size)])
    bound = (scales.double() / 2).sum(0).repeat_interleave(block)[:numel] / world_size
    out["int8_within_bound"] = bool((err <= bound + 1e-9).all())  # err: int8's, the last
    out["int8_bound_max"] = bound.max().item()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=3, help="ranks (gloo on the CPU)")
    ap.add_argument("--numel", type=int, default=101_770,
                    help="values per rank (default: dpt.models.MLP's parameters)")
    ap.add_argument("--block", type=int, default=BLOCK, help="values per int8 scale")
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args(argv)
    try:
        check_averaging_ranks(args.nproc)
        if args.numel < 1 or args.block < 1:
            raise ValueError("--numel and --block must be at least 1")
        from dpt.ranks import run_distributed

        t0 = time.perf_counter()
        ranks = run_distributed(compare_worker, world_size=args.nproc, timeout=args.timeout,
                                backend="gloo", echo=False,
                                kwargs={"numel": args.numel, "block": args.block})
    except (ValueError, RuntimeError, OSError) as exc:
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    res, n = ranks[0], args.nproc
    print(f"The mean of {n} ranks' pseudo-gradients of {args.numel:,} values (rank 1's ten "
          f"times larger, an outlier in rank 0's first block), int8 blocks of {args.block} "
          f"({time.perf_counter() - t0:.1f} s)")
    fp32 = res["fp32"]
    print(f"  {'method':<6} {'collective':<24} {'payload B':>10} {'/ fp32':>7} "
          f"{'ring B sent':>12} {'/ fp32':>7} {'max error':>10} {'mean error':>10}")
    for name in ("fp32", "fp16", "bf16", "int8"):
        r = res[name]
        print(f"  {name:<6} {', '.join(r['ops']):<24} {r['bytes']:>10,} "
              f"{r['bytes'] / fp32['bytes']:>7.3f} {r['wire']:>12,.0f} "
              f"{r['wire'] / fp32['wire']:>7.3f} {r['max_err']:>10.1e} {r['mean_err']:>10.1e}")
    print(f"int8 payload = n + 4·⌈n/{args.block}⌉ = {payload_bytes(args.numel, args.block):,} "
          f"bytes; every value within Σ_r scale_r/2 / N of the exact mean "
          f"(at most {res['int8_bound_max']:.1e}): {res['int8_within_bound']}")
    print(f"an all-gather sends (N−1)·B per rank, an all-reduce 2(N−1)/N·B: at N = {n} int8's "
          f"wire is {res['int8']['wire'] / fp32['wire']:.2f} of fp32's, not "
          f"{res['int8']['bytes'] / fp32['bytes']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
