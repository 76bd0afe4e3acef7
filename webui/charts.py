"""Geometry of the console's bar charts, drawn by templates as inline SVG (no script, no CSP
exception). Pure presentation: numbers in, rectangles and axis ticks out."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    label: str
    value: float
    text: str  # the value as shown in the bar's tooltip


@dataclass(frozen=True, slots=True)
class Tick:
    y: float
    text: str


@dataclass(frozen=True, slots=True)
class XLabel:
    x: float
    text: str


@dataclass(frozen=True, slots=True)
class BarChart:
    title: str
    width: int
    height: int
    plot_left: int
    plot_bottom: float
    bars: list[Bar]
    ticks: list[Tick]
    x_labels: list[XLabel]
    empty: bool


def _nice_max(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 × 10^n at or above `value` (1 when there is nothing)."""
    if value <= 0:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * magnitude:
            return step * magnitude
    return 10 * magnitude


def compact(value: float) -> str:
    """12, 1.2k, 3.4M: short enough for an axis."""
    for limit, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.1f}".rstrip("0").rstrip(".") + suffix
    return f"{value:.2f}".rstrip("0").rstrip(".") if value % 1 else str(int(value))


def bar_chart(points: list[tuple[str, float]], *, title: str, width: int = 720,
              height: int = 200, label_every: int = 5, fmt=compact) -> BarChart:
    """Vertical bars for `points` (label, value) in order, with four y-axis ticks."""
    left, top, bottom = 48, 8, 24
    plot_w, plot_h = width - left - 24, height - top - bottom  # room for the last label
    top_value = _nice_max(max((v for _, v in points), default=0))
    slot = plot_w / max(len(points), 1)
    bars = []
    labels = []
    for i, (label, value) in enumerate(points):
        h = plot_h * (value / top_value) if value > 0 else 0
        x = left + i * slot + slot * 0.15
        bars.append(Bar(x=round(x, 2), y=round(top + plot_h - h, 2),
                        width=round(slot * 0.7, 2), height=round(h, 2), label=label,
                        value=value, text=fmt(value)))
        if i % label_every == 0 or i == len(points) - 1:
            labels.append(XLabel(x=round(x + slot * 0.35, 2), text=label))
    ticks = [Tick(y=round(top + plot_h - plot_h * f, 2), text=compact(top_value * f))
             for f in (0, 0.25, 0.5, 0.75, 1)]
    return BarChart(title=title, width=width, height=height, plot_left=left,
                    plot_bottom=top + plot_h, bars=bars, ticks=ticks, x_labels=labels,
                    empty=not any(v > 0 for _, v in points))


def share(value: float, total: float) -> int:
    """A percentage for a horizontal bar (0-100), drawn as an SVG rect's width."""
    return 0 if total <= 0 else max(1, round(100 * value / total)) if value > 0 else 0
