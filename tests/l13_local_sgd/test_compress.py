"""Lesson 13, tasks 13.8-13.10: the pseudo-gradient sent in fp16, bf16 and int8, ``compress.py``.

13.9 (quantise and dequantise) is checked here in this process, against what the test works
out itself: the scales, the int8 values and the error bound of every block. 13.8 and 13.10 run
on 3 gloo ranks (``rank_fns_compress.py``: one launch, two parts); every collective is
counted (``local_sgd.CommCounter``: op, dtype, bytes) and every result compared with the exact
mean, which the test computes from every rank's input.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import checked_part, ranks_or_fail
from tests.l13_local_sgd import rank_fns_compress as rf
from tests.lessons import load

LESSON = rf.LESSON
N = rf.N
TIMEOUT = 250


@pytest.fixture(scope="module")
def cp():
    return load(LESSON, "compress")


@pytest.fixture(scope="module")
def runs():
    return ranks_or_fail(rf.compress_checks, N, timeout=TIMEOUT)


def exact_mean(kind: str) -> torch.Tensor:
    return sum(rf.values(r, kind).double() for r in range(N)) / N


def blocks_of(x: torch.Tensor, block: int) -> list[torch.Tensor]:
    return list(x.reshape(-1).double().split(block))


def my_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per block max|x| / 127 in fp32, 1 for an all-zero block: what quantize_int8 returns."""
    s = [(b.abs().max() / 127).float().item() for b in blocks_of(x, block)]
    return torch.tensor([v if v > 0 else 1.0 for v in s], dtype=torch.float32)


def my_quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    scales = my_scales(x, block)
    q = torch.cat([torch.round(b / s).clamp(-127, 127)
                   for b, s in zip(blocks_of(x, block), scales.double())])
    return q, scales


def per_value(scales: torch.Tensor, n: int, block: int) -> torch.Tensor:
    return scales.double().repeat_interleave(block)[:n]


# --- 13.9 int8 with a scale per block -----------------------------------------------------------

def quantize_case() -> torch.Tensor:
    """101 values in blocks of 32 (the last one 5): an outlier of 1e3 in block 0, block 2 all
    zeros, float64."""
    x = torch.randn(rf.NUMEL, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x[7] = 1e3
    x[64:96] = 0.0
    return x


@pytest.mark.task("13.9")
def test_quantize_int8_error_bound(cp):
    x, block = quantize_case(), rf.BLOCK
    q, scales = cp.quantize_int8(x, block)
    assert q.dtype == torch.int8 and q.numel() == x.numel(), (
        f"q must be {x.numel()} int8 values, got {q.numel()} of {q.dtype}")
    assert scales.dtype == torch.float32 and scales.numel() == 4, (
        f"⌈101/32⌉ = 4 fp32 scales expected, got {scales.numel()} of {scales.dtype}")
    want = my_scales(x, block)
    if scales[2].item() == 0 or not torch.isfinite(scales).all():
        pytest.fail(f"an all-zero block gave scale {scales[2].item()}: x / 0 is NaN (0/0), and "
                    "casting NaN to int8 is undefined (0 on this CPU by chance): give an "
                    "all-zero block scale 1", pytrace=False)
    absmax = torch.stack([b.abs().max() for b in blocks_of(x, block)]).float()
    if torch.allclose(scales[[0, 1, 3]], (absmax / 128)[[0, 1, 3]], rtol=1e-6):
        pytest.fail("scale = max|x| / 128: the largest element must map to ±127 (at 128 it is "
                    "clamped, and the scale is not the one dequantisation assumes): scale = "
                    "max|x| / 127", pytrace=False)
    assert torch.allclose(scales, want, rtol=1e-6), (
        f"scales {scales.tolist()}, expected max|x| / 127 per block of {block} (1 for the "
        f"all-zero block): {want.tolist()}")
    xhat = cp.dequantize_int8(q, scales, x.shape, block, torch.float64)
    assert xhat.shape == x.shape and xhat.dtype == torch.float64, (
        f"dequantize_int8 gave {tuple(xhat.shape)} {xhat.dtype}, expected {tuple(x.shape)} "
        "float64 (the shape and dtype it is asked for)")
    assert not torch.isnan(xhat).any(), "an all-zero block gave NaN after dequantisation"
    assert torch.equal(xhat[64:96], torch.zeros(32, dtype=torch.float64)), (
        "the all-zero block must come back as exact zeros")
    err = (x - xhat).abs()
    bound = per_value(scales, x.numel(), block) / 2 * (1 + 1e-9) + 1e-12
    bad = (err > bound).nonzero().reshape(-1)
    if len(bad):
        i = int(bad[0])
        ratio = x / per_value(scales, x.numel(), block)
        truncated = torch.equal(q.double(), torch.trunc(ratio).clamp(-127, 127))
        why = ("round, don't truncate (q is x/scale truncated toward 0)" if truncated else
               "q = round(x / scale), and x̂ = q · the scale of the value's block")
        pytest.fail(f"error above scale/2 at element {i} (block {i // block}): |x − x̂| = "
                    f"{err[i].item():.3g} > scale/2 = {bound[i].item():.3g}: {why}",
                    pytrace=False)
    big = int(x[:32].abs().argmax())
    assert abs(int(q[big])) == 127, (
        f"the largest element of block 0 ({x[big].item():g}) became q = {int(q[big])}: the "
        "largest element must map to ±127")
    # the outlier spoils its own block only: the other blocks' scales are their own max / 127
    assert scales[1].item() < 1e-1, "block 1's scale must not see block 0's outlier"


@pytest.mark.task("13.9")
def test_dequantize_restores_the_shape(cp):
    x = rf.tensors(1, "int8")[0]  # (7, 10), float64
    q, scales = cp.quantize_int8(x, 16)
    xhat = cp.dequantize_int8(q, scales, x.shape, 16)
    assert xhat.shape == x.shape and xhat.dtype == torch.float32, (
        f"dequantize_int8(q, scales, {tuple(x.shape)}, 16) gave {tuple(xhat.shape)} "
        f"{xhat.dtype}: the asked shape, fp32 by default")
    bound = per_value(scales, x.numel(), 16).reshape(x.shape) / 2
    assert ((x - xhat.double()).abs() <= bound * (1 + 1e-6) + 1e-7).all(), (
        "a (7, 10) tensor in blocks of 16 does not come back within scale/2")


# --- 13.8 fp16 / bf16 -----------------------------------------------------------------------------

@pytest.mark.task("13.8")
@pytest.mark.timeout(TIMEOUT + 50)
def test_average_cast_fp16_does_not_overflow(runs):
    for r, res in enumerate(runs):
        got = checked_part(res["cast"])["big/float16"]["result"]
        if not torch.isfinite(got).all():
            pytest.fail(f"rank {r}: 3 ranks of 3e4 averaged in fp16 gave {got[0].item()}: fp16 "
                        "overflow (the sum 9e4 > 65504): divide by N before the all-reduce",
                        pytrace=False)
        assert torch.equal(got, torch.full_like(got, rf.BIG)), (
            f"rank {r}: the mean of 3e4 on every rank is 3e4 (exact in fp16 when each rank "
            f"sends 1e4), got {got[:3].tolist()}")


@pytest.mark.task("13.8")
@pytest.mark.timeout(TIMEOUT + 50)
def test_average_cast_values_and_bytes(runs):
    want = exact_mean("random")
    scale = max(rf.values(r, "random").abs().max().item() for r in range(N))
    for r, res in enumerate(runs):
        part = checked_part(res["cast"])
        for name, dtype, eps in (("float16", torch.float16, 2**-11),
                                 ("bfloat16", torch.bfloat16, 2**-8)):
            got = part[f"random/{name}"]
            assert got["dtypes"] == ["torch.float32"], (
                f"rank {r}, {name}: the tensors became {got['dtypes']}: cast the result back "
                "into the fp32 tensors, in place")
            err = (got["result"].double() - want).abs().max().item()
            # each rank's cast, then N − 1 additions in the low precision: (N + 1) roundings
            assert err <= (N + 1) * eps * scale, (
                f"rank {r}, {name}: the mean is off by {err:.3g} (allowed {(N + 1) * eps * scale:.3g}"
                f" for {name}'s roundings): average over the ranks, one all-reduce")
            records = got["records"]
            assert records == [("all_reduce", str(dtype), 2 * rf.NUMEL)], (
                f"rank {r}, {name}: collectives {records}, expected ONE all_reduce of "
                f"{rf.NUMEL} {name} values ({2 * rf.NUMEL} bytes, half of fp32's "
                f"{4 * rf.NUMEL}): one flat buffer, cast before the all-reduce")
            assert got["sent"] == 2 * rf.NUMEL, (
                f"rank {r}, {name}: returned {got['sent']}, expected the bytes sent, "
                f"{2 * rf.NUMEL}")


# --- 13.10 the int8 average ---------------------------------------------------------------------

@pytest.mark.task("13.10")
@pytest.mark.timeout(TIMEOUT + 50)
def test_average_int8_within_bound(runs):
    xs = [rf.values(r, "int8") for r in range(N)]
    want = exact_mean("int8")
    quantized = [my_quantize(x, rf.BLOCK) for x in xs]
    bound = sum(per_value(s, rf.NUMEL, rf.BLOCK) / 2 for _, s in quantized) / N
    one_scale = sum(q * per_value(quantized[0][1], rf.NUMEL, rf.BLOCK)
                    for q, _ in quantized) / N
    for r, res in enumerate(runs):
        part = checked_part(res["int8"])
        int8_sums = [rec for rec in part["records"]
                     if rec[0] == "all_reduce" and rec[1] in ("torch.int8", "torch.uint8")]
        if int8_sums:
            pytest.fail(f"rank {r}: an all_reduce of int8 values ({int8_sums[0]}): int8 sums "
                        "wrap (100+100 = −56 on gloo): gather, then dequantise and average in "
                        "fp32", pytrace=False)
        got = part["result"]
        assert part["dtypes"] == ["torch.float64"], (
            f"rank {r}: the tensors became {part['dtypes']}: write the average back into them, "
            "in place")
        err = (got - want).abs()
        over = err > bound * (1 + 1e-9) + 1e-12
        if over.any():
            i = int(over.nonzero()[0])
            if torch.allclose(got, one_scale, rtol=1e-9, atol=1e-12):
                pytest.fail(f"rank {r}: every rank's q dequantised with rank 0's scales: use "
                            "every rank's own scales (gather them with its q)", pytrace=False)
            pytest.fail(f"rank {r}, value {i} (block {i // rf.BLOCK}): off the exact mean by "
                        f"{err[i].item():.3g}, beyond Σ_r scale_r/2 / N = {bound[i].item():.3g}: "
                        "dequantise every rank's q with every rank's own scales, then average "
                        "in fp32", pytrace=False)


@pytest.mark.task("13.10")
@pytest.mark.timeout(TIMEOUT + 50)
def test_average_int8_bytes(runs):
    payload = rf.NUMEL + 4 * -(-rf.NUMEL // rf.BLOCK)  # 101 + 4·4 = 117
    for r, res in enumerate(runs):
        part = checked_part(res["int8"])
        records = part["records"]
        ops = {op for op, _, _ in records}
        assert ops <= {"all_gather", "all_gather_into_tensor"}, (
            f"rank {r}: collectives {records}: every rank's q and scales are all-gathered "
            "(never an all-reduce: int8 sums wrap)")
        sent = sum(b for _, _, b in records)
        assert sent == payload, (
            f"rank {r}: {sent} bytes put into all-gathers, expected {payload} = {rf.NUMEL} of q "
            f"+ 4 bytes × {-(-rf.NUMEL // rf.BLOCK)} fp32 scales (blocks of {rf.BLOCK}): "
            f"{records}")
        assert part["sent"] == payload, (
            f"rank {r}: returned {part['sent']}, expected the payload bytes {payload}")
        # the wire: an all-gather sends (N − 1) x its input per rank; fp32's ring all-reduce
        # 2 (N − 1) / N x 404: 234 against 538.7, not a quarter
        assert part["wire"] == (N - 1) * payload


def test_cast_rejects_bad_dtype(cp):
    with pytest.raises(ValueError, match="fp16 or bf16"):
        cp.average_cast_([torch.zeros(2)], torch.int8)
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        cp.average_cast_([torch.zeros(2)], "fp8")
    with pytest.raises(ValueError, match="block must be at least 1"):
        cp.quantize_int8(torch.zeros(3), 0)
