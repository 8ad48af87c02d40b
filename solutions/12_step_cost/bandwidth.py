"""Lesson 12: what a collective costs, as algorithm bandwidth and bus bandwidth.

A collective's time grows with its size ``S``: ``t ~ alpha + S / B`` for large messages. Time
alone compares badly: an all-reduce of 64 MB takes longer on 8 ranks than on 2 over the same
links, and all-gather and all-reduce of the same ``S`` move different amounts. nccl-tests
(NVIDIA/nccl-tests, ``doc/PERFORMANCE.md``) reports two bandwidths instead, and this file
does the same:

- **algbw** (algorithm bandwidth) ``= S / t``: how fast the operation goes, in the bytes its
  user asked for. ``S`` is the size of the *whole* array: the buffer of an all-reduce or a
  broadcast, the gathered output of an all-gather (N x each rank's chunk), the input of a
  reduce-scatter (N x each rank's output chunk).
- **busbw** (bus bandwidth) ``= algbw x factor``: what one rank's link carried. An all-reduce
  is a reduce-scatter then an all-gather: every element takes ``n-1`` additions and ``n``
  assignments, ``2(n-1)`` transfers spread over ``n`` links, so at a link speed ``B`` it takes
  at best ``t = (S / B) x 2(n-1)/n``, and ``B = algbw x 2(n-1)/n``. The factors:

  =============== =============== =================================================
  operation       factor          why
  =============== =============== =================================================
  all-reduce      2(n-1)/n        reduce-scatter + all-gather
  reduce-scatter  (n-1)/n         the additions only
  all-gather      (n-1)/n         the assignments only
  broadcast       1               every byte leaves the root through its one link
  =============== =============== =================================================

  At one rank nothing crosses a link: the first three factors are 0 there (nccl-tests prints
  a busbw of 0), broadcast's stays 1 by its formula. busbw is the number to hold against the
  hardware (NVLink, PCIe, InfiniBand, the memory bus of a CPU) and the same at every N for a
  good implementation; algbw falls as N grows.

The same factors are the bytes each rank sends in the ZeRO paper's accounting (Rajbhandari et
al. 2020, section 7): DDP all-reduces its gradients, ``2(n-1)/n x gradient bytes`` a rank;
ZeRO-3/FSDP all-gathers the parameters twice and reduce-scatters the gradients once,
``3 (n-1)/n x`` the same bytes. ``crossover.py`` turns them into time with the fitted link.

Your tasks:

- 12.5 :func:`bus_factor` and :func:`bandwidths`: nccl-tests' factors, and algbw and busbw
  of one measurement with the right ``S``;
- 12.6 :func:`time_collective`: on every rank, time one collective at one size: its tensors
  sized per operation on ``dpt.dist.rank_device()``, warm-up calls, a barrier, the device
  synchronized before each clock read, the median of the repeats, and the slowest rank's time.

Given: :func:`collective_call` (which ``torch.distributed`` function runs each operation),
:func:`sweep_rank` (the rank function of a sweep), :func:`fit_alpha_beta` (the alpha-beta
model of lesson 05 from the all-reduce rows), the table, the figure and the command line. It
times all four operations from 1 KB up to ``--max-mb`` (x4 a step) at every N from 2 to
``--max-nproc`` (default: the GPUs under NCCL, else the cores, gloo on the CPU)::

    .venv/bin/python solutions/12_step_cost/bandwidth.py --max-mb 4 --repeats 3
    .venv/bin/python solutions/12_step_cost/bandwidth.py            # 1 KB to 64 MB

Gloo has no reduce-scatter of its own: torch's ``ProcessGroupGloo`` runs an all-reduce of the
whole input and keeps this rank's slice (pytorch/pytorch PR 118911), twice the traffic. Its
rows are marked "emulated": their busbw is not a reduce-scatter's. NCCL's is the real one.
``benchmarks/bench_l12_collectives.py`` runs the full sweep and draws it.
"""

from __future__ import annotations

import dpt  # noqa: F401  # isort: skip (first: without torch it stops here, in one line)

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dpt.device import synchronize

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
FACTOR_TEXT = {"all_reduce": "2(n-1)/n", "all_gather": "(n-1)/n", "reduce_scatter": "(n-1)/n",
               "broadcast": "1"}  # for the figure
DTYPE = torch.float32  # the element every size here is counted in (4 bytes)
# operations a backend only emulates: their busbw is not that operation's
EMULATED = {("gloo", "reduce_scatter"): "gloo: an all-reduce of the whole input, then this "
                                        "rank's slice (2x the traffic)"}


def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; choose from {', '.join(OPS)}")


# --- 12.5 algorithm and bus bandwidth ---------------------------------------------------------

def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' factor from algbw to busbw for ``op`` on ``world_size`` ranks.

    all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1: a float (at
    n = 1 the first three are 0). An unknown ``op``, or fewer than 1 rank: ValueError.
    """
    check_op(op)
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    # BEGIN SOLUTION 12.5: all-reduce moves each byte 2(n-1)/n times over a rank's link, all-gather and reduce-scatter half that, broadcast once
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n
    # END SOLUTION


def bandwidths(op: str, input_bytes: int, output_bytes: int, seconds: float,
               world_size: int) -> dict:
    """Size, algbw and busbw of one ``op`` that took ``seconds``.

    ``input_bytes`` and ``output_bytes``: the tensors each rank passed in and got back (the
    same tensor for all_reduce and broadcast). Returns ``{"size": S, "algbw": S / seconds,
    "busbw": algbw x bus_factor}`` in bytes and bytes per second, ``S`` as nccl-tests counts
    it: the whole array (for all_gather the gathered output, for reduce_scatter the input that
    is scattered). ``seconds`` not positive, or sizes below 0: ValueError.
    """
    check_op(op)
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    if min(input_bytes, output_bytes) < 0:
        raise ValueError(f"sizes cannot be negative, got {input_bytes} and {output_bytes}")
    # BEGIN SOLUTION 12.5: S is the whole array: all-gather's gathered output, reduce-scatter's input, the buffer of the others; then algbw = S / t and busbw = algbw x the factor
    size = output_bytes if op == "all_gather" else input_bytes
    algbw = size / seconds
    return {"size": size, "algbw": algbw, "busbw": algbw * bus_factor(op, world_size)}
    # END SOLUTION


# --- 12.6 time one collective -----------------------------------------------------------------

def collective_call(op: str, inp: torch.Tensor, out: torch.Tensor) -> None:
    """Run ``op`` once (given): ``inp`` is this rank's input, ``out`` what it receives (the
    same tensor for all_reduce and broadcast, which work in place; broadcast from rank 0)."""
    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "broadcast":
        dist.broadcast(inp, src=0)
    elif op == "all_gather":  # out: every rank's inp, in rank order
        dist.all_gather_into_tensor(out, inp)
    elif op == "reduce_scatter":  # out: this rank's slice of the sum of every rank's inp
        dist.reduce_scatter_tensor(out, inp)
    else:
        check_op(op)


def time_collective(op: str, nbytes: int, repeats: int = 5, warmup: int = 2) -> dict:
    """Median seconds of one ``op`` on an array of ``nbytes`` (nccl-tests' size S), the
    slowest rank's (rank fn part: call it on every rank of a process group).

    The tensors (float32, ``DTYPE``; zeros, so repeated sums stay finite) live on
    ``dpt.dist.rank_device()``: all_reduce and broadcast one buffer of S; all_gather an input
    chunk of S/N per rank and an output of S; reduce_scatter an input of S and an output chunk
    of S/N. A chunk is ``nbytes // (4 N)`` elements, at least 1 (S is then N chunks). Run
    ``op`` with :func:`collective_call`: ``warmup`` times untimed (the first call sets up the
    connections), then ``repeats`` times, each after ``dist.barrier()`` (every rank starts
    together), between two ``time.perf_counter()`` reads, each read right after
    ``synchronize(device)`` (on a GPU the call only queues the work; the sync waits for it).
    This rank's median goes into an all-reduce with ``ReduceOp.MAX``: a collective is done
    when its slowest rank is.

    Returns ``{"op": op, "seconds": the max of the ranks' medians, "input_bytes": ...,
    "output_bytes": ...}``, the bytes of the tensors used, the same on every rank.
    """
    from dpt.dist import rank_device

    check_op(op)
    if nbytes < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need nbytes >= 1, repeats >= 1 and warmup >= 0; got {nbytes}, "
                         f"{repeats}, {warmup}")
    n, dev = dist.get_world_size(), rank_device()
    element = torch.tensor([], dtype=DTYPE).element_size()
    # BEGIN SOLUTION 12.6: size the tensors per op (a chunk is S/N), warm up, then per repeat: barrier, sync, clock, call, sync, clock; the median, then the max over ranks
    chunk = max(1, nbytes // (element * n))
    if op == "all_gather":
        inp = torch.zeros(chunk, dtype=DTYPE, device=dev)
        out = torch.zeros(chunk * n, dtype=DTYPE, device=dev)
    elif op == "reduce_scatter":
        inp = torch.zeros(chunk * n, dtype=DTYPE, device=dev)
        out = torch.zeros(chunk, dtype=DTYPE, device=dev)
    else:
        inp = out = torch.zeros(max(1, nbytes // element), dtype=DTYPE, device=dev)
    for _ in range(warmup):
        collective_call(op, inp, out)
    times = []
    for _ in range(repeats):
        dist.barrier()
        synchronize(dev)  # work queued before (the warm-up) must not count
        start = time.perf_counter()
        collective_call(op, inp, out)
        synchronize(dev)  # the clock reads finished work, not queued work
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"op": op, "seconds": slowest.item(),
            "input_bytes": inp.numel() * inp.element_size(),
            "output_bytes": out.numel() * out.element_size()}
    # END SOLUTION


# --- given: the sweep, the fit, the table, the figure ---------------------------------------

def sizes_between(min_bytes: int, max_bytes: int, step: int = 4) -> list[int]:
    """``min_bytes``, x ``step``, ..., up to ``max_bytes``."""
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= step
    return sizes


def sweep_rank(rank: int, world_size: int, ops: list[str], sizes: list[int], repeats: int,
               warmup: int) -> dict:
    """Every (op, size) timed on this rank (rank fn); rank 0's result is the sweep's."""
    from dpt.dist import rank_device

    rows = [time_collective(op, s, repeats, warmup) for op in ops for s in sizes]
    return {"backend": dist.get_backend(), "device": str(rank_device()), "rows": rows}


def with_bandwidths(rows: list[dict], world_size: int, backend: str) -> list[dict]:
    """Each timed row with its size S, algbw, busbw (12.5) and, where the backend only
    emulates the operation, why (its busbw is then not that operation's)."""
    out = []
    for r in rows:
        bw = bandwidths(r["op"], r["input_bytes"], r["output_bytes"], r["seconds"], world_size)
        row = {"n": world_size, **r, **bw}
        why = EMULATED.get((backend, r["op"]))
        if why:
            row["emulated"] = why
        out.append(row)
    return out


def fit_alpha_beta(sizes: list[float], seconds: list[float], world_size: int) -> dict:
    """Lesson 05's ring model ``t = alpha + 2(n-1)/n x S / B`` fitted to all-reduce times.

    Weighted least squares on the relative error (weights 1 / t^2), not the plain least
    squares of lesson 05 and ``benchmarks.costmodel.fit_ring``: the sizes span five orders of
    magnitude, and plainly the largest messages decide everything, alpha coming out of their
    noise (often below 0). Relative errors give every size a say: alpha comes from the small
    messages, B from the large ones. B is the link speed busbw approaches at large S, since
    busbw = S / t x 2(n-1)/n. Returns ``{"alpha_s", "bandwidth_Bps"}``; ValueError when the
    time does not grow with the size.
    """
    if world_size < 2 or len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("the fit needs at least 2 ranks and 2 (size, time) points")
    k = 2 * (world_size - 1) / world_size
    xs, ws = [k * s for s in sizes], [1 / t ** 2 for t in seconds]
    sw, sx = sum(ws), sum(w * x for w, x in zip(ws, xs))
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    st = sum(w * t for w, t in zip(ws, seconds))
    sxt = sum(w * x * t for w, x, t in zip(ws, xs, seconds))
    det = sw * sxx - sx * sx
    if det <= 0:
        raise ValueError("every message has the same size; cannot fit a bandwidth")
    slope, alpha = (sw * sxt - sx * st) / det, (sxx * st - sx * sxt) / det
    if alpha < 0:  # the line through the origin instead
        alpha, slope = 0.0, sxt / sxx
    if slope <= 0:
        raise ValueError("time does not grow with message size; cannot fit a bandwidth (a "
                         "busy machine? more --repeats or a larger --max-mb)")
    return {"alpha_s": alpha, "bandwidth_Bps": 1 / slope}


def measure(ops: list[str], sizes: list[int], nprocs: list[int], repeats: int = 5,
            warmup: int = 2, say=print, timeout: float = 900) -> dict:
    """The sweep at each N of ``nprocs`` (``dpt.ranks.run_distributed``), with bandwidths
    and, per N, the alpha-beta fit of the all-reduce rows."""
    import bandwidth  # the ranks import the rank function by module name, not __main__

    from dpt.ranks import placement, run_distributed

    rows, fits, where = [], {}, {}
    for n in nprocs:
        where[n] = placement(n).label
        say(f"N={n} ({where[n]}): {len(ops)} collective(s) x {len(sizes)} size(s), "
            f"{warmup} warm-up + {repeats} timed call(s) each ...", flush=True)
        t0 = time.perf_counter()
        got = run_distributed(bandwidth.sweep_rank, world_size=n, timeout=timeout, echo=False,
                              args=(list(ops), list(sizes), repeats, warmup))[0]
        mine = with_bandwidths(got["rows"], n, got["backend"])
        rows += mine
        ar = [r for r in mine if r["op"] == "all_reduce"]
        try:
            fits[n] = fit_alpha_beta([r["size"] for r in ar], [r["seconds"] for r in ar], n)
        except ValueError as exc:
            fits[n] = {"error": str(exc)}
        say(f"N={n} done in {time.perf_counter() - t0:.1f} s", flush=True)
    return {"config": {"ops": list(ops), "sizes": list(sizes), "nprocs": list(nprocs),
                       "repeats": repeats, "warmup": warmup, "dtype": str(DTYPE),
                       "where": where, "torch": torch.__version__},
            "rows": rows, "fit": fits}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} GB"


def fit_line(n: int, fit: dict) -> str:
    if "error" in fit:
        return f"N={n} all-reduce: no fit ({fit['error']})"
    return (f"N={n} all-reduce: alpha = {fit['alpha_s'] * 1e6:.1f} us, bandwidth = "
            f"{fit['bandwidth_Bps'] / 1e9:.2f} GB/s")


def format_table(result: dict) -> str:
    """nccl-tests' columns: size, time, algbw, busbw (GB/s = 1e9 bytes/s), per N and op."""
    lines = [f"{'N':>3} {'collective':<15}{'size':>10}{'time (us)':>12}{'algbw GB/s':>12}"
             f"{'busbw GB/s':>12}  note"]
    for r in result["rows"]:
        lines.append(f"{r['n']:>3} {r['op']:<15}{human_bytes(r['size']):>10}"
                     f"{r['seconds'] * 1e6:>12.1f}{r['algbw'] / 1e9:>12.4g}"
                     f"{r['busbw'] / 1e9:>12.4g}  {'emulated' if 'emulated' in r else ''}")
    notes = sorted({r["emulated"] for r in result["rows"] if "emulated" in r})
    lines += [f"emulated: {why}; its busbw is not a true reduce-scatter's" for why in notes]
    lines += [fit_line(int(n), f) for n, f in result["fit"].items()]
    return "\n".join(lines)


def plot(result: dict, path: Path | str | None = None):
    """busbw against size, one panel per collective, one line per N (emulated ones dashed)."""
    import matplotlib.pyplot as plt

    ops = result["config"]["ops"]
    fig, axes = plt.subplots(1, len(ops), figsize=(3.4 * len(ops) + 0.6, 3.6), squeeze=False,
                             sharey=True)
    for ax, op in zip(axes[0], ops):
        for n in result["config"]["nprocs"]:
            rows = [r for r in result["rows"] if r["op"] == op and r["n"] == n]
            if not rows:
                continue
            emulated = any("emulated" in r for r in rows)
            ax.plot([r["size"] for r in rows], [r["busbw"] / 1e9 for r in rows],
                    "--" if emulated else "-", marker="o", ms=3,
                    label=f"N={n}" + (" (emulated)" if emulated else ""))
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op}: busbw = algbw x {FACTOR_TEXT[op]}", fontsize=9)
        ax.set_xlabel("size S (bytes)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("bus bandwidth (GB/s)")
    where = "; ".join(f"N={n}: {w}" for n, w in result["config"]["where"].items())
    fig.suptitle(f"collective bus bandwidth (nccl-tests' factors), {where}", fontsize=9)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


def max_ranks() -> tuple[int, str]:
    """What the machine allows: every GPU under NCCL (2 or more), else a rank per core (2 on
    a machine of one core: the smallest N there is)."""
    from dpt.dist import cpu_budget

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        return gpus, f"{gpus} GPUs"
    return max(2, cpu_budget()), f"{cpu_budget()} core(s)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS, metavar="OP",
                    help=f"collectives to time (default: all of {', '.join(OPS)})")
    ap.add_argument("--min-kb", type=float, default=1, help="smallest size S, in KB")
    ap.add_argument("--max-mb", type=float, default=64, help="largest size S, in MB (x4 steps)")
    ap.add_argument("--max-nproc", type=int, default=None,
                    help="largest N (every N from 2; default: the GPUs under NCCL, else the "
                         "cores)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per size (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    ap.add_argument("--out", type=Path, default=Path("bandwidth.json"))
    ap.add_argument("--plot", type=Path, default=Path("bandwidth.png"))
    return ap


def check(args: argparse.Namespace) -> list[int]:
    """Bad flags as one ValueError before anything starts; the N to run."""
    if not 0 < args.min_kb * 1024 <= args.max_mb * 2**20:
        raise ValueError(f"need 0 < --min-kb <= --max-mb, got {args.min_kb:g} KB and "
                         f"{args.max_mb:g} MB")
    if args.min_kb * 1024 < 4:
        raise ValueError(f"--min-kb {args.min_kb:g} is under one float32 (4 bytes)")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError(f"need --repeats >= 1 and --warmup >= 0, got {args.repeats} and "
                         f"{args.warmup}")
    for flag in ("out", "plot"):
        folder = getattr(args, flag).parent
        if not folder.is_dir():
            raise ValueError(f"cannot write --{flag} {getattr(args, flag)}: folder {folder} "
                             "does not exist")
    limit, what = max_ranks()
    top = limit if args.max_nproc is None else args.max_nproc
    if top < 2:
        raise ValueError(f"--max-nproc must be at least 2 (a collective on one rank moves "
                         f"nothing), got {top}" + ("" if args.max_nproc else f" ({what})"))
    if top > limit:
        raise ValueError(f"--max-nproc {top} is more ranks than this machine's {what}: ranks "
                         "sharing a core time the scheduler, not the links")
    return list(range(2, top + 1))


def main(argv: list[str] | None = None) -> int:
    from dpt.errors import report_error

    args = build_parser().parse_args(argv)
    try:
        nprocs = check(args)
        sizes = sizes_between(int(args.min_kb * 1024), int(args.max_mb * 2**20))
        result = measure(args.ops, sizes, nprocs, args.repeats, args.warmup)
    except (ValueError, NotImplementedError, RuntimeError) as exc:  # RuntimeError: a rank
        return report_error(exc)
    print(format_table(result))
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
