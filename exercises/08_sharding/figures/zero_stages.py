"""What one rank holds under DDP, ZeRO-1, ZeRO-2 and ZeRO-3 / FSDP, drawn from the lesson's
own accounting (``zero_accounting.predict_bytes``, task 08.1).

One row per stage, one column per rank. Each rank has three bars: parameters, gradients and
optimizer state. The pale bar is the whole of that kind, as one process would hold it; the
solid part is what this rank keeps: all of it, or its 1/N shard, drawn where rank r's shard
sits. Every length comes from ``predict_bytes``, so the picture is only as right as your
task 08.1, and a wrong stage shows at a glance.
"""

from __future__ import annotations

KINDS = (("params", "parameters", "#4c72b0"), ("grads", "gradients", "#dd8452"),
         ("optimizer", "optimizer state", "#55a868"))


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def draw(num_params: int, world_size: int = 4, predict=None, **bytes_per_param):
    """The picture for a model of ``num_params`` parameters on ``world_size`` ranks.

    ``predict`` is ``zero_accounting.predict_bytes`` (the lesson's, by default);
    ``bytes_per_param`` (``param_bytes``, ``grad_bytes``, ``state_bytes``) goes to it.
    Returns the matplotlib figure; each solid bar's gid is ``"stage/rank/kind"``.
    """
    import matplotlib.pyplot as plt
    from zero_accounting import STAGE_LABELS, STAGES

    if predict is None:
        from zero_accounting import predict_bytes as predict
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    whole = predict(num_params, 1, "ddp", **bytes_per_param)  # one process holds everything
    widest = max(whole[kind] for kind, _, _ in KINDS)
    fig, axes = plt.subplots(len(STAGES), world_size, sharex=True, sharey=True, squeeze=False,
                             figsize=(2.3 * world_size + 1.8, 1.25 * len(STAGES) + 1.3))
    for row, stage in enumerate(STAGES):
        held = predict(num_params, world_size, stage, **bytes_per_param)
        for rank in range(world_size):
            ax = axes[row][rank]
            for y, (kind, _, color) in enumerate(KINDS):
                full, mine = whole[kind], held[kind]
                ax.barh(y, full, color=color, alpha=0.18, height=0.7)
                start = rank * mine if mine < full else 0.0  # rank r's shard: the r-th 1/N
                bar = ax.barh(y, mine, left=start, color=color, height=0.7)
                bar.patches[0].set_gid(f"{stage}/{rank}/{kind}")
            ax.set_xlim(0, widest * 1.02)
            ax.set_yticks([])
            ax.set_xticks([])
            ax.set_ylim(len(KINDS) - 0.4, -0.6)  # parameters on top
            for side in ("top", "right", "left"):
                ax.spines[side].set_visible(False)
            if row == 0:
                ax.set_title(f"rank {rank}", fontsize=9)
            if rank == world_size - 1:
                share = held["total"] / whole["total"] if whole["total"] else 0.0
                ax.text(1.04, 0.5, f"{_size(held['total'])}\n{share:.0%} of DDP's",
                        transform=ax.transAxes, va="center", fontsize=8)
        axes[row][0].set_ylabel(STAGE_LABELS[stage].replace(": ", ":\n"), rotation=0,
                                ha="right", va="center", fontsize=8, labelpad=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for _, _, color in KINDS]
    fig.legend(handles, [f"{label} ({_size(whole[kind])} in all)" for kind, label, _ in KINDS],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"What each of {world_size} ranks holds, for {num_params:,} parameters "
                 "(from predict_bytes): solid, this rank's part; pale, the whole",
                 fontsize=9.5)
    fig.tight_layout(rect=(0, 0.07, 0.93, 1))
    return fig
