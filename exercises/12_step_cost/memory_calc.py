# Exercise file, generated from solutions/ by `make exercises`.
# Replace each `raise NotImplementedError("Task ...")` with your code;
# `make grade` scores each task.
"""Lesson 12: what data parallelism costs in memory and on the network, per rank and step.

A data-parallel rank keeps four kinds of *model state* (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", arXiv 1910.02054): the parameters,
their gradients, the optimizer's state and, under mixed precision, an fp32 *master* copy of
the parameters that the optimizer updates (the 16-bit parameters are cast from it). For P
parameters stored in p bytes, gradients in g bytes, s optimizer states of 4 bytes each (SGD
0, SGD with momentum 1, Adam 2: ``exp_avg`` and ``exp_avg_sq``) and m = 4 master bytes when
p < 4 (else 0), one rank holds::

    strategy        params      grads       optimizer + master       what is sharded
    DDP             p P         g P         (4s + m) P               nothing
    ZeRO-1          p P         g P         (4s + m) P / N           the optimizer (and master)
    ZeRO-2          p P         g P / N     (4s + m) P / N           + the gradients
    ZeRO-3 = FSDP   p P / N     g P / N     (4s + m) P / N           + the parameters

The paper's Figure 1 is this table for mixed-precision Adam (p = g = 2, 4s + m = K = 12) at
P = 7.5B, N = 64: 120 GB, 31.4 GB, 16.6 GB and 1.9 GB per rank (GB = 1e9 bytes). A sharded
tensor is one flat vector padded with zeros to a multiple of N (lesson 09's ``shard_flat``),
so "P / N" is really ceil(P / N) elements on every rank.

On the network, per step and rank, with ring collectives (nccl-tests' ``doc/PERFORMANCE.md``:
an all-reduce moves 2(N-1)/N of the buffer through each rank, an all-gather or a
reduce-scatter (N-1)/N of the whole buffer; chunks of ceil(P / N) elements)::

    DDP             all-reduce the gradients                       2 (N-1)/N g P
    ZeRO-1, -2      reduce-scatter the gradients, all-gather       (N-1)/N g P + (N-1)/N p P
                    the updated parameters (same as DDP)
    ZeRO-3 = FSDP   all-gather the parameters in forward, again    2 (N-1)/N p P + (N-1)/N g P
                    in backward, reduce-scatter the gradients      (1.5 x DDP's)

A ring rank receives exactly as much as it sends (it passes N-1 chunks on and gets N-1 in).
Lesson 08's ZeRO-1 sends more than this table: it keeps DDP's all-reduce (every rank gets
every gradient) and then broadcasts the updated parameters, 3 (N-1)/N instead of 2 (N-1)/N.

What the calculator leaves out (lesson 09's ``memory_table.py`` measures them): activations,
DDP's gradient buckets (another g P), FSDP's gathered units, the optimizer's temporaries and
its per-tensor ``step`` counters, ZeRO's whole-tensor shards (lesson 08 gives each rank whole
tensors, so one rank may hold more than 1/N), and what no tensor owns (the allocator's
rounding and cache, NCCL's buffers, the CUDA context).

Your tasks:

- 12.7 :func:`memory_per_rank`: a rank's bytes of params, grads, optimizer state and master
  weights for a strategy;
- 12.8 :func:`bytes_per_step`: the bytes one rank sends per step, per kind of collective
  (``crossover.py`` takes its bytes from here, 12.9: written once).

The CLI prints both for every strategy::

    .venv/bin/python exercises/12_step_cost/memory_calc.py --params 1.3e9 --nproc 8
    .venv/bin/python exercises/12_step_cost/memory_calc.py --params 7.5e9 --nproc 64 --dtype fp16
"""

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import sys

import torch

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3 / FSDP"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}  # fp32 tensors per parameter
STATE_BYTES = 4  # optimizer states and master weights are fp32
MASTER_BYTES = 4
KINDS = ("params", "grads", "optimizer", "master")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def dtype_bytes(dtype) -> int:
    """Bytes per element of ``dtype``: a name of ``DTYPE_BYTES``, a torch floating dtype, or
    the byte count itself (``2``: what ``crossover.py`` passes, its ``bytes_per_elem``)."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype < 1:
            raise ValueError(f"a dtype given as bytes per element must be at least 1, got "
                             f"{dtype}")
        return dtype
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"{dtype} is not a floating dtype: parameters and gradients are")
        return torch.empty((), dtype=dtype).element_size()
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPE_BYTES)} "
                         "(or a torch dtype)")
    return DTYPE_BYTES[dtype]


def _check(num_params: int, world_size: int, strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of: "
                         f"{', '.join(STRATEGIES)} (zero3 is FSDP)")
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"num_params must be a whole number >= 0, got {num_params!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")


# --- 12.7 memory per rank -----------------------------------------------------------------------

def memory_per_rank(num_params: int, world_size: int, strategy: str, param_dtype="fp32",
                    grad_dtype=None, optimizer: str = "adam") -> dict[str, int]:
    """Bytes of model state one rank holds between steps, by kind, and their ``total``.

    ``strategy``: one of ``STRATEGIES``; ``param_dtype`` / ``grad_dtype``: ``"fp32"``,
    ``"bf16"``, ``"fp16"`` or a torch dtype (``grad_dtype`` None: as the parameters);
    ``optimizer``: a key of ``OPTIMIZER_STATES``, whose states are fp32. Parameters in fewer
    than 4 bytes mean mixed precision: an fp32 master copy (``master``), sharded with the
    optimizer state. A sharded kind holds ceil(num_params / world_size) elements per rank.
    Returns ``{"params", "grads", "optimizer", "master", "total"}``, whole bytes.
    """
    _check(num_params, world_size, strategy)
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of: "
                         f"{', '.join(OPTIMIZER_STATES)}")
    p_bytes = dtype_bytes(param_dtype)
    g_bytes = dtype_bytes(param_dtype if grad_dtype is None else grad_dtype)
    raise NotImplementedError("Task 12.7: each stage shards one more kind (optimizer+master, then grads, then params); a shard is ceil(P/N) elements; fp32 master copy only when params are 16-bit")
    out = {"params": params, "grads": grads, "optimizer": optimizer_bytes, "master": master}
    return {**out, "total": sum(out.values())}


# --- 12.8 bytes on the network per step -----------------------------------------------------

def bytes_per_step(num_params: int, world_size: int, strategy: str, param_dtype="fp32",
                   grad_dtype=None) -> dict[str, int]:
    """Bytes one rank sends in one training step with ring collectives, by collective.

    The gradients travel in ``grad_dtype`` (None: ``param_dtype``), the parameters in
    ``param_dtype`` (either: a name, a torch dtype or a byte count, as ``dtype_bytes`` reads
    it). A ring cuts a buffer of ``num_params`` elements into ``world_size`` chunks of
    ceil(num_params / world_size) (padded) and each rank sends N-1 of them per pass: a
    reduce-scatter or an all-gather is one pass, an all-reduce two. Returns
    ``{"all_reduce", "reduce_scatter", "all_gather", "sent", "received"}`` in bytes (0 for a
    collective the strategy does not use; ``sent`` their sum; ``received`` what comes in).
    """
    _check(num_params, world_size, strategy)
    p_bytes = dtype_bytes(param_dtype)
    g_bytes = dtype_bytes(param_dtype if grad_dtype is None else grad_dtype)
    raise NotImplementedError("Task 12.8: one ring pass sends N-1 chunks of ceil(P/N); DDP all-reduces the grads (two passes), ZeRO-1/2 reduce-scatter grads and all-gather params, ZeRO-3 gathers params twice")
    return {**sent, "sent": total, "received": received}


# --- the table -------------------------------------------------------------------------------

def table(num_params: int, world_size: int, param_dtype="fp32", grad_dtype=None,
          optimizer: str = "adam") -> list[dict]:
    """One row per strategy: ``memory_per_rank`` and ``bytes_per_step`` side by side."""
    return [{"strategy": s,
             **memory_per_rank(num_params, world_size, s, param_dtype, grad_dtype, optimizer),
             "sent": bytes_per_step(num_params, world_size, s, param_dtype, grad_dtype)["sent"]}
            for s in STRATEGIES]


def format_table(rows: list[dict], unit: float = 1e9) -> str:
    """``table``'s rows as text, in GB (1e9 bytes, as the ZeRO paper) by default."""
    cols = (*KINDS, "total", "sent")
    head = f"{'strategy':<15}" + "".join(f"{c:>11}" for c in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{LABELS[r['strategy']]:<15}" + "".join(
            f"{r[c] / unit:>11.3f}" for c in cols))
    return "\n".join(lines)


def parse_count(text: str) -> int:
    """``"1.3e9"``, ``"7.5B"``, ``"125M"``, ``"350k"``: a whole number of parameters."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"--params {text!r} is not a number (1.3e9, 7.5B, 125M)") from None
    if not value >= 1 or value != value or value == float("inf"):
        raise ValueError(f"--params must be at least 1 parameter, got {text!r}")
    return round(value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="1.3e9", help="parameter count: 1.3e9, 7.5B, 125M")
    ap.add_argument("--nproc", type=int, default=8, help="data-parallel ranks N")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPE_BYTES),
                    help="the parameters' dtype; bf16/fp16 add an fp32 master copy")
    ap.add_argument("--grad-dtype", default=None, choices=list(DTYPE_BYTES),
                    help="the gradients' dtype (default: --dtype)")
    ap.add_argument("--optimizer", default="adam", choices=list(OPTIMIZER_STATES))
    args = ap.parse_args(argv)
    try:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
        count = parse_count(args.params)
        rows = table(count, args.nproc, args.dtype, args.grad_dtype, args.optimizer)
    except (ValueError, NotImplementedError) as exc:
        from dpt.errors import report_error

        return report_error(exc)
    grads = args.grad_dtype or args.dtype
    print(f"{count:,} parameters on {args.nproc} rank(s): {args.dtype} parameters, {grads} "
          f"gradients, {args.optimizer} ({OPTIMIZER_STATES[args.optimizer]} fp32 state(s) "
          "per parameter)")
    print("GB per rank (1e9 bytes): model state kept between steps, and what one rank sends "
          "per step (ring)")
    print(format_table(rows))
    print("not counted: activations, DDP's buckets, FSDP's gathered units, temporaries, the "
          "allocator")
    return 0


if __name__ == "__main__":
    sys.exit(main())
