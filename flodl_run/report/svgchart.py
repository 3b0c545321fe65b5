"""Line charts as inline SVG text, for the self-contained dashboard (no JS, no network).

Owns scaling, ticks, polylines and the legend. Colours are CSS classes (`s0`..`s7`) and
`currentColor`, so the page's theme (light, dark, auto) styles every chart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import List, Optional, Sequence, Tuple

NUM_COLOURS = 8        # series classes s0..s7, then they repeat
MAX_POINTS = 1500      # a longer series is thinned (every k-th point, last kept): small files
MARKERS_UP_TO = 40     # draw point markers only when they stay readable
PAD_L, PAD_R, PAD_T, PAD_B = 56, 12, 28, 34


@dataclass
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[Optional[float]]


def nice_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> List[float]:
    """Round tick values covering [lo, hi]: steps of 1, 2, 2.5 or 5 times a power of ten
    (whole steps only with `integer`, for epochs and reduce rounds)."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0]
    if hi <= lo:
        return [lo]
    rough = (hi - lo) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(rough))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= rough)
    if integer:
        step = max(1.0, float(round(step)))
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(value: float) -> str:
    if value != 0 and (abs(value) >= 1e7 or abs(value) < 1e-3):
        return f"{value:.1e}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _thin(points: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    if len(points) <= MAX_POINTS:
        return points
    k = math.ceil(len(points) / MAX_POINTS)
    return points[::k] + ([points[-1]] if (len(points) - 1) % k else [])


def _bounds(values: List[float], pad_zero: bool) -> Tuple[float, float]:
    lo, hi = min(values), max(values)
    if pad_zero and lo > 0 and lo < 0.5 * hi:
        lo = 0.0  # a near-zero floor reads better than a floating one
    if hi == lo:
        lo, hi = lo - (abs(lo) * 0.1 or 1.0), hi + (abs(hi) * 0.1 or 1.0)
    return lo, hi


def line_chart(title: str, series: Sequence[Series], x_label: str, *, width: int = 560,
               height: int = 260, step: bool = False,
               y_labels: Optional[Sequence[str]] = None) -> str:
    """An <svg> element. `step`: hold each value until the next x (phase-like data);
    `y_labels`: name integer y values 0..n-1 instead of numbering them."""
    data = [(s, _thin([(x, y) for x, y in zip(s.xs, s.ys) if y is not None and math.isfinite(y)]))
            for s in series]
    data = [(s, pts) for s, pts in data if pts]
    head = (f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
            f'role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">'
            f'<text class="title" x="{PAD_L}" y="17">{escape(title)}</text>')
    if not data:
        return head + (f'<text class="muted" x="{width / 2}" y="{height / 2}" '
                       f'text-anchor="middle">no data</text></svg>')
    xs = [x for _, pts in data for x, _ in pts]
    ys = [y for _, pts in data for _, y in pts]
    x0, x1 = _bounds(xs, pad_zero=False)
    if y_labels:
        y0, y1 = -0.25, len(y_labels) - 0.75
    else:
        y0, y1 = _bounds(ys, pad_zero=True)
    plot_w, plot_h = width - PAD_L - PAD_R, height - PAD_T - PAD_B

    def px(x: float) -> float:
        return PAD_L + (x - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return PAD_T + (1 - (y - y0) / (y1 - y0)) * plot_h

    parts = [head]
    y_ticks = [(float(i), lab) for i, lab in enumerate(y_labels)] if y_labels else [
        (t, _fmt(t)) for t in nice_ticks(y0, y1)]
    for value, label in y_ticks:
        y = py(value)
        parts.append(f'<line class="grid" x1="{PAD_L}" x2="{width - PAD_R}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text class="tick" x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{escape(label)}</text>')
    for t in nice_ticks(x0, x1, 6, integer=all(float(x).is_integer() for x in xs)):
        x = px(t)
        parts.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T}" y2="{PAD_T + plot_h}"/>'
                     f'<text class="tick" x="{x:.1f}" y="{PAD_T + plot_h + 15}" '
                     f'text-anchor="middle">{_fmt(t)}</text>')
    parts.append(f'<text class="muted" x="{PAD_L + plot_w / 2}" y="{height - 3}" '
                 f'text-anchor="middle">{escape(x_label)}</text>')
    for i, (s, pts) in enumerate(data):
        parts.append(_polyline(pts, px, py, i % NUM_COLOURS, step))
    parts.append(_legend([s.label for s, _ in data], width))
    return "".join(parts) + "</svg>"


def _polyline(pts, px, py, colour: int, step: bool) -> str:
    coords: List[str] = []
    for j, (x, y) in enumerate(pts):
        if step and j:
            coords.append(f"{px(x):.1f},{py(pts[j - 1][1]):.1f}")
        coords.append(f"{px(x):.1f},{py(y):.1f}")
    out = f'<polyline class="line s{colour}" points="{" ".join(coords)}"/>'
    if len(pts) <= MARKERS_UP_TO:
        out += "".join(f'<circle class="dot s{colour}" cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5"/>'
                       for x, y in pts)
    return out


def _legend(labels: List[str], width: int) -> str:
    if len(labels) < 2:
        return ""
    parts, x = [], width - PAD_R
    for i, label in reversed(list(enumerate(labels))):
        x -= 14 + 7 * len(label)
        parts.append(f'<rect class="swatch s{i % NUM_COLOURS}" x="{x}" y="8" width="10" height="10"/>'
                     f'<text class="tick" x="{x + 13}" y="17">{escape(label)}</text>')
    return "".join(parts)
