"""Planted bugs of lesson 13, compress.py (format: tests/planted.py)."""

from tests.planted import Bug

F = "13_local_sgd/compress.py"
T = "tests/l13_local_sgd/test_compress.py::"
QUANTIZE = T + "test_quantize_int8_error_bound"
INT8 = T + "test_average_int8_within_bound"

BUGS = [
    Bug("13.8-no-prediv", F, where="13.8",
        find="    buffer = (buffer / dist.get_world_size(group)).to(dtype)\n"
             "    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)\n",
        replace="    buffer = buffer.to(dtype)\n"
                "    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)\n"
                "    buffer /= dist.get_world_size(group)\n",
        tests=(T + "test_average_cast_fp16_does_not_overflow",),
        expect=r"fp16 overflow \(the sum 9e4 > 65504\): divide by N before the all-reduce",
        why="the sum is taken in fp16 and divided after: 3 × 3e4 overflows to inf"),
    Bug("13.8-fp32-on-wire", F, where="13.8",
        find="    buffer = (buffer / dist.get_world_size(group)).to(dtype)\n",
        replace="    buffer = (buffer / dist.get_world_size(group)).to(dtype).float()\n",
        tests=(T + "test_average_cast_values_and_bytes",),
        expect=r"expected ONE all_reduce of 101 float16 values \(202 bytes",
        why="rounded to fp16 but sent as fp32: the error of fp16, the bytes of fp32"),
    Bug("13.9-truncate", F, where="13.9",
        find="    q = torch.round(rows / scales.to(work)[:, None]).clamp_(-127, 127)\n",
        replace="    q = torch.trunc(rows / scales.to(work)[:, None]).clamp_(-127, 127)\n",
        tests=(QUANTIZE,),
        expect=r"error above scale/2 .* round, don't truncate",
        why="x/scale truncated toward 0: errors up to a whole scale, biased toward 0"),
    Bug("13.9-scale-128", F, where="13.9",
        find="    scales = (rows.abs().amax(dim=1) / 127).float()\n",
        replace="    scales = (rows.abs().amax(dim=1) / 128).float()\n",
        tests=(QUANTIZE,),
        expect=r"the largest element must map to ±127",
        why="int8 goes to 127, not 128: max|x|/128 puts the largest element out of range"),
    Bug("13.9-zero-block", F, where="13.9",
        find="    scales = torch.where(scales > 0, scales, torch.ones_like(scales))\n",
        replace="",
        tests=(QUANTIZE,),
        expect=r"an all-zero block gave scale 0\.0: x / 0 is NaN",
        why="no guard for an all-zero block: 0/0 is NaN, and NaN's int8 cast is undefined"),
    Bug("13.10-sum-int8", F, where="13.10",
        find="    gathered = [torch.empty_like(payload) for _ in range(world)]\n"
             "    dist.all_gather(gathered, payload, group=group)\n",
        replace="    dist.all_reduce(q, group=group)\n"
                "    gathered = [torch.cat([scales.view(torch.int8), q])] * world\n",
        tests=(INT8,),
        expect=r"int8 sums wrap \(100\+100 = −56 on gloo\): gather, then dequantise and "
               r"average in fp32",
        why="the int8 q all-reduced (summed) as if they were fp32: they wrap around, and "
            "each rank's q is in its own scale's unit"),
    Bug("13.10-one-scale", F, where="13.10",
        find="        total += dequantize_int8(row[k:], row[:k].view(torch.float32), (n,), "
             "block, work)\n",
        replace="        total += dequantize_int8(row[k:], scales, (n,), block, work)\n",
        tests=(INT8,),
        expect=r"every rank's own scales",
        why="every rank's q dequantised with this rank's own scales, not the sender's"),
]
