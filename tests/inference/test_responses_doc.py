"""docs/api.md's Responses API table names every field the Responses body takes, and only
those."""

from __future__ import annotations

import re
from pathlib import Path

from inference.protocols.responses_request import ResponseBody

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _documented() -> set[str]:
    section = DOC.read_text().split("## OpenAI Responses", 1)[1].split("\n## ", 1)[0]
    table = section.split("### Request body", 1)[1].split("\n### ", 1)[0]
    names: set[str] = set()
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            names |= set(re.findall(r"`([a-z_]+)`", cells[0]))
    return names


def test_the_responses_table_names_every_field_and_no_other():
    fields = {field.alias or name for name, field in ResponseBody.model_fields.items()}
    assert _documented() == fields
