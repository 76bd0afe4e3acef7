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


def _nice_step(raw: float, *, whole: bool) -> float:
    """The smallest of 1, 2, 2.5, 5 × 10^n at or above `raw`; with `whole` (counts of
    requests or tokens) never a fraction, so no axis reads "2.5 requests"."""
    if raw <= 0:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    for multiple in (1, 2, 2.5, 5, 10):
        step = multiple * magnitude
        if whole and (step < 1 or step % 1):
            continue
        if raw <= step:
            return step
    return 10 * magnitude


def _axis(top_value: float, *, whole: bool, intervals: int = 4) -> tuple[float, float]:
    """A round step and the axis maximum (a multiple of it at or above `top_value`), with
    at most `intervals` steps."""
    step = _nice_step(top_value / intervals, whole=whole)
    return step, max(step, math.ceil(top_value / step - 1e-9) * step)


def compact(value: float) -> str:
    """12, 1.2k, 3.4M: short enough for an axis."""
    for limit, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.1f}".rstrip("0").rstrip(".") + suffix
    return f"{value:.2f}".rstrip("0").rstrip(".") if value % 1 else str(int(value))


def bar_chart(points: list[tuple[str, float]], *, title: str, width: int = 720,
              height: int = 200, label_every: int = 5, fmt=compact) -> BarChart:
    """Vertical bars for `points` (label, value) in order, with at most five y-axis ticks
    at round values."""
    left, top, bottom = 48, 8, 24
    plot_w, plot_h = width - left - 24, height - top - bottom  # room for the last label
    step, top_value = _axis(max((v for _, v in points), default=0),
                            whole=all(float(v).is_integer() for _, v in points))
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
    ticks = [Tick(y=round(top + plot_h - plot_h * (i * step / top_value), 2),
                  text=compact(i * step)) for i in range(round(top_value / step) + 1)]
    return BarChart(title=title, width=width, height=height, plot_left=left,
                    plot_bottom=top + plot_h, bars=bars, ticks=ticks, x_labels=labels,
                    empty=not any(v > 0 for _, v in points))


def share(value: float, total: float) -> int:
    """A percentage for a horizontal bar (0-100), drawn as an SVG rect's width."""
    return 0 if total <= 0 else max(1, round(100 * value / total)) if value > 0 else 0
