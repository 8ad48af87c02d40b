"""What a benchmark run's numbers can be trusted for: intervals, the control, a busy machine.

The harness (``benchmarks/run.py``) measures every (method, N) several times, in *rounds*: one
round launches each method at every N once, N = 1 and N = k back to back, alternating which
comes first (A B, then B A, ...), the methods in a new shuffled order each round. A ratio of
two measurements (a speedup, method A against method B) is then taken *per round* and the
rounds give its spread:

- the estimate is the geometric mean of the per-round ratios;
- the 95% interval is a paired t-interval on their logarithms (a ratio's noise is
  multiplicative), so two measurements taken seconds apart are compared with each other,
  never with a measurement taken minutes later under another load.

A run is judged against its **control**, ``independent``: N ranks that never communicate,
timed in the same rounds. On an idle machine it reaches close to N times its N = 1
throughput; when it falls short of ``control_floor * N``, other work was taking the cores and
every speedup of the run is marked *unreliable: machine busy*. So is a single result whose
speedup exceeds the ideal N by more than its interval (no method can beat N ranks that never
talk: its N = 1 runs were slowed down), and one during whose runs other processes used the
CPU (``/proc/stat`` against the CPU time of the ranks) or the hypervisor stole it.

Everything here is pure computation on the records, so tests feed it synthetic timings.
"""

from __future__ import annotations

import math
import statistics

from dpt.stats import mean_ci, positive_ci, t975  # noqa: F401 - the intervals, kept once in dpt

BUSY = "unreliable: machine busy"
CONTROL = "independent"


def ratio_ci(num: list[float], den: list[float]) -> dict:
    """A paired ratio ``num[i] / den[i]`` over rounds: geometric mean and 95% interval.

    ``num`` and ``den`` are measured in the same rounds (index i = round i). With one round
    the interval is unknown (``lo`` and ``hi`` are None).
    """
    if len(num) != len(den) or not num:
        raise ValueError("a paired ratio needs the same number (at least one) of each")
    ratios = [a / b for a, b in zip(num, den)]
    value, lo, hi = positive_ci(ratios)  # a t-interval on the logs: never below zero
    return {"value": value, "lo": lo, "hi": hi, "n": len(ratios), "ratios": ratios}


def fmt_ci(value, lo, hi, fmt: str = ".2f") -> str:
    """``1.83 [1.71, 1.95]``, or the value alone when there is no interval."""
    if value is None:
        return ""
    if lo is None or hi is None:
        return format(value, fmt)
    return f"{value:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def fmt_ms(seconds: float | None, digits: int = 3) -> str:
    """Seconds as milliseconds with ``digits`` significant figures (at most the units of a
    figure over 100): ``92.1``, ``1.23``, ``0.0456``. A GPU step of 40 microseconds reads
    ``0.0400``, never ``0`` or ``0.0``."""
    if seconds is None:
        return ""
    ms = 1000.0 * seconds
    if ms == 0 or not math.isfinite(ms):
        return format(ms, ".0f")
    decimals = digits - 1 - math.floor(math.log10(abs(ms)))
    return f"{ms:.{max(0, decimals)}f}"


# ------------------------------------------------------------------------ busy machine


def read_proc_stat(text: str | None = None) -> list[int] | None:
    """The first ``cpu`` line of /proc/stat: user nice system idle iowait irq softirq steal."""
    try:
        if text is None:
            with open("/proc/stat") as f:
                text = f.readline()
        fields = text.split()
        if not fields or fields[0] != "cpu":
            return None
        return [int(x) for x in fields[1:9]] + [0] * max(0, 9 - len(fields))
    except (OSError, ValueError):
        return None


def machine_load(before: dict, after: dict, ours_cpu_s: float, hz: int = 100) -> dict:
    """What else the machine did between two snapshots (see ``run.snapshot``).

    ``ours_cpu_s`` is the CPU time of this run's own processes in between. Returns the
    1-minute load average, the fraction of CPU time the hypervisor stole, and
    ``foreign_cores``: CPU used by *other* processes, in cores, averaged over the interval.
    """
    wall = max(1e-9, after["t"] - before["t"])
    out = {"wall_s": wall, "load1": after.get("load1"), "steal": None, "foreign_cores": None,
           "cpus": None, "ours_cpu_s": ours_cpu_s}
    a, b = before.get("stat"), after.get("stat")
    if a and b:
        d = [y - x for x, y in zip(a, b)]
        total = sum(d[:8])
        if total > 0:
            steal = d[7]
            # user + nice + system: processes' own time (interrupts are left out: loopback
            # traffic of our own ranks lands there).
            busy_s = (d[0] + d[1] + d[2]) / hz
            out["steal"] = steal / total
            out["cpus"] = round(total / hz / wall)
            out["foreign_cores"] = max(0.0, busy_s - ours_cpu_s) / wall
    return out


def busy_threshold(cpus: int | None) -> float:
    """Cores of other work that make a run's timings suspect: 10% of the CPUs, at least 0.25."""
    return max(0.25, 0.1 * (cpus or 1))


STEAL_LIMIT = 0.05


# ------------------------------------------------------------------------------ analysis


def _thr(rec: dict) -> list[float]:
    return [r["samples_per_s"] for r in rec.get("rounds", []) if r.get("status") == "ok"]


def _paired(a: dict, b: dict) -> tuple[list[float], list[float]]:
    """Throughputs of two records in the rounds where both succeeded."""
    ra = {r["round"]: r["samples_per_s"] for r in a.get("rounds", []) if r.get("status") == "ok"}
    rb = {r["round"]: r["samples_per_s"] for r in b.get("rounds", []) if r.get("status") == "ok"}
    common = sorted(set(ra) & set(rb))
    return [ra[i] for i in common], [rb[i] for i in common]


def summarize_record(rec: dict) -> None:
    """Throughput (geometric mean and interval over rounds), step time and machine load."""
    ok = [r for r in rec.get("rounds", []) if r.get("status") == "ok"]
    if not ok:
        return
    thr = [r["samples_per_s"] for r in ok]
    ci = ratio_ci(thr, [1.0] * len(thr))  # geometric mean; the interval stays positive
    m, lo, hi = ci["value"], ci["lo"], ci["hi"]
    steps = [t for r in ok for t in r["step_times"]]
    rec.update(samples_per_s=m, samples_per_s_lo=lo, samples_per_s_hi=hi, rounds_ok=len(ok),
               step_s=statistics.median(steps), step_s_min=min(steps), step_s_max=max(steps))
    for key in ("compute_s", "comm_s"):
        vals = [r[key] for r in ok if key in r]
        if len(vals) == len(ok):
            rec[key] = statistics.median(vals)
    loads = [r["load"] for r in ok if r.get("load")]
    fc = [x["foreign_cores"] for x in loads if x.get("foreign_cores") is not None]
    st = [x["steal"] for x in loads if x.get("steal") is not None]
    l1 = [x["load1"] for x in loads if x.get("load1") is not None]
    cpus = next((x["cpus"] for x in loads if x.get("cpus")), None)
    rec["load"] = {"foreign_cores": statistics.fmean(fc) if fc else None,
                   "foreign_cores_max": max(fc) if fc else None,
                   "steal": max(st) if st else None, "load1": max(l1) if l1 else None,
                   "cpus": cpus}


def speedup_pairs(records: list[dict]):
    """Each record with a speedup, its reference, and their throughputs paired by round.

    The reference is the same method at N = 1 (or the control, or ``single``). Sweep records
    (``sweep`` set) are paired with the sweep's N = 1 at the same batch. Yields
    ``(record, reference, num, den)``.
    """
    def key(r):
        return (r["method"], r.get("sweep"))

    base = {key(r): r for r in records
            if r["status"] == "ok" and r["nprocs"] == 1 and "samples_per_s" in r}
    for r in records:
        if r["status"] != "ok" or "samples_per_s" not in r:
            continue
        ref = base.get(key(r))
        if ref is None and r.get("sweep") is None:
            ref = base.get((CONTROL, None)) or base.get(("single", None))
        if ref is None:
            continue
        num, den = _paired(r, ref)
        if num:
            yield r, ref, num, den


def add_speedups(records: list[dict]) -> None:
    """Speedup against the same method at N = 1 (or the control, or ``single``), paired by
    round (see ``speedup_pairs``)."""
    for r, ref, num, den in list(speedup_pairs(records)):
        ci = ratio_ci(num, den)
        if ref is r:  # N = 1 against itself: exactly 1
            ci.update(value=1.0, lo=None, hi=None)
        n = r["nprocs"]
        r.update(speedup=ci["value"], speedup_lo=ci["lo"], speedup_hi=ci["hi"],
                 speedup_rounds=ci["n"], speedup_vs=ref["method"],
                 efficiency=ci["value"] / n,
                 efficiency_lo=None if ci["lo"] is None else ci["lo"] / n,
                 efficiency_hi=None if ci["hi"] is None else ci["hi"] / n)


def throughput_ratios(records: list[dict], pairs) -> list[dict]:
    """``a`` against ``b`` at the same N, paired by round, for each (a, b) pair present."""
    recs = {(r["method"], r["nprocs"]): r for r in records
            if r["status"] == "ok" and r.get("sweep") is None and "samples_per_s" in r}
    out = []
    for a, b in pairs:
        for n in sorted({n for (m, n) in recs if m == a}):
            if (b, n) not in recs:
                continue
            num, den = _paired(recs[(a, n)], recs[(b, n)])
            if num:
                ci = ratio_ci(num, den)
                out.append({"a": a, "b": b, "nprocs": n, "value": ci["value"], "lo": ci["lo"],
                            "hi": ci["hi"], "rounds": ci["n"]})
    return out


def judge(records: list[dict], control_floor: float = 0.85) -> dict:
    """Flag unreliable results; return the run's verdict (``busy``, ``control``, ``messages``).

    Each record gets ``flags`` (the reasons, in words) and ``reliability`` ("ok" or
    ``BUSY``). Call after :func:`add_speedups`.
    """
    verdict = {"busy": False, "control": [], "messages": [], "control_floor": control_floor}
    short = []
    for r in records:
        if r["method"] == CONTROL and r.get("sweep") is None and r["nprocs"] > 1 \
                and r.get("speedup") is not None:
            want = control_floor * r["nprocs"]
            c = {"nprocs": r["nprocs"], "speedup": r["speedup"], "lo": r.get("speedup_lo"),
                 "hi": r.get("speedup_hi"), "floor": want, "short": r["speedup"] < want}
            verdict["control"].append(c)
            if c["short"]:
                short.append(c)
    for r in records:
        flags = []
        if r["status"] == "ok" and "samples_per_s" in r:
            n = r["nprocs"]
            if n > 1 and r.get("speedup") is not None:
                if short:  # the machine was busy during this run, not only at this N
                    c = next((c for c in short if c["nprocs"] == n), short[0])
                    flags.append(
                        f"the control `{CONTROL}` reached {c['speedup']:.2f}x at N={c['nprocs']}, "
                        f"short of the {c['floor']:.2f}x (= {control_floor:g} x N) an idle "
                        "machine gives")
                lo = r.get("speedup_lo")
                if lo is not None and lo > n:
                    flags.append(f"speedup {fmt_ci(r['speedup'], lo, r.get('speedup_hi'))} is "
                                 f"above the ideal {n} by more than its interval")
            load = r.get("load") or {}
            fc = load.get("foreign_cores")
            if fc is not None and fc > busy_threshold(load.get("cpus")):
                flags.append(f"other processes used {fc:.2f} cores during its runs")
            if (load.get("steal") or 0) > STEAL_LIMIT:
                flags.append(f"the hypervisor stole {100 * load['steal']:.0f}% of the CPU")
        r["flags"] = flags
        r["reliability"] = BUSY if flags else ("ok" if r["status"] == "ok" else "")
    # A speedup is only as good as its N = 1: a busy N = 1 run makes the speedup suspect too.
    busy_one = {(r["method"], r.get("sweep")) for r in records
                if r["nprocs"] == 1 and r.get("flags")}
    for r in records:
        if r["nprocs"] > 1 and r.get("speedup") is not None and not r["flags"] \
                and (r.get("speedup_vs"), r.get("sweep")) in busy_one:
            r["flags"].append(f"its N=1 run (`{r['speedup_vs']}`) was taken on a busy machine")
            r["reliability"] = BUSY
    flagged = [r for r in records if r.get("reliability") == BUSY]
    msgs = verdict["messages"]
    for c in verdict["control"]:
        msgs.append(f"The control `{CONTROL}` (ranks that never communicate) reached "
                    f"{fmt_ci(c['speedup'], c['lo'], c['hi'])}x at N={c['nprocs']}; an idle "
                    f"machine gives at least {c['floor']:.2f}x (control floor {control_floor:g}"
                    f" x N): {'SHORT, the machine was busy' if c['short'] else 'fine'}.")
    if not verdict["control"] and any(r["nprocs"] > 1 for r in records):
        msgs.append(f"No control: `{CONTROL}` has no speedup in this run (it needs N = 1 and "
                    "N > 1), so a busy machine shows only in the load figures.")
    if flagged:
        verdict["busy"] = True
        names = ", ".join(sorted({f"{r['method']} N={r['nprocs']}"
                                  + (f" batch {r['sweep']}" if r.get('sweep') else "")
                                  for r in flagged}))
        msgs.append(f"{len(flagged)} result(s) are marked '{BUSY}': {names}. Do not teach "
                    "these numbers; rerun on an idle machine (nothing else running).")
    else:
        msgs.append("No sign of a busy machine: the control reached its floor, no speedup "
                    "exceeded the ideal beyond its interval, and no other process took the CPU.")
    return verdict
