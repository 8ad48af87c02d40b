"""Draw how ``DistributedSampler`` shards a dataset: shuffle, pad, deal out.

Each epoch the sampler shuffles the indices with the seed ``seed + epoch`` (the same on every
rank), pads the list by repeating its first entries until its length divides by the world
size, and gives rank r the positions r, r + N, r + 2N, ... The figure is drawn from what
``torch.utils.data.DistributedSampler`` itself returns, for training (shuffled, two epochs)
and for evaluation (not shuffled, where a repeat is counted twice unless dropped).

``python tools/draw_figures.py`` rewrites ``distributed_sampler.svg`` next to this file; the
lesson's notebook calls :func:`draw`.
"""

from __future__ import annotations

RANK_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
PAD = "#d62728"


def dealt(n_samples: int, world: int, epoch: int, shuffle: bool, seed: int = 0) -> list[int]:
    """The sampler's padded list for one epoch, rebuilt from what each rank gets: position
    ``i * world + r`` is rank r's i-th index."""
    from torch.utils.data import DistributedSampler

    shares = []
    for rank in range(world):
        sampler = DistributedSampler(range(n_samples), num_replicas=world, rank=rank,
                                     shuffle=shuffle, seed=seed)
        sampler.set_epoch(epoch)
        shares.append(list(sampler))
    return [shares[pos % world][pos // world] for pos in range(len(shares[0]) * world)]


def _cell(ax, x, y, text, face, edge="#555555", lw=0.6, color="black", hatch=None):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x - 0.45, y - 0.4), 0.9, 0.8, facecolor=face, edgecolor=edge, lw=lw,
                           hatch=hatch))
    ax.text(x, y, text, ha="center", va="center", fontsize=8, color=color)


def _panel(ax, n_samples: int, world: int, epoch: int, shuffle: bool, title: str) -> None:
    order = dealt(n_samples, world, epoch, shuffle)
    total = len(order)
    ax.text(-0.7, 0, "padded list", ha="right", va="center", fontsize=8)
    ax.text(-0.7, 0.6, "position", ha="right", va="bottom", fontsize=6, color="#777777")
    for pos, idx in enumerate(order):
        r = pos % world
        padded = pos >= n_samples
        _cell(ax, pos, 0, str(idx), RANK_COLORS[r % len(RANK_COLORS)] + "55",
              edge=PAD if padded else "#555555", lw=2 if padded else 0.6)
        ax.text(pos, 0.6, f"{pos}", ha="center", va="bottom", fontsize=6, color="#777777")
    for r in range(world):
        y = -1.5 - r
        ax.text(-0.7, y, f"rank {r} gets", ha="right", va="center", fontsize=8,
                color=RANK_COLORS[r % len(RANK_COLORS)], weight="bold")
        for i, pos in enumerate(range(r, total, world)):
            padded = pos >= n_samples
            _cell(ax, i * world + r, y, str(order[pos]), RANK_COLORS[r % len(RANK_COLORS)],
                  edge=PAD if padded else "#555555", lw=2 if padded else 0.6, color="white")
            ax.plot([pos, i * world + r], [-0.42, y + 0.42], color="#bbbbbb", lw=0.5, zorder=0)
    pad = total - n_samples
    note = (f"{n_samples} samples, {world} ranks: {pad} repeat{'s' * (pad != 1)} (red) "
            f"pad{'s' * (pad == 1)} the list to {total}" if pad else
            f"{n_samples} samples divide by {world} ranks: no padding")
    ax.text(-0.7 + total / 2, -1.5 - world + 0.35, note, ha="center", va="center",
            fontsize=7.5, style="italic")
    ax.set_title(title, fontsize=9, loc="left")
    ax.set_xlim(-3.2, max(total, 12) - 0.3)
    ax.set_ylim(-1.5 - world + 0.0, 1.1)
    ax.set_aspect("equal")
    ax.axis("off")


def draw(n_samples: int = 11, world: int = 3, n_eval: int = 5, world_eval: int = 2):
    """Training (``n_samples`` on ``world`` ranks, shuffled, epochs 0 and 1) and evaluation
    (``n_eval`` on ``world_eval`` ranks, not shuffled)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8.5, 7.4),
                             gridspec_kw={"height_ratios": [world + 2, world + 2, world_eval + 2]})
    for epoch, ax in enumerate(axes[:2]):
        _panel(ax, n_samples, world, epoch, True,
               f"training, epoch {epoch}: shuffled with seed + {epoch} (set_epoch({epoch})), "
               f"the same list on every rank, dealt out in turn")
    _panel(axes[2], n_eval, world_eval, 0, False,
           "evaluation (shuffle=False): the repeat is counted twice unless a rank drops it")
    fig.suptitle("DistributedSampler: shuffle one list, pad it with its first entries, deal it "
                 "out", fontsize=10.5)
    fig.tight_layout()
    return fig


FIGURES = {"distributed_sampler.svg": draw}
