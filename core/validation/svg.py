"""Plots of the validation report as inline SVG: no image file, no script, nothing
fetched, printable at any size.

:func:`scatter` draws points with straight lines over them: the method-comparison
plot (identity and fitted lines) and the Bland–Altman difference plot (bias and limits
as horizontal lines). Declined samples are drawn as open squares.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["scatter"]

_W, _H = 330, 250
_LEFT, _BOTTOM, _TOP, _RIGHT = 52, 38, 10, 10


def _tag(name: str, text: str | None = None, **attrs: Any) -> str:
    """One SVG element; ``stroke_width`` is written ``stroke-width``."""
    body = " ".join(
        f'{k.rstrip("_").replace("_", "-")}="{html.escape(str(v), quote=True)}"'
        for k, v in attrs.items()
    )
    if text is None:
        return f"<{name} {body}/>"
    return f"<{name} {body}>{html.escape(text)}</{name}>"


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values between ``lo`` and ``hi`` (``hi > lo``)."""
    span = hi - lo
    step = 10 ** math.floor(math.log10(span / n))
    for m in (1, 2, 5, 10):
        if span / (m * step) <= n:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]


def scatter(
    points: Sequence[tuple[float, float, bool]],
    *,
    xlabel: str,
    ylabel: str,
    lines: Sequence[tuple[float, float, str, str]] = (),
    hlines: Sequence[tuple[float, str, str]] = (),
    uid: str = "p",
) -> str:
    """A scatter plot as an ``<svg>`` element.

    Parameters
    ----------
    points : sequence of (x, y, declined)
        At least one point.
    xlabel, ylabel : str
    lines : sequence of (intercept, slope, colour, dash)
        Lines ``y = intercept + slope * x``; the y range then covers the x range, so
        that the identity line shows.
    hlines : sequence of (y, colour, dash)
    uid : str
        The id of the plot's clip path, unique on the page.
    """
    xs = [p[0] for p in points]
    ys = [p[1] for p in points] + [y for y, _, _ in hlines]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if lines:
        y0, y1 = min(y0, x0), max(y1, x1)
    pad_x, pad_y = (x1 - x0) * 0.06 or 1.0, (y1 - y0) * 0.06 or 1.0
    x0, x1, y0, y1 = x0 - pad_x, x1 + pad_x, y0 - pad_y, y1 + pad_y
    inner_w, inner_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def px(x: float) -> str:
        return f"{_LEFT + (x - x0) / (x1 - x0) * inner_w:.1f}"

    def py(y: float) -> str:
        return f"{_H - _BOTTOM - (y - y0) / (y1 - y0) * inner_h:.1f}"

    frame = {"x": _LEFT, "y": _TOP, "width": inner_w, "height": inner_h}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" font-size="10">',
        _tag("rect", **frame, fill="none", stroke="#8c959f"),
    ]
    for t in _ticks(x0, x1):
        parts.append(_tag("text", f"{t:.4g}", x=px(t), y=_H - _BOTTOM + 13, text_anchor="middle"))
    for t in _ticks(y0, y1):
        parts.append(_tag("text", f"{t:.4g}", x=_LEFT - 4, y=py(t), dy=3, text_anchor="end"))
        parts.append(_tag("line", x1=_LEFT, x2=_W - _RIGHT, y1=py(t), y2=py(t), stroke="#eaeef2"))
    parts.append(_tag("text", xlabel, x=_LEFT + inner_w / 2, y=_H - 6, text_anchor="middle"))
    turn = f"translate(12 {_TOP + inner_h / 2}) rotate(-90)"
    parts.append(_tag("text", ylabel, transform=turn, text_anchor="middle"))
    parts.append(f'<clipPath id="{uid}">{_tag("rect", **frame)}</clipPath>')
    parts.append(f'<g clip-path="url(#{uid})">')
    style = {"stroke_width": 1.3}
    for a, b, colour, dash in lines:
        ends = {"x1": px(x0), "y1": py(a + b * x0), "x2": px(x1), "y2": py(a + b * x1)}
        parts.append(_tag("line", **ends, stroke=colour, stroke_dasharray=dash, **style))
    for y, colour, dash in hlines:
        ends = {"x1": _LEFT, "x2": _W - _RIGHT, "y1": py(y), "y2": py(y)}
        parts.append(_tag("line", **ends, stroke=colour, stroke_dasharray=dash, **style))
    for x, y, declined in points:
        if declined:
            box = {"x": float(px(x)) - 3.5, "y": float(py(y)) - 3.5, "width": 7, "height": 7}
            parts.append(_tag("rect", **box, fill="none", stroke="#bc4c00", stroke_width=1.4))
        else:
            dot = {"cx": px(x), "cy": py(y), "r": 3.2}
            parts.append(_tag("circle", **dot, fill="#0969da", fill_opacity=0.75))
    parts.append("</g></svg>")
    return "".join(parts)
