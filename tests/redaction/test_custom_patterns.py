"""Tenants' own patterns: what the dialect accepts means what Python's re means, and no
accepted pattern can be made to take more than linear time."""

from __future__ import annotations

import re
import re._constants as c
import re._parser as sre

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redaction import redact, tenant_detector
from redaction.custom import MAX_COST, PatternRejected, compile_pattern
from tests.redaction.test_redaction import TIME_BOUND_S, run_bounded

ACCEPTED = [
    r"ACME-\d{6}",
    r"(?i)\bemp-[a-z0-9]{8}\b",
    r"(?:\d{3}-){2}\d{4}X",
    r"PROJ-[0-9]{4}(?:-[A-Z]{2})?",
    r"colou?r-\d{5}",
    r"(?:sk|sk_live)_[a-z]{6}",
    r"TKT[:#]\s{0,3}[0-9a-f]{6,12}\b",
    r"[A-Z]{3}-[^\s;]{4,40};",
    r"ticket/[0-9]+",
    r"(?:AB|CD|EF)\d{4}[A-Z]",
]


def _backtrack_points(items, in_atomic: bool = False) -> list[str]:
    """Constructs in a parsed pattern the matcher could come back into after leaving."""
    found = []
    for op, av in items:
        if op is c.MAX_REPEAT or op is c.MIN_REPEAT:
            if av[0] != av[1]:
                found.append(f"{op} {av[:2]}")
            found += _backtrack_points(av[2], in_atomic)
        elif op is c.POSSESSIVE_REPEAT:
            found += _backtrack_points(av[2], True)
        elif op is c.BRANCH:
            if not in_atomic:
                found.append("alternation outside an atomic group")
            for branch in av[1]:
                found += _backtrack_points(branch, in_atomic)
        elif op is c.ATOMIC_GROUP:
            found += _backtrack_points(av, True)
        elif op is c.SUBPATTERN:
            found += _backtrack_points(av[3], in_atomic)
    return found


@pytest.mark.parametrize("pattern", ACCEPTED)
def test_accepted_patterns_compile_to_ones_that_never_backtrack(pattern):
    compiled = compile_pattern(pattern)
    assert _backtrack_points(sre.parse(compiled.pattern, compiled.flags)) == []


def _agrees(pattern: str, text: str) -> None:
    ours = [m.span() for m in compile_pattern(pattern).finditer(text)]
    theirs = [m.span() for m in re.compile(pattern).finditer(text)]
    assert ours == theirs, (pattern, text)


# Text made of the characters the patterns care about, so matches are frequent.
texts = st.text(st.sampled_from(list("ACMEPROJTKSkl_sbcdefx0123456789-:#;/ \nXY")),
                max_size=80)


@pytest.mark.parametrize("pattern", [p for p in ACCEPTED if "sk_live" not in p])
def test_accepted_patterns_mean_what_python_re_means(pattern):
    @settings(max_examples=150)
    @given(texts)
    def check(text):
        _agrees(pattern, text)

    check()


def test_alternatives_of_plain_words_are_tried_longest_first():
    assert compile_pattern(r"(?:sk|sk_live)_[a-z]{6}").search("key sk_live_abcdef!").group() \
        == "sk_live_abcdef"


@pytest.mark.parametrize("pattern, reason", [
    (r"(?:a{1,3}){1,3}Z{4}", "only single characters"),
    (r"(?:a|ab){2,4}ZZZZ", "only single characters"),
    (r"(\w{1,9})\1ZZZZ", "backreferences"),
    (r"(?=secret)\w{4,8}", "lookahead"),
    (r"(?<!x)ABCD", "lookahead"),
    (r"(a)?(?(1)b|c)ZZZZ", "conditionals"),
    (r"ZZ[unclosed", "does not compile"),
    (r"x.*yZZZ", "unlimited repetition"),
    (r"[A-Z]+\bXYZ", "unlimited repetition"),
    (r"ID-\d{1,10}\d", "can also match what follows"),
    (r"ID-.{1,20};", "can also match what follows"),
    (r"ID-\w{0,250}-\w{0,250}-\w{0,250}-\w{0,250}-\w{0,250}", "too complex"),
    (r"ID\d{1,300}", "at most 256"),
    (r"(?:[a-z]{0,3}|ab)ZZZZ", "only the last alternative"),
    (r"\w{4,}", "too broad"),
    (r"(?i)[a-z]{5,9}", "too broad"),
    (r"\d{2}:\d{2}", "too broad"),
    (r"ab?", "fewer than 4"),
    ("A" * 300, "longer than"),
    ("", "empty"),
])
def test_unsafe_patterns_are_refused_with_a_reason(pattern, reason):
    with pytest.raises(PatternRejected, match=re.escape(reason)):
        compile_pattern(pattern)


def test_a_tenant_pattern_redacts_after_the_built_in_detectors():
    emp = tenant_detector("employee_id", r"EMP-\d{6}")
    text = "EMP-123456 paid with 4111 1111 1111 1111"
    assert redact(text, [emp]) == "[EMPLOYEE_ID] paid with [CARD]"


# The worst the dialect admits: long bounded runs after a literal that the text repeats,
# so every position starts a match attempt that fails late; a tail run over the whole text.
HOSTILE = [
    (r"Q[A-Za-z]{3,250}#", "'Q' * 200_000"),
    (r"(?i)q[a-z]{3,250}#", "'q' * 200_000"),
    (r"Q[a-z]{0,250}[0-9]{3,250}#", "'Qa1' * 70_000"),
    (r"(?:Q[a-z]{2,100}|R[a-z]{2,100}|S[a-z]{2,100})#", "'QRS' * 70_000"),
    (r"XY[^#]{2,250}#", "'XY' * 100_000"),
    (r"(?:\d{3}-){2}\d{4}#", "'123-' * 50_000"),
    (r"TAIL-[a-z]+", "'TAIL-' + 'a' * 200_000"),
    (r"TAIL-[a-z]+", "'TAIL-a' * 40_000"),
]


@pytest.mark.parametrize("pattern, expression", HOSTILE, ids=lambda v: str(v)[:20])
def test_hostile_inputs_finish_quickly_under_accepted_patterns(pattern, expression):
    compile_pattern(pattern)  # accepted: the bound below is what acceptance promises
    code = ("import time\nfrom redaction import redact, tenant_detector\n"
            f"det = tenant_detector('T', {pattern!r})\ntext = {expression}\n"
            "t = time.perf_counter()\nredact(text, [det])\nprint(time.perf_counter() - t)\n")
    assert run_bounded(code, TIME_BOUND_S) < TIME_BOUND_S


def test_the_cost_bound_is_what_the_checker_enforces():
    # Just under the bound passes, just over fails: the check is the number, not a guess.
    compile_pattern("ID-" + r"\d{1,250}-" * 3 + r"Z{1,250}#")
    with pytest.raises(PatternRejected, match="too complex"):
        compile_pattern("ID-" + r"\d{1,250}-" * 4 + r"Z{1,250}#")
    assert MAX_COST == 1024
