"""matplotlib figures rendered to PNG bytes, one way for every report (verify's and bench's)."""

from __future__ import annotations

import io


def figure(width: float, height: float):
    # A bare Figure (no pyplot) renders through Agg, never touches a user's global backend and is
    # freed with its last reference: pyplot's registry of open figures is what leaks in loops.
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    fig.clear()
    return buf.getvalue()
