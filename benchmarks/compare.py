"""Do two benchmark runs agree? Speedups of every (method, N) side by side, with intervals.

    python -m benchmarks.compare benchmarks/runs/A benchmarks/runs/B
    python -m benchmarks.compare --pool benchmarks/runs/A benchmarks/runs/B ...

Two runs agree on a result when its 95% intervals overlap. A result either run marked
"unreliable: machine busy" is listed, with the reason, but says nothing about agreement.
Exit status: 0 when every comparable result agrees, 1 otherwise, 2 on bad input.

``--pool`` takes any number of runs and answers a different question: what is a speedup
over all of them? Each round's ratio is still taken within its round (N = k against N = 1,
side by side); the ratios of every round of every run are then taken together, with the
same estimator a single run uses (geometric mean, 95% interval). A single run's interval
says how well that run pins its own value; the pooled one is the one to hold a target
against. A result marked busy in a run is left out of the pool, and listed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.analysis import BUSY, fmt_ci, ratio_ci, speedup_pairs


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


def pool(results: list[dict]) -> list[dict]:
    """One row per (method, N > 1, sweep batch): the speedup over the rounds of every run,
    each round paired within its own run. ``runs`` holds each run's own speedup; ``left_out``
    the runs (by stamp) whose result was marked busy."""
    rows: dict[tuple, dict] = {}
    for res in results:
        stamp = res.get("stamp", "?")
        for r, _ref, num, den in speedup_pairs(res.get("records", [])):
            if r["nprocs"] < 2:
                continue
            row = rows.setdefault((r["method"], r["nprocs"], r.get("sweep")),
                                  {"num": [], "den": [], "runs": [], "left_out": []})
            if r.get("reliability") == BUSY:
                row["left_out"].append(stamp)
                continue
            row["num"] += num
            row["den"] += den
            row["runs"].append(fmt_ci(r.get("speedup"), r.get("speedup_lo"), r.get("speedup_hi")))
    out = []
    for (method, n, sweep), row in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                        kv[0][2] or 0)):
        ci = ratio_ci(row["num"], row["den"]) if row["num"] else None
        out.append({"method": method, "nprocs": n, "sweep": sweep,
                    "speedup": ci and ci["value"], "lo": ci and ci["lo"], "hi": ci and ci["hi"],
                    "rounds": len(row["num"]), "runs": row["runs"],
                    "left_out": row["left_out"]})
    return out


def print_pool(results: list[dict]) -> int:
    rows = pool(results)
    if not rows:
        print("error: no run has a speedup at N > 1", file=sys.stderr)
        return 2
    print(f"Pooled over {len(results)} runs "
          f"({', '.join(str(r.get('stamp', '?')) for r in results)}); each round's ratio is "
          "taken within its round.\n")
    print("| method | N | pooled speedup | rounds | each run |")
    print("|---|---|---|---|---|")
    for r in rows:
        name = r["method"] + (f" batch {r['sweep']}" if r["sweep"] else "")
        each = "; ".join(r["runs"])
        if r["left_out"]:
            each += f"; left out (busy): {', '.join(r['left_out'])}"
        print(f"| {name} | {r['nprocs']} | {fmt_ci(r['speedup'], r['lo'], r['hi'])} "
              f"| {r['rounds']} | {each} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compare the speedups of two benchmark runs, or "
                                "pool any number of them (--pool).")
    p.add_argument("runs", type=Path, nargs="+", metavar="RUN",
                   help="a run folder (or its results.json); two to compare, any to --pool")
    p.add_argument("--pool", action="store_true",
                   help="one speedup per result over the rounds of every run given")
    args = p.parse_args(argv)
    if args.pool:
        return print_pool([load(r) for r in args.runs])
    if len(args.runs) != 2:
        p.error(f"comparing takes two runs, not {len(args.runs)} (or pool them with --pool)")
    a, b = (load(r) for r in args.runs)
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
