"""Redraw the lessons' diagrams, the SVGs committed under ``solutions/NN_*/figures/``.

A lesson's figures are drawn by code: every module ``solutions/NN_*/figures/*.py`` that
defines ``FIGURES = {"name.svg": draw}`` (``draw()`` returns a matplotlib figure) owns the
SVGs it names, next to itself. Notebooks call the same ``draw`` functions; READMEs link the
SVGs. The SVGs are written so that drawing twice gives the same bytes (fixed ids, no date),
so a test can tell when a committed figure no longer is what its code draws.

    python tools/draw_figures.py           # rewrite every lesson's SVGs
    python tools/draw_figures.py --check   # list the stale ones, exit 1 if any

Then ``make exercises`` copies them into ``exercises/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS = REPO / "solutions"
RC = {"svg.hashsalt": "data-parallel-pytorch", "svg.fonttype": "none"}
CREATOR = re.compile(rb"Matplotlib v([0-9][^,<\s]*)")


def modules(tree: Path = SOLUTIONS) -> list[Path]:
    """Every figure module of the lessons in ``tree``, in lesson order."""
    return sorted(p for p in tree.glob("[0-9][0-9]_*/figures/*.py")
                  if "FIGURES" in p.read_text())


def load(path: Path):
    """Import a figure module from its file (under a name of its own: every lesson's folder
    is called ``figures``). Drawing needs nothing from the lesson's other modules."""
    name = f"_figures_{path.parent.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def svg_bytes(draw) -> bytes:
    """``draw()``'s figure as SVG bytes that do not change from one run to the next."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context(RC):
        fig = draw()
        buf = io.BytesIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buf.getvalue()


def drawn_by(svg: bytes) -> str | None:
    """The matplotlib version an SVG was written by (matplotlib puts it in the metadata)."""
    m = CREATOR.search(svg)
    return m.group(1).decode() if m else None


def figures(tree: Path = SOLUTIONS):
    """(svg path, draw function) for every figure of the lessons in ``tree``."""
    for path in modules(tree):
        for name, draw in load(path).FIGURES.items():
            yield path.parent / name, draw


def stale(tree: Path = SOLUTIONS) -> list[str]:
    """The committed SVGs that differ from what their code draws now."""
    out = []
    for svg, draw in figures(tree):
        if not svg.is_file() or svg.read_bytes() != svg_bytes(draw):
            out.append(str(svg.relative_to(tree.parent)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only list the stale SVGs")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for path in bad:
            print(f"stale: {path}")
        if bad:
            print("run `python tools/draw_figures.py` and `make exercises` (or `make figures`)", file=sys.stderr)
        return 1 if bad else 0
    for svg, draw in figures():
        svg.write_bytes(svg_bytes(draw))
        print(f"wrote {svg.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
