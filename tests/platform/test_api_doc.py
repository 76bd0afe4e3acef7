"""docs/api.md's request-body table says what params.py does with every field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from inference import params as p

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
REQUIRED = {"model", "prompt", "messages"}
BASE = {"completions": {"model": "m", "prompt": "hello"},
        "chat": {"model": "m", "messages": [{"role": "user", "content": "hello"}]}}
PARSE = {"completions": p.parse_completion, "chat": p.parse_chat}
FIELDS = {"completions": p.COMPLETION_FIELDS, "chat": p.CHAT_FIELDS}


def _rows() -> dict[str, tuple[list[str], str, str]]:
    """parameter → (endpoints, accepted, effect), from the table under "## Request body"."""
    section = DOC.read_text().split("## Request body", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        on = ["completions", "chat"] if cells[1] == "both" else [cells[1]]
        rows[cells[0].strip("`")] = (on, cells[2], cells[3])
    return rows


ROWS = _rows()


def _parsed(endpoint: str, extra: dict) -> object:
    return PARSE[endpoint]({**BASE[endpoint], **extra})


def test_the_table_names_every_field_on_the_endpoints_that_take_it():
    documented = {(name, endpoint) for name, (on, _, _) in ROWS.items() for endpoint in on}
    code = {(name, endpoint) for endpoint, fields in FIELDS.items() for name in fields}
    assert documented == code


IGNORED = [(name, endpoint, json.loads(value))
           for name, (on, accepted, effect) in ROWS.items() if effect.startswith("none")
           for endpoint in on for value in re.findall(r"`([^`]+)`", accepted)]


def test_every_field_documented_as_changing_nothing_lists_its_values():
    names = {name for name, _, _ in IGNORED}
    assert {"store", "metadata"} <= names


@pytest.mark.parametrize(("name", "endpoint", "value"), IGNORED)
def test_a_value_documented_as_changing_nothing_is_accepted_and_changes_nothing(
        name, endpoint, value):
    assert _parsed(endpoint, {name: value}) == _parsed(endpoint, {})


@pytest.mark.parametrize(("name", "endpoint"), [
    (name, endpoint) for name, (on, _, _) in ROWS.items() if name not in REQUIRED
    for endpoint in on])
def test_null_is_the_same_as_leaving_a_field_out(name, endpoint):
    assert _parsed(endpoint, {name: None}) == _parsed(endpoint, {})


def test_the_user_field_reaches_the_ledger_and_changes_nothing_else():
    with_user = _parsed("chat", {"user": "user-1234"})
    assert with_user.params.user == "user-1234"
    with_user.params.user = None
    assert with_user == _parsed("chat", {})
