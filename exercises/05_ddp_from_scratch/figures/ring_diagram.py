"""Draw the ring all-reduce of task 05.1 for N ranks, chunk by chunk, one panel per step.

Every rank starts with its own tensor (rank 0's is ``a``, rank 1's ``b``, ...) cut into N
chunks. A cell of the figure is one chunk on one rank; its colour says how many ranks'
contributions it holds so far, its text which ones. Arrows are what each rank sends in that
step: N-1 steps of reduce-scatter (the receiver *adds*), then N-1 of all-gather (the receiver
*copies*). The chunk indices are the ones ``collectives.ring_all_reduce``'s docstring gives.

``python tools/draw_figures.py`` rewrites ``ring_allreduce.svg`` next to this file; the lesson's
notebook calls :func:`draw`.
"""

from __future__ import annotations

NAMES = "abcdefgh"
# how many ranks' contributions a chunk holds: 1 (its own) .. N-1, then the finished sum
SHADES = ["#eef3fb", "#c6dbef", "#6baed6", "#2171b5"]
DONE = "#41ab5d"


def ring_steps(n: int) -> list[dict]:
    """The state after each step of the ring all-reduce on ``n`` ranks.

    Each entry: ``title``, ``phase`` ("start", "reduce-scatter" or "all-gather"), ``have``
    (``have[r][c]`` is the set of ranks whose chunk c rank r has summed so far) and ``sends``
    (the ``(rank, chunk)`` pairs sent to the right neighbour in that step).
    """
    have = [[{r} for _ in range(n)] for r in range(n)]
    steps = [{"title": "start: every rank holds its own tensor", "phase": "start",
              "have": [[set(c) for c in row] for row in have], "sends": []}]
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            # rank r sends chunk (r - s) mod n in reduce-scatter, (r + 1 - s) mod n in
            # all-gather; its right neighbour receives that same chunk
            sends = [(r, (r - s + (phase == "all-gather")) % n) for r in range(n)]
            new = [[set(c) for c in row] for row in have]
            for r, c in sends:
                dst = (r + 1) % n
                new[dst][c] = (have[dst][c] | have[r][c]) if phase == "reduce-scatter" \
                    else set(have[r][c])
            have = new
            verb = "adds" if phase == "reduce-scatter" else "copies"
            steps.append({"title": f"{phase}, step {s + 1} of {n - 1}: receiver {verb}",
                          "phase": phase, "have": [[set(c) for c in row] for row in have],
                          "sends": sends})
    return steps


def _colour(k: int, n: int) -> str:
    """Darker with more ranks summed in; green once all ``n`` are."""
    if k == n:
        return DONE
    return SHADES[round((k - 1) / max(1, n - 2) * (len(SHADES) - 1))]


def _panel(ax, step: dict, n: int, row_labels: bool) -> None:
    from matplotlib.patches import FancyArrowPatch, Rectangle

    w, h, gap = 0.9, 0.8, 1.28  # cell width and height, distance between ranks
    received = {((r + 1) % n, c) for r, c in step["sends"]}
    sent = set(step["sends"])
    for r in range(n):
        x = r * gap
        ax.text(x, 0.75, f"rank {r}", ha="center", va="bottom", fontsize=8, weight="bold")
        for c in range(n):
            y = -c
            got = step["have"][r][c]
            edge, lw = ("#d62728", 2.0) if (r, c) in received else ("#555555", 0.6)
            ax.add_patch(Rectangle((x - w / 2, y - h / 2), w, h, facecolor=_colour(len(got), n),
                                   edgecolor=edge, lw=lw))
            dark = len(got) > n / 2
            ax.text(x, y, "+".join(NAMES[i] for i in sorted(got)), ha="center", va="center",
                    fontsize=7 if len(got) < 4 else 6.2, color="white" if dark else "black",
                    weight="bold" if 1 < len(got) == n < 4 else "normal")
            if (r, c) in sent:
                ax.add_patch(Rectangle((x - w / 2, y - h / 2), w, h, fill=False,
                                       edgecolor="#333333", lw=1.4, ls=(0, (2, 1.5))))
    for r, c in step["sends"]:
        y = -c
        if r + 1 < n:
            ax.add_patch(FancyArrowPatch((r * gap + w / 2, y), ((r + 1) * gap - w / 2, y),
                                         arrowstyle="-|>", mutation_scale=9, lw=1.3,
                                         color="#d62728", shrinkA=0, shrinkB=0))
        else:  # the ring closes: the last rank sends to rank 0
            ax.add_patch(FancyArrowPatch((r * gap + w / 2, y), (r * gap + w / 2 + 0.3, y),
                                         arrowstyle="-|>", mutation_scale=9, lw=1.3,
                                         color="#d62728", shrinkA=0, shrinkB=0))
            ax.text(r * gap + w / 2 + 0.33, y, "to\nrank 0", fontsize=6, va="center",
                    color="#d62728")
            ax.add_patch(FancyArrowPatch((-w / 2 - 0.3, y), (-w / 2, y), arrowstyle="-|>",
                                         mutation_scale=9, lw=1.3, color="#d62728",
                                         shrinkA=0, shrinkB=0))
            ax.text(-w / 2 - 0.33, y, f"from\nrank {n - 1}", fontsize=6, va="center",
                    ha="right", color="#d62728")
    if row_labels:
        for c in range(n):
            ax.text(-w / 2 - 0.1, -c, f"chunk {c}", fontsize=7.5, ha="right", va="center",
                    color="#444444")
    ax.set_title(step["title"], fontsize=8.5)
    ax.set_xlim(-w / 2 - 0.85, (n - 1) * gap + w / 2 + 0.75)
    ax.set_ylim(-(n - 1) - 0.7, 1.2)
    ax.set_aspect("equal")
    ax.axis("off")


def _legend(ax, n: int) -> None:
    from matplotlib.patches import Rectangle

    ax.axis("off")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    rows = [(_colour(1, n), "a chunk of its own rank's data only")]
    rows += [(_colour(k, n), f"the sum of {k} ranks' chunks") for k in range(2, n)]
    rows.append((DONE, f"the finished sum of all {n} ranks' chunks"))
    for i, (colour, label) in enumerate(rows):
        y = 0.93 - 0.085 * i
        ax.add_patch(Rectangle((0.02, y - 0.03), 0.07, 0.06, facecolor=colour,
                               edgecolor="#555555", lw=0.6))
        ax.text(0.12, y, label, fontsize=7.5, va="center")
    y = 0.93 - 0.085 * len(rows)
    ax.add_patch(Rectangle((0.02, y - 0.03), 0.07, 0.06, fill=False, edgecolor="#333333",
                           lw=1.4, ls=(0, (2, 1.5))))
    ax.text(0.12, y, "sent to the right neighbour", fontsize=7.5, va="center")
    y -= 0.085
    ax.add_patch(Rectangle((0.02, y - 0.03), 0.07, 0.06, fill=False, edgecolor="#d62728",
                           lw=2.0))
    ax.text(0.12, y, "received this step", fontsize=7.5, va="center")
    ax.text(0.0, y - 0.1,
            f"rank r's tensor is '{NAMES[0]}' for rank 0, '{NAMES[1]}' for rank 1, ...;\n"
            f"'a+b' in row c: a's chunk c + b's chunk c.\n\n"
            f"Every step, each rank sends ONE chunk, 1/{n} of\n"
            f"the tensor, and all {n} links are busy at once.\n"
            f"After {n - 1} reduce-scatter steps rank r owns the\n"
            f"finished chunk (r + 1) mod {n}; {n - 1} all-gather steps\n"
            f"pass those on. Each rank sends 2(N-1)/N = "
            f"{2 * (n - 1) / n:g}x\nthe tensor, whatever N is.",
            fontsize=7.5, va="top", linespacing=1.35)


def draw(n: int = 4):
    """The figure for ``n`` ranks (2 to 8): start, N-1 reduce-scatter and N-1 all-gather steps."""
    import matplotlib.pyplot as plt

    if not 2 <= n <= len(NAMES):
        raise ValueError(f"draw the ring for 2 to {len(NAMES)} ranks, not {n}")
    steps = ring_steps(n)
    cols = n  # start + N-1 reduce-scatter steps on the first row; legend + all-gather below
    fig, axes = plt.subplots(2, cols, figsize=(3.4 * cols, 2 * (0.55 * n + 1.1)))
    _panel(axes[0][0], steps[0], n, row_labels=True)
    for i in range(1, n):
        _panel(axes[0][i], steps[i], n, row_labels=False)
        _panel(axes[1][i], steps[n - 1 + i], n, row_labels=False)
    _legend(axes[1][0], n)
    fig.suptitle(f"Ring all-reduce on {n} ranks: {n - 1} reduce-scatter steps (top), then "
                 f"{n - 1} all-gather steps (bottom)", fontsize=11)
    fig.tight_layout()
    return fig


FIGURES = {"ring_allreduce.svg": draw}
