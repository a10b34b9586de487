"""Writing a figure: one PNG cropped to what was drawn, deterministic bytes (no software or date metadata).

Every figure module ends with ``save.finish(fig, path)``, called through this module, so that a test can
swap :func:`finish` to keep the figure and read what it holds.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from kvqbench.report.render.figures.style import DPI

__all__ = ["finish"]

#: room drawn around the figure (inches: left, bottom, right, top) so that what sticks out of it (a
#: legend or key beside the last axes) is on the canvas; the PNG is then cropped to what was drawn
_MARGIN_IN = (0.5, 0.5, 3.0, 0.5)
#: white space kept around the drawing (inches; matplotlib's ``savefig.pad_inches`` default)
_PAD_IN = 0.1


def finish(fig: Any, path: Path) -> Path:
    """Save ``fig`` to ``path`` cropped to its drawing plus :data:`_PAD_IN`, close it, return ``path``.

    The crop is what ``bbox_inches="tight"`` gives, in one draw instead of two (``"tight"`` draws once
    to measure and once to paint): the figure is painted once onto a canvas :data:`_MARGIN_IN` larger
    on each side, and the pixels that differ from the background decide the crop. When the drawing
    reaches the canvas edge (something far outside the figure) it falls back to ``"tight"``."""
    import matplotlib.pyplot as plt

    try:
        if not _save_cropped(fig, path):
            fig.savefig(path, dpi=DPI, metadata={"Software": None}, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def _save_cropped(fig: Any, path: Path) -> bool:
    """Paint ``fig`` once with the margin, write the crop to ``path``; ``False`` (nothing written) when
    the drawing touches the canvas edge or the raw buffer is not the renderer's size."""
    import numpy as np
    from matplotlib.image import imsave
    from matplotlib.transforms import Bbox

    w, h = fig.get_size_inches()
    left, bottom, right, top = _MARGIN_IN
    buf = io.BytesIO()
    fig.savefig(buf, format="rgba", dpi=DPI, bbox_inches=Bbox.from_extents(-left, -bottom, w + right, h + top))
    r = fig.canvas.renderer  # the one that painted the larger canvas
    width, height = int(r.width), int(r.height)
    raw = buf.getbuffer()
    if width * height * 4 != raw.nbytes:
        return False
    img = np.frombuffer(raw, dtype=np.uint8).reshape(height, width, 4)
    px = img.view(np.uint32).reshape(height, width)  # one RGBA pixel per word: one comparison each
    ink = px != px[0, 0]
    rows, cols = np.flatnonzero(ink.any(1)), np.flatnonzero(ink.any(0))
    if not rows.size or rows[0] == 0 or cols[0] == 0 or rows[-1] == height - 1 or cols[-1] == width - 1:
        return False
    pad = int(round(_PAD_IN * DPI))
    crop = img[max(rows[0] - pad, 0):rows[-1] + 1 + pad, max(cols[0] - pad, 0):cols[-1] + 1 + pad]
    imsave(path, np.ascontiguousarray(crop), format="png", dpi=DPI, metadata={"Software": None})
    return True
