"""Billing periods: UTC calendar months, named by their first day (no Django here)."""

from __future__ import annotations

from datetime import UTC, date, datetime, time


def period_of(moment: datetime) -> date:
    """The first day of the UTC month ``moment`` falls in."""
    moment = moment.astimezone(UTC)
    return date(moment.year, moment.month, 1)


def period_after(period: date) -> date:
    return date(period.year + 1, 1, 1) if period.month == 12 else date(period.year,
                                                                       period.month + 1, 1)


def period_bounds(period: date) -> tuple[datetime, datetime]:
    """[start, end) of the period as aware UTC datetimes."""
    return day_start(period), day_start(period_after(period))


def period_label(period: date) -> str:
    return f"{period.year:04d}-{period.month:02d}"


def day_start(day: date) -> datetime:
    return datetime.combine(day, time(0), tzinfo=UTC)

