"""Draw what ``nn.DataParallel`` does on every forward: scatter, replicate, parallel apply,
gather, and the gradients summed back onto the root's weights in backward.

``python tools/draw_figures.py`` rewrites ``data_parallel.svg`` next to this file (see
:data:`FIGURES`); the lesson's notebook calls :func:`draw` to show the same figure.
"""

from __future__ import annotations

COLORS = ["#4c72b0", "#dd8452", "#55a868"]  # one per device


def _box(ax, x, y, w, h, text, color="#eeeeee", edge="#333333", size=9, weight="normal"):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02",
                                facecolor=color, edgecolor=edge, lw=1))
    ax.text(x, y, text, ha="center", va="center", fontsize=size, weight=weight)


def _arrow(ax, a, b, color="#333333", style="-|>", ls="-", rad=0.0):
    from matplotlib.patches import FancyArrowPatch

    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=11, color=color,
                                 lw=1.2, ls=ls, connectionstyle=f"arc3,rad={rad}",
                                 shrinkA=2, shrinkB=2))


def draw(n: int = 3, batch: int = 7):
    """The figure for ``n`` devices and a batch of ``batch`` samples (chunks of ceil(B/n))."""
    import matplotlib.pyplot as plt

    size = -(-batch // n)
    chunks = [min(size, batch - i) for i in range(0, batch, size)]
    n = len(chunks)
    fig, ax = plt.subplots(figsize=(10, 1.9 + 1.0 * n))
    ys = [n - 1 - k for k in range(n)]
    mid = (n - 1) / 2
    top = n - 0.15
    for x, text in [(0.6, "on the root device"), (2.3, "1. scatter"), (4.2, "2. replicate"),
                    (6.3, "3. parallel apply"), (8.4, "4. gather")]:
        ax.text(x, top + 0.45, text, ha="center", va="bottom", fontsize=10, weight="bold")
    _box(ax, 0.6, mid, 1.3, 0.55, f"batch\n{batch} samples", color="#f5f5f5")
    _box(ax, 4.2, top, 1.9, 0.4, "model: the root's weights", color="#f5f5f5")
    bus = 3.15
    ax.plot([3.25, bus, bus], [top, top, ys[-1] + 0.1], color="#555555", lw=1.4)
    ax.text(5.25, top, "copied to every replica; in backward the replicas'\n"
            "gradients are SUMMED back onto these weights",
            ha="left", va="center", fontsize=8, color="#555555", style="italic")
    for k, (y, rows) in enumerate(zip(ys, chunks)):
        c = COLORS[k % len(COLORS)]
        ax.text(-0.3, y, f"device {k}", ha="right", va="center", fontsize=9, color=c,
                weight="bold")
        _box(ax, 2.3, y, 1.1, 0.5, f"chunk {k}\n{rows} sample{'s' * (rows > 1)}", color=c + "33")
        _box(ax, 4.2, y, 1.4, 0.5, f"replica {k}", color=c + "33")
        _box(ax, 6.3, y, 1.2, 0.5, f"out {k}\n{rows} row{'s' * (rows > 1)}", color=c + "33")
        _arrow(ax, (1.25, mid), (1.75, y), color=c)                # scatter
        _arrow(ax, (bus, y + 0.1), (3.5, y + 0.1), color="#555555")  # replicate
        _arrow(ax, (2.85, y - 0.1), (3.5, y - 0.1), color=c)        # chunk k into replica k
        _arrow(ax, (4.9, y), (5.7, y), color=c)                     # replica k runs chunk k
        _arrow(ax, (6.9, y), (7.7, mid), color=c)                   # gather
    _box(ax, 8.4, mid, 1.4, 0.8, f"output\n{batch} rows, in order", color="#f5f5f5")
    ax.text(4.2, -0.85, "replicas are rebuilt on every forward and run at the same time, one per "
            "device; the loss and the optimizer step run on the root",
            ha="center", va="center", fontsize=8.5, style="italic")
    ax.set_xlim(-1.3, 9.3)
    ax.set_ylim(-1.1, n + 0.6)
    ax.axis("off")
    ax.set_title("nn.DataParallel: one forward", fontsize=11)
    fig.tight_layout()
    return fig


FIGURES = {"data_parallel.svg": draw}
