"""Do two benchmark runs agree? Speedups of every (method, N) side by side, with intervals.

    python -m benchmarks.compare benchmarks/runs/A benchmarks/runs/B

Two runs agree on a result when its 95% intervals overlap. A result either run marked
"unreliable: machine busy" is listed, with the reason, but says nothing about agreement.
Exit status: 0 when every comparable result agrees, 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.analysis import BUSY, fmt_ci


def load(path: Path) -> dict:
    path = path / "results.json" if path.is_dir() else path
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"error: cannot read a run's results from {path}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def speedups(result: dict) -> dict:
    """(method, N, sweep batch) -> the record, for every record with a speedup at N > 1."""
    return {(r["method"], r["nprocs"], r.get("sweep")): r for r in result.get("records", [])
            if r.get("speedup") is not None and r["nprocs"] > 1}


def compare(a: dict, b: dict) -> list[dict]:
    """One row per result both runs have: the two speedups, whether their intervals overlap
    (``raw_overlap``), and the verdict ``overlap``: the same, but None when either run has
    no interval or was taken on a busy machine."""
    ra, rb = speedups(a), speedups(b)
    rows = []
    for key in sorted(set(ra) & set(rb), key=lambda k: (k[0], k[1], k[2] or 0)):
        x, y = ra[key], rb[key]
        busy = [f"{name}: {r['flags'][0]}" for name, r in (("A", x), ("B", y))
                if r.get("reliability") == BUSY and r.get("flags")]
        bounds = [x.get("speedup_lo"), x.get("speedup_hi"), y.get("speedup_lo"),
                  y.get("speedup_hi")]
        raw = None
        if None not in bounds:
            raw = x["speedup_lo"] <= y["speedup_hi"] and y["speedup_lo"] <= x["speedup_hi"]
        rows.append({"method": key[0], "nprocs": key[1], "sweep": key[2],
                     "a": fmt_ci(x["speedup"], x.get("speedup_lo"), x.get("speedup_hi")),
                     "b": fmt_ci(y["speedup"], y.get("speedup_lo"), y.get("speedup_hi")),
                     "raw_overlap": raw, "overlap": None if busy else raw,
                     "busy": busy})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compare the speedups of two benchmark runs.")
    p.add_argument("a", type=Path, help="a run folder (or its results.json)")
    p.add_argument("b", type=Path, help="another run folder (or its results.json)")
    args = p.parse_args(argv)
    a, b = load(args.a), load(args.b)
    rows = compare(a, b)
    if not rows:
        print("error: the two runs have no speedup in common", file=sys.stderr)
        return 2
    print(f"| method | N | A {a.get('stamp', '')} | B {b.get('stamp', '')} | intervals |")
    print("|---|---|---|---|---|")
    for r in rows:
        name = r["method"] + (f" batch {r['sweep']}" if r["sweep"] else "")
        word = {True: "overlap", False: "**disagree**", None: "no interval"}[r["raw_overlap"]]
        if r["busy"]:
            word += ", not counted (busy: " + "; ".join(r["busy"]) + ")"
        print(f"| {name} | {r['nprocs']} | {r['a']} | {r['b']} | {word} |")
    judged = [r for r in rows if r["overlap"] is not None]
    bad = [r for r in judged if not r["overlap"]]
    print(f"\n{len(judged) - len(bad)} of {len(judged)} comparable results agree; "
          f"{len(rows) - len(judged)} not comparable (busy, or no interval).")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
