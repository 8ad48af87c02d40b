"""Step 1 of lesson 05: the collectives DDP is built from, and a ring all-reduce by hand.

Every rank calls the same collective with its own tensor; what comes back is fixed:

- ``broadcast(t, src)``: every rank ends with ``src``'s tensor;
- ``all_reduce(t)``: every rank ends with the element-wise sum over ranks;
- ``all_gather(out_list, t)``: every rank ends with the list of all ranks' tensors;
- ``reduce_scatter(out, in_list)``: rank r ends with the sum over ranks of ``in_list[r]``.

Gloo (the CPU backend) has no reduce-scatter algorithm: older torch releases refuse
``reduce_scatter`` there, and recent ones run it as a copy and an all-reduce inside
``ProcessGroupGloo``. :func:`reduce_scatter` below builds it from ``all_reduce`` under gloo, the
same work on every torch the course supports.

:func:`ring_all_reduce` (task 05.1) is the algorithm NCCL and gloo use for large messages,
written with point-to-point sends and receives: N-1 steps of reduce-scatter around the ring,
then N-1 steps of all-gather. In each step a rank sends to its right neighbour and receives
from its left one, both posted together (``dist.batch_isend_irecv``): NCCL needs a send and
its matching receive grouped, and a rank that blocked in ``recv`` before its own send was
posted could wait forever. Each rank sends ``2 (N-1)/N * bytes`` in total, which gives the
ring model ``t = alpha + 2 (N-1)/N * bytes / bandwidth``.

Every rank function here builds its tensors on ``dpt.dist.rank_device()`` (the GPU under
NCCL, the CPU under gloo), and the timers synchronize that device before reading the clock.

Timing study (rank processes started by ``dpt.ranks.run_distributed``)::

    python solutions/05_ddp_from_scratch/collectives.py --world-size 2 --max-mb 64
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


def reduce_scatter(output: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """``dist.reduce_scatter``, or an all-reduce of every chunk where the backend lacks it."""
    if dist.get_backend() != "gloo":
        dist.reduce_scatter(output, inputs)
        return
    stacked = torch.stack(inputs)
    dist.all_reduce(stacked)
    output.copy_(stacked[dist.get_rank()])


def check_collectives(rank: int, world_size: int) -> dict[str, list]:
    """Run each collective on small tensors and assert what it must return (rank fn)."""
    from dpt.dist import rank_device

    n, dev = world_size, rank_device()
    out = {}
    # broadcast: rank 0 holds [0, 1, 2]; everyone else holds junk until the call.
    t = torch.arange(3.0, device=dev) if rank == 0 else torch.full((3,), -1.0, device=dev)
    dist.broadcast(t, src=0)
    assert torch.equal(t, torch.arange(3.0, device=dev)), t
    out["broadcast"] = t.tolist()
    # all_reduce: rank r holds r + 1 everywhere; the sum is n (n + 1) / 2.
    t = torch.full((2,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), n * (n + 1) / 2, device=dev)), t
    out["all_reduce"] = t.tolist()
    # all_gather: rank r contributes [r, 10 r]; everyone gets the list in rank order.
    mine = torch.tensor([rank, 10.0 * rank], device=dev)
    gathered = [torch.empty(2, device=dev) for _ in range(n)]
    dist.all_gather(gathered, mine)
    assert all(torch.equal(g.cpu(), torch.tensor([r, 10.0 * r])) for r, g in enumerate(gathered))
    out["all_gather"] = [g.tolist() for g in gathered]
    # reduce_scatter: rank r sends chunk j = [r + j]; rank j receives sum over r of (r + j).
    chunks = [torch.tensor([float(rank + j)], device=dev) for j in range(n)]
    got = torch.empty(1, device=dev)
    reduce_scatter(got, chunks)
    expected = sum(r + rank for r in range(n))
    assert got.item() == expected, (got, expected)
    out["reduce_scatter"] = got.tolist()
    return out


def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, with a ring of sends and receives; return it.

    The flat tensor is cut into N chunks (``torch.tensor_split``, so sizes need not divide).
    Reduce-scatter: at step s, rank r sends chunk (r - s) mod N to its right neighbour and adds
    the chunk (r - s - 1) mod N it receives from its left one. After N-1 steps rank r owns the
    full sum of chunk (r + 1) mod N. All-gather: N-1 more steps pass the finished chunks on.
    Each step posts its send and its receive together (``dist.P2POp`` + ``batch_isend_irecv``)
    and waits for both before using what arrived.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return tensor
    if tensor.is_cuda and dist.get_backend() == "gloo":
        # Ranks sharing a GPU (DPT_SHARE_GPU=1) talk through gloo, whose sends read host
        # memory only (a CUDA pointer fails with "Bad address"): the ring runs on a host copy,
        # as gloo's own all_reduce of a CUDA tensor does.
        return tensor.copy_(ring_all_reduce(tensor.cpu()))
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    # BEGIN SOLUTION 05.1: reduce-scatter, then all-gather, chunk by chunk around the ring
    chunks = list(torch.tensor_split(flat, world))
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty_like(chunks[0])

    def exchange(send_idx: int, recv_idx: int) -> torch.Tensor:
        send, recv = chunks[send_idx], incoming[: chunks[recv_idx].numel()]
        if send.numel() == 0 and recv.numel() == 0:  # same sizes on every rank: all skip
            return recv
        # Post both at once: blocking in recv before the send is posted can deadlock (NCCL).
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, right))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, left))
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return recv

    for s in range(world - 1):  # reduce-scatter
        send_idx, recv_idx = (rank - s) % world, (rank - s - 1) % world
        chunks[recv_idx].add_(exchange(send_idx, recv_idx))
    for s in range(world - 1):  # all-gather
        send_idx, recv_idx = (rank + 1 - s) % world, (rank - s) % world
        chunks[recv_idx].copy_(exchange(send_idx, recv_idx))
    # END SOLUTION
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def _median_seconds(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        synchronize(device)  # on a GPU, kernels queued earlier must not count
        start = time.perf_counter()
        fn()
        synchronize(device)  # the clock reads finished work, not queued work
        times.append(time.perf_counter() - start)
    # The slowest rank decides when a collective is done.
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_all_reduce(rank: int, world_size: int, sizes: list[int], repeats: int = 5) -> dict:
    """Median seconds of ``ring_all_reduce`` and ``dist.all_reduce`` per size in bytes (rank fn)."""
    from dpt.dist import rank_device

    dev = rank_device()
    rows = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), device=dev)
        ring_all_reduce(x.clone())  # warm the connection up
        rows.append({"bytes": x.numel() * 4,
                     "ring_s": _median_seconds(lambda x=x: ring_all_reduce(x), repeats, dev),
                     "torch_s": _median_seconds(lambda x=x: dist.all_reduce(x), repeats, dev)})
    return {"world_size": world_size, "rows": rows}


def fit_ring_model(nbytes: list[float], seconds: list[float], world_size: int) -> dict:
    """Least squares for ``t = alpha + 2 (N-1)/N * bytes / bandwidth``."""
    k = 2 * (world_size - 1) / world_size
    xs = [k * b for b in nbytes]
    mx, my = statistics.fmean(xs), statistics.fmean(seconds)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, seconds)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        raise ValueError("time does not grow with size; cannot fit a bandwidth")
    return {"alpha_s": max(0.0, my - slope * mx), "bandwidth_Bps": 1.0 / slope}


def ring_model_seconds(fit: dict, nbytes: float, world_size: int) -> float:
    return fit["alpha_s"] + 2 * (world_size - 1) / world_size * nbytes / fit["bandwidth_Bps"]


def try_fit_ring_model(nbytes: list[float], seconds: list[float], world_size: int) -> dict | None:
    """``fit_ring_model``, or None when the timings cannot carry a fit.

    On a busy machine a small message can take longer than a large one (a rank waits for a
    core, not for bytes); then no bandwidth can be fitted, and saying so beats crashing.
    """
    try:
        return fit_ring_model(nbytes, seconds, world_size)
    except ValueError:
        return None


def plot_timings(result: dict, path: Path | None = None):
    import matplotlib

    matplotlib.use("Agg") if path is not None else None
    import matplotlib.pyplot as plt

    n, rows = result["world_size"], result["rows"]
    sizes = [r["bytes"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    # each implementation keeps one colour: its measured points and, dashed, its fitted model
    for color, (key, label, marker) in zip(("C0", "C1"), (
            ("ring_s", "ring by hand (send/recv)", "o"), ("torch_s", "dist.all_reduce", "s"))):
        times = [r[key] for r in rows]
        fit = try_fit_ring_model(sizes, times, n)
        if fit is None:  # the points are still worth seeing: they show the noise
            ax.loglog(sizes, times, marker, color=color,
                      label=f"{label}: no fit (time did not grow with size)")
            continue
        ax.loglog(sizes, times, marker, color=color, label=f"{label}, measured")
        ax.loglog(sizes, [ring_model_seconds(fit, s, n) for s in sizes], "--", color=color,
                  label=f"{label}, fitted: a = {fit['alpha_s'] * 1e3:.2f} ms, "
                        f"{fit['bandwidth_Bps'] / 1e9:.2f} GB/s")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"all-reduce on {n} ranks; dashed: the fitted ring model\n"
                 f"t = a + 2(N-1)/N * bytes / bandwidth", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--min-kb", type=float, default=1)
    parser.add_argument("--max-mb", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("allreduce_timing.json"))
    parser.add_argument("--plot", type=Path, default=Path("allreduce_timing.png"))
    args = parser.parse_args(argv)
    try:
        if args.world_size < 2:
            raise ValueError("--world-size must be at least 2 to all-reduce anything")
        if not 0 < args.min_kb * 1024 <= args.max_mb * 2**20:
            raise ValueError("need 0 < --min-kb <= --max-mb")
        if args.repeats < 1:
            raise ValueError("--repeats must be at least 1")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import collectives  # ranks import the function by module name, not from __main__

    from dpt.ranks import run_distributed

    sizes, s = [], int(args.min_kb * 1024)
    while s <= args.max_mb * 2**20:
        sizes.append(s)
        s *= 4
    try:
        run_distributed(collectives.check_collectives, world_size=args.world_size, echo=False)
        result = run_distributed(collectives.time_all_reduce, world_size=args.world_size,
                                 args=(sizes, args.repeats), timeout=600, echo=False)[0]
    except RuntimeError as exc:  # a rank failed (dpt.ranks.RankFailure)
        from dpt.errors import report_error

        return report_error(exc)  # the failed rank's cause, in one line
    for row in result["rows"]:
        print(f"{row['bytes']:>10d} B  ring {row['ring_s'] * 1e3:9.3f} ms   "
              f"dist.all_reduce {row['torch_s'] * 1e3:9.3f} ms")
    for key in ("ring_s", "torch_s"):
        fit = try_fit_ring_model([r["bytes"] for r in result["rows"]],
                                 [r[key] for r in result["rows"]], args.world_size)
        result[f"fit_{key[:-2]}"] = fit
        if fit is None:
            print(f"{key[:-2]}: no fit, time did not grow with message size (is the machine "
                  "busy? rerun with more --repeats or a larger --max-mb)")
            continue
        print(f"{key[:-2]}: fitted bandwidth {fit['bandwidth_Bps'] / 1e9:.2f} GB/s, "
              f"latency {fit['alpha_s'] * 1e6:.0f} us")
    args.out.write_text(json.dumps(result, indent=2))
    plot_timings(result, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
