"""Plots for the HTML pages the platform writes (drift and cost reports): matplotlib figures as inline SVG."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure


def inline_svg(figure: "Figure") -> str:
    """The figure as an ``<svg>`` element to put in a page (no XML prolog or DOCTYPE); the figure is closed."""
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg"):]
