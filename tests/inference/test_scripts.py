"""The admission script and its caller agree on its inputs by name (inference/scripts.py)."""

from __future__ import annotations

import re

import pytest

from inference.scripts import ADMIT, SETTLE, Input, Spec

SPECS = [ADMIT, SETTLE]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.file)
def test_a_script_reads_its_inputs_by_name_only_and_uses_each(spec: Spec):
    body = re.sub(r"--[^\n]*", "", spec.body)  # comments may say anything
    assert not re.search(r"\b(KEYS|ARGV)\s*\[", body), "read by position"
    for item in (*spec.keys, *spec.args):
        assert re.search(rf"\b{item.name}\b", body), f"{item.name} is never used"
        assert not re.search(rf"\blocal\s+{item.name}\b", body), f"{item.name} redefined"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.file)
def test_every_name_the_script_reads_is_in_its_spec(spec: Spec):
    """A name the body reads that neither it nor Lua defines would be nil at run time."""
    body = re.sub(r"--[^\n]*|'[^']*'|\"[^\"]*\"", "", spec.body)
    defined = {item.name for item in (*spec.keys, *spec.args)}
    defined |= set(re.findall(r"\blocal\s+(?:function\s+)?([A-Za-z_]\w*)", body))
    defined |= {n.strip() for group in re.findall(r"\blocal\s+([\w\s,]+?)\s*=", body)
                for n in group.split(",")}
    defined |= {n.strip() for group in re.findall(r"\bfor\s+([\w\s,]+?)\s*(?:=|\bin\b)", body)
                for n in group.split(",")}
    defined |= {n.strip() for group in re.findall(r"\bfunction\s*\w*\s*\(([^)]*)\)", body)
                for n in group.split(",") if n.strip()}
    lua = {"redis", "tonumber", "tostring", "math", "string", "table", "ipairs", "pairs",
           "type", "nil", "true", "false", "and", "or", "not", "if", "then", "else",
           "elseif", "end", "for", "in", "do", "while", "return", "local", "function",
           "break", "repeat", "until", "unpack", "cjson"}
    read = set(re.findall(r"(?<![.:\w])([A-Za-z_]\w*)\b(?!\s*=[^=])", body))
    assert read - defined - lua == set()


def test_build_lays_out_each_name_in_its_place_and_refuses_what_does_not_fit():
    spec = Spec("admit.lua", keys=(Input("a", "one"), Input("bs", "two", 2)),
                args=(Input("x", "one"),))
    assert spec.build(a="k1", bs=["k2", "k3"], x=7) == (["k1", "k2", "k3"], [7])
    assert "local bs = {KEYS[2], KEYS[3]}" in spec.source
    assert "local x = ARGV[1]" in spec.source
    with pytest.raises(ValueError, match="needs x"):
        spec.build(a="k1", bs=["k2", "k3"])
    with pytest.raises(ValueError, match="takes no"):
        spec.build(a="k1", bs=["k2", "k3"], x=7, y=8)
    with pytest.raises(ValueError, match="2 values"):
        spec.build(a="k1", bs=["k2"], x=7)
