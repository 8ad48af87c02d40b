"""Why mixed precision works, and why fp16 needs loss scaling: two small demos.

- :func:`format_table`: range and precision of fp32, fp16 and bf16 from ``torch.finfo``.
- :func:`underflow_demo`: a gradient too small for fp16 becomes 0, unless the loss (and so
  every gradient, by the chain rule) is first multiplied by a scale ``S`` and divided by ``S``
  again in fp32.

    .venv/bin/python solutions/06_mixed_precision/precision_demo.py
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def format_table() -> list[dict]:
    """One row per dtype: bits of mantissa, largest value, smallest normal and subnormal, eps."""
    rows = []
    for name, dtype in DTYPES.items():
        info = torch.finfo(dtype)
        rows.append({
            "dtype": name,
            "bits": info.bits,
            "mantissa_bits": {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[dtype],
            "max": info.max,
            "smallest_normal": info.smallest_normal,
            # the smallest positive subnormal: eps * smallest_normal
            "smallest_subnormal": info.eps * info.smallest_normal,
            "eps": info.eps,
        })
    return rows


def print_table(rows: list[dict] | None = None) -> None:
    rows = rows or format_table()
    print(f"{'dtype':5} {'bits':>4} {'mant.':>5} {'max':>10} {'min normal':>11} "
          f"{'min subnorm':>11} {'eps':>9}")
    for r in rows:
        print(f"{r['dtype']:5} {r['bits']:>4} {r['mantissa_bits']:>5} {r['max']:>10.3g} "
              f"{r['smallest_normal']:>11.3g} {r['smallest_subnormal']:>11.3g} {r['eps']:>9.3g}")


def round_trip(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What survives storing fp32 ``values`` in ``dtype`` and reading them back."""
    return values.to(dtype).to(torch.float32)


def underflow_demo(grad_value: float = 1e-8, scale: float = 2.0 ** 16) -> dict:
    """Backward of ``loss = w * x`` in fp16, where d(loss)/dw = x is tiny.

    Returns the gradient fp32 computes, the one fp16 computes, and the one fp16 computes from
    the scaled loss ``S * loss`` then divided by ``S`` in fp32 (what GradScaler does).
    """
    x32 = torch.tensor(grad_value)
    w32 = torch.tensor(1.0, requires_grad=True)
    (w32 * x32).backward()

    w16 = torch.tensor(1.0, dtype=torch.float16, requires_grad=True)
    x16 = x32.to(torch.float16)  # 1e-8 < fp16's smallest subnormal (6e-8): already 0
    (w16 * x16).backward()

    w16s = torch.tensor(1.0, dtype=torch.float16, requires_grad=True)
    # The scale is applied where the gradient is born: dL/dw = S * x, computed in fp32 by the
    # loss, then flowing through fp16 activations as a representable number.
    x_scaled = (x32 * scale).to(torch.float16)
    (w16s * x_scaled).backward()
    recovered = w16s.grad.float() / scale
    return {"fp32": w32.grad.item(), "fp16": w16.grad.float().item(),
            "fp16_scaled": w16s.grad.float().item(), "fp16_scaled_unscaled": recovered.item(),
            "scale": scale}


def chain_underflow(scale: float = 1.0, n: int = 4, factor: float = 1e-2,
                    dtype: torch.dtype = torch.float16) -> float:
    """A gradient flowing back through ``n`` layers that each multiply it by ``factor``.

    With fp16 and no scale, 1e-2 ** 4 = 1e-8 underflows to 0; with ``scale = 2**15`` it
    survives, and dividing by the scale in fp32 gives back about 1e-8. bf16 has fp32's
    exponent range, so it needs no scale at all.
    """
    x = torch.ones((), dtype=dtype, requires_grad=True)
    y = x
    for _ in range(n):
        y = y * torch.tensor(factor, dtype=dtype)
    # The scale enters as the gradient of the output, as it does for GradScaler's S * loss.
    # It must itself fit in the dtype: fp16's max is 65504, so 2**15 and not 2**16 here.
    y.backward(torch.tensor(scale, dtype=dtype))
    return x.grad.float().item() / scale


def main() -> int:
    print_table()
    print()
    demo = underflow_demo()
    print(f"gradient 1e-8: fp32 {demo['fp32']:.3g} | fp16 {demo['fp16']:.3g} | "
          f"fp16 with scale 2^16 then /2^16 in fp32 {demo['fp16_scaled_unscaled']:.3g}")
    print(f"through 4 layers x1e-2: fp16 {chain_underflow():.3g} | "
          f"fp16 scaled by 2^15 {chain_underflow(scale=2.0 ** 15):.3g} | "
          f"bf16 {chain_underflow(dtype=torch.bfloat16):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
