"""docs/tenancy.md's role × action matrix is the one tenants/access.py enforces."""

from __future__ import annotations

from pathlib import Path

from tenants.access import RULES
from tenants.models import Role

DOC = Path(__file__).resolve().parents[2] / "docs" / "tenancy.md"


def test_the_documented_matrix_is_the_enforced_one():
    text = DOC.read_text()
    table = text[text.index("<!-- matrix:start -->"):text.index("<!-- matrix:end -->")]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    documented = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        roles = frozenset(r for r, cell in zip(Role.values, cells[1:6], strict=True) if cell)
        documented[cells[0].strip("`")] = (roles, None if cells[6] == "—" else cells[6],
                                           cells[7] == "✓")
    enforced = {action: (rule.roles, rule.key_scope, rule.staff) for action, rule in
                RULES.items()}
    assert documented == enforced
