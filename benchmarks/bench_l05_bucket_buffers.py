"""Lesson 05: persistent bucket buffers against a new ``torch.cat`` per step, in one run.

Three ways for ``BucketedDDP`` to get gradients into a bucket, side by side in one process
group (world size 2, one thread per rank), on an MLP with many large weights and a small batch,
so that gradient handling is a visible share of the step:

- ``cat``: the first version of the lesson: on every step, ``torch.cat`` of the bucket's
  gradients into a new flat tensor, all-reduced, then copied back into ``.grad``;
- ``copy``: ``BucketedDDP`` (torch DDP's default): one flat buffer per bucket, allocated once;
  each gradient is copied in when ready and copied back after the all-reduce;
- ``view``: ``BucketedDDP(gradient_as_bucket_view=True)``: ``.grad`` *is* a view into the
  buffer, so autograd accumulates straight into the bucket;
- ``view+none``: the same with ``zero_grad(set_to_none=True)``, torch's default: every step's
  fresh ``.grad`` is copied in once and re-pointed at its view.

The other three use ``zero_grad(set_to_none=False)``, so that autograd itself allocates alike.

Counted, on one step after warm-up, with a ``TorchDispatchMode`` that sees every aten op
(autograd's included): tensors newly allocated and their bytes, and bytes written by copy ops
(``copy_``, ``cat``, ``clone``); the synchronization's share is the step's count minus that
of the same step under ``no_sync()``. Timed: blocks of ``--steps`` steps, the variants interleaved
in a rotated order in each of ``--repeats`` repeats, each block the slowest rank's time; the
ratio to ``cat`` is taken per repeat (adjacent blocks), and its median and range reported.

    python benchmarks/bench_l05_bucket_buffers.py --repeats 9

Writes benchmarks/runs/lessons/l05_bucket_buffers.json
(git-ignored; the committed results are in benchmarks/reference/lessons/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from dpt.lessons import load

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "runs" / "lessons"  # git-ignored; committed: reference/lessons
VARIANTS = ["cat", "copy", "view", "view+none"]
COPY_OPS = ("aten.copy_", "aten.cat", "aten.clone", "aten._to_copy")


def _cat_bucketed_class():
    """The per-step ``torch.cat`` bucketing the lesson used before, as a BucketedDDP."""
    import torch
    import torch.distributed as dist
    BucketedDDP = load("05_ddp_from_scratch", "bucketed_ddp", "solutions").BucketedDDP

    class CatBucketedDDP(BucketedDDP):
        def _register_hooks(self):
            self._build_buckets()  # only for the bucket lists; the buffers go unused
            self.flats = {}

            def hook(param):
                if not self.require_sync:
                    return
                b, _ = self.bucket_of[id(param)]
                self.ready[b] += 1
                if self.ready[b] == len(self.buckets[b]):
                    flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]])
                    self.flats[b] = flat  # kept until after wait()
                    self.pending.append((dist.all_reduce(flat, async_op=True), b))

            for bucket in self.buckets:
                for p in bucket:
                    self.hook_handles.append(p.register_post_accumulate_grad_hook(hook))

        def finish_gradient_synchronization(self):
            if not self.require_sync:
                return
            for work, b in self.pending:
                work.wait()
                flat = self.flats.pop(b)
                flat.div_(self.world_size)
                offset = 0
                for p in self.buckets[b]:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            self.pending.clear()
            self.ready = [0] * len(self.buckets)

    return CatBucketedDDP


def _counting_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        """New tensors (storages no input had) and bytes written by copy ops."""

        def __init__(self):
            super().__init__()
            self.allocs = self.alloc_bytes = self.copy_bytes = self.copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    self.allocs += 1
                    self.alloc_bytes += t.untyped_storage().nbytes()
            name = str(func)
            if name.startswith(COPY_OPS):
                first = tree_leaves(out)[0]
                self.copies += 1
                self.copy_bytes += first.numel() * first.element_size()
            return out

    return Count()


def bench_rank(rank, world_size, width, depth, batch, bucket_cap_mb, steps, repeats, warmup):
    import torch
    import torch.nn.functional as F
    BucketedDDP = load("05_ddp_from_scratch", "bucketed_ddp", "solutions").BucketedDDP
    from torch import nn

    from benchmarks.registry import slowest_rank_seconds
    from dpt.dist import rank_device

    dev = rank_device()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g).to(dev)
    y = torch.randint(0, width, (batch,), generator=g).to(dev)
    cat_cls = _cat_bucketed_class()
    runs, models = {}, {}
    for name in VARIANTS:
        torch.manual_seed(0)
        net = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width),
                                                                 nn.Tanh())]).to(dev)
        if name == "cat":
            model = cat_cls(net, bucket_cap_mb=bucket_cap_mb)
        else:
            model = BucketedDDP(net, bucket_cap_mb=bucket_cap_mb,
                                gradient_as_bucket_view=name.startswith("view"))
        params = list(model.parameters())
        set_to_none = name == "view+none"

        def step(model=model, params=params, set_to_none=set_to_none):
            for p in params:  # zero_grad, as torch.optim does it
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            F.cross_entropy(model(x), y).backward()
            model.finish_gradient_synchronization()
            with torch.no_grad():
                for p in params:
                    p.add_(p.grad, alpha=-1e-3)

        runs[name] = step
        models[name] = model

    def block(fn, n):
        return slowest_rank_seconds(fn, n, dev)

    counts = {}
    for name in VARIANTS:
        block(runs[name], warmup)
        mode = _counting_mode()
        with mode:
            runs[name]()
        alone = _counting_mode()  # the same step without synchronization: autograd's share
        with models[name].no_sync(), alone:
            runs[name]()
        counts[name] = {"allocs": mode.allocs, "alloc_bytes": mode.alloc_bytes,
                        "copies": mode.copies, "copy_bytes": mode.copy_bytes,
                        "sync_allocs": mode.allocs - alone.allocs,
                        "sync_alloc_bytes": mode.alloc_bytes - alone.alloc_bytes,
                        "sync_copy_bytes": mode.copy_bytes - alone.copy_bytes}
    times = {name: [] for name in VARIANTS}
    for r in range(repeats):
        for name in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
            times[name].append(block(runs[name], steps))
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    return {"counts": counts, "times": times, "grad_bytes": grad_bytes,
            "threads": torch.get_num_threads(), "device": str(dev),
            "buckets": len(model.buckets)}


def summarize(raw: dict) -> dict:
    rows = {}
    base = raw["times"]["cat"]
    for name, t in raw["times"].items():
        ratios = [b / a for a, b in zip(base, t)]  # time relative to cat, per repeat
        rows[name] = raw["counts"][name] | {
            "step_ms_median": statistics.median(t) * 1e3,
            "time_vs_cat_median": statistics.median(ratios),
            "time_vs_cat_min": min(ratios), "time_vs_cat_max": max(ratios)}
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8, help="Linear(width, width) layers")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT / "l05_bucket_buffers.json")
    args = parser.parse_args(argv)
    if min(args.width, args.depth, args.batch, args.steps, args.repeats) < 1 or \
            args.warmup < 1 or args.bucket_cap_mb <= 0:
        print("error: sizes, --steps, --repeats and --warmup must be positive", file=sys.stderr)
        return 2
    if str(REPO) not in sys.path:  # run as a script: ranks import this file as benchmarks.*
        sys.path.insert(0, str(REPO))
    import benchmarks.bench_l05_bucket_buffers as me  # ranks import it by name
    from dpt.ranks import run_distributed

    raw = run_distributed(me.bench_rank, world_size=2, threads=1, timeout=900, echo=False,
                          args=(args.width, args.depth, args.batch, args.bucket_cap_mb,
                                args.steps, args.repeats, args.warmup))[0]
    rows = summarize(raw)
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
              | {"world_size": 2, "threads_per_rank": raw["threads"], "device": raw["device"],
                 "grad_bytes": raw["grad_bytes"], "buckets": raw["buckets"]},
              "summary": rows, "raw_seconds_per_step": raw["times"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    mb = raw["grad_bytes"] / 2**20
    print(f"{mb:.1f} MB of gradients in {raw['buckets']} bucket(s), batch {args.batch}/rank, "
          f"{args.repeats} interleaved repeats of {args.steps} steps")
    print("allocations and copies made by the synchronization, per step (beyond no_sync):")
    print(f"{'variant':10s} {'allocs':>6s} {'alloc MB':>9s} {'copy MB':>8s} {'ms/step':>8s} "
          f"{'time vs cat: median [min, max]':>32s}")
    for name, r in rows.items():
        print(f"{name:10s} {r['sync_allocs']:6d} {r['sync_alloc_bytes'] / 2**20:9.2f} "
              f"{r['sync_copy_bytes'] / 2**20:8.2f} {r['step_ms_median']:8.1f} "
              f"{r['time_vs_cat_median']:14.3f} [{r['time_vs_cat_min']:.3f}, "
              f"{r['time_vs_cat_max']:.3f}]")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
