"""The Lua scripts' keys and arguments by name: one spec each, which both builds the
caller's KEYS and ARGV and gives the script its local names for them.

A script's source (admit.lua) refers to its inputs only by those names; :meth:`Spec.source`
puts in front of it one ``local`` per name bound to its place in KEYS or ARGV (a table for
a name that stands for several), and :meth:`Spec.build` lays out the caller's values in the
same places, refusing a missing, unknown or wrongly sized one. tests/inference/
test_scripts.py fails when a script names an input its spec lacks, or reads KEYS or ARGV
by position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class Input:
    """One name of a script: ``count`` > 1 is a Lua table of that many (``values[i]``)."""

    name: str
    meaning: str
    count: int = 1


@dataclass(frozen=True)
class Spec:
    """A script file's KEYS and ARGV, each in order."""

    file: str
    keys: tuple[Input, ...]
    args: tuple[Input, ...]

    @cached_property
    def body(self) -> str:
        return (_HERE / self.file).read_text()

    @cached_property
    def source(self) -> str:
        """The script as Redis runs it: the names, then the file."""
        lines = [f"-- {self.file}'s inputs (inference/scripts.py)"]
        for table, inputs in (("KEYS", self.keys), ("ARGV", self.args)):
            at = 1
            for item in inputs:
                if item.count == 1:
                    lines.append(f"local {item.name} = {table}[{at}]")
                else:
                    values = ", ".join(f"{table}[{at + i}]" for i in range(item.count))
                    lines.append(f"local {item.name} = {{{values}}}")
                at += item.count
        return "\n".join(lines) + "\n" + self.body

    @cached_property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()

    def build(self, **values: Any) -> tuple[list[Any], list[Any]]:
        """KEYS and ARGV from one value per name (a sequence of ``count`` for a table);
        ValueError for a name missing, unknown or of the wrong size."""
        names = {item.name for item in (*self.keys, *self.args)}
        if unknown := set(values) - names:
            raise ValueError(f"{self.file} takes no {sorted(unknown)}")
        out: list[list[Any]] = [[], []]
        for side, inputs in enumerate((self.keys, self.args)):
            for item in inputs:
                if item.name not in values:
                    raise ValueError(f"{self.file} needs {item.name} ({item.meaning})")
                value = values[item.name]
                if item.count == 1:
                    out[side].append(value)
                    continue
                if not isinstance(value, Sequence) or isinstance(value, str) \
                        or len(value) != item.count:
                    raise ValueError(f"{self.file}'s {item.name} is {item.count} values")
                out[side].extend(value)
        return out[0], out[1]


LEVELS = 2  # the tenant's limits, then the key's
WINDOWS = 6  # budget windows: (tenant, key, end user) x (day, month); billing/budget_counters.py

# The inputs both scripts take, meaning the same in each.
TPM_KEYS = Input("tpm_keys", "each level's tokens/min bucket", LEVELS)
INFLIGHT_KEYS = Input("inflight_keys", "each level's in-flight requests (zset: id by lease "
                      "end)", LEVELS)
MONTH_KEYS = Input("month_keys", "each level's tokens this month", LEVELS)
BUDGET_DEFS_KEY = Input("budget_defs_key", "the tenant's budget definitions (hash)")
BUDGET_ALERTS_KEY = Input("budget_alerts_key", "the tenant's budget alerts to send (set)")
WINDOW_KEYS = Input("window_keys", "each budget window's spend and reservations (hash)",
                    WINDOWS)
REQUEST_ID = Input("request_id", "the request's id")
TPM_LIMITS = Input("tpm_limits", "each level's tokens/min (0: none)", LEVELS)
WINDOW_FIELDS = Input("window_fields", "each window's definition field ('': none)", WINDOWS)
END_USER_FIELDS = Input("end_user_fields", "the each-end-user definitions (day, month) for "
                        "the end user's windows, 5 and 6", 2)
END_USER = Input("end_user", "the request's end user ('': none; named in alerts)")

ADMIT = Spec(
    "admit.lua",
    keys=(
        Input("rpm_keys", "each level's requests/min bucket (GCRA: its TAT, unix ms)", LEVELS),
        TPM_KEYS, INFLIGHT_KEYS, MONTH_KEYS, BUDGET_DEFS_KEY, BUDGET_ALERTS_KEY, WINDOW_KEYS,
    ),
    args=(
        REQUEST_ID,
        Input("tokens", "tokens to reserve: prompt + max_tokens"),
        Input("lease_ms", "how long an in-flight slot lives if it is never released"),
        Input("month_reset_ms", "unix ms when the month resets"),
        Input("rpm_limits", "each level's requests/min (0: none)", LEVELS),
        TPM_LIMITS,
        Input("concurrency_limits", "each level's requests at once (0: none)", LEVELS),
        Input("month_caps", "each level's monthly tokens (0: none)", LEVELS),
        Input("probe", "1: only check (before tokenizing: refuse what no request could "
              "pass now, take nothing)"),
        Input("cost_micros", "the spend to reserve: the request's largest possible cost"),
        WINDOW_FIELDS, END_USER_FIELDS,
        Input("window_resets", "each window's end (unix ms)", WINDOWS),
        END_USER,
    ),
)

SETTLE = Spec(
    "settle.lua",
    keys=(TPM_KEYS, INFLIGHT_KEYS, MONTH_KEYS, BUDGET_DEFS_KEY, BUDGET_ALERTS_KEY,
          WINDOW_KEYS),
    args=(
        REQUEST_ID,
        Input("refund", "tokens to give back: reserved, not used"),
        TPM_LIMITS,
        Input("cost_micros", "what the request cost"),
        Input("used", "the tokens it used"),
        END_USER, WINDOW_FIELDS, END_USER_FIELDS,
    ),
)
