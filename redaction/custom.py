r"""Patterns a tenant adds to redaction, in a regex dialect that cannot backtrack.

A tenant's pattern is parsed by Python's own regex parser, checked against the
rules below, and compiled again with every repetition possessive and every
alternation atomic. The matcher then never goes back into a construct it has
left, so at each start position it takes at most ``cost`` steps, a bound
computed here from the pattern and capped at MAX_COST; scanning n characters
costs at most about n × MAX_COST steps, whatever the text (docs/request-logs.md).

Allowed: literals and escapes, ``.``, classes (``[A-Z0-9_]``, ``\d \w \s`` and
their negations), repetition of one character or class (``\d{6}``, ``[A-Z]{2,8}``,
``x?``), repetition of a group of single characters (``(?:\d{3}-){2}``), groups,
alternation, ``\b \B ^ $ \A \Z``, and the flags i, m, s, x and a.

Refused, each with its reason: backreferences, lookarounds, conditionals,
repetition of a group that can vary in length, repetitions over MAX_REPEAT,
an unlimited repetition (``+``, ``*``) anywhere but at the very end, a repetition
whose characters could also start what follows it (``.*;``: write ``[^;]*;``),
patterns longer than MAX_PATTERN_CHARS, patterns that can match fewer than
MIN_WIDTH characters, and patterns that match something in a sample of ordinary
text (too broad).

NOTE: ``re._parser`` is CPython's internal parser; pyproject pins Python 3.11 and
tests/platform/test_custom_patterns.py checks the dialect end to end.
"""

from __future__ import annotations

import functools
import re
import re._constants as c
import re._parser as sre
from dataclasses import dataclass

MAX_PATTERN_CHARS = 256
MAX_REPEAT = 256  # the most characters one bounded repetition may take
MAX_COST = 1024  # steps at one start position, at most
MIN_WIDTH = 4  # the fewest characters a match may have

_ALLOWED_FLAGS = (re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE | re.ASCII
                  | re.UNICODE)
# Every ASCII character and a few others: enough to tell whether two classes overlap.
_UNIVERSE = [chr(i) for i in range(128)] + ["\u00a0", "é", "ß", "ж", "中", "😀"]
_AT = {c.AT_BEGINNING: "^", c.AT_BEGINNING_STRING: r"\A", c.AT_BOUNDARY: r"\b",
       c.AT_NON_BOUNDARY: r"\B", c.AT_END: "$", c.AT_END_STRING: r"\Z"}
_CATEGORY = {c.CATEGORY_DIGIT: r"\d", c.CATEGORY_NOT_DIGIT: r"\D", c.CATEGORY_SPACE: r"\s",
             c.CATEGORY_NOT_SPACE: r"\S", c.CATEGORY_WORD: r"\w", c.CATEGORY_NOT_WORD: r"\W"}
_SINGLE = {c.LITERAL, c.NOT_LITERAL, c.ANY, c.IN}
_REPEATS = {c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT}

# Ordinary text a tenant's pattern must leave alone: prose, code, JSON, log lines,
# dates, times, prices and small numbers. A pattern that matches here would redact
# what people write every day.
ORDINARY_TEXT = """\
Thanks for the quick reply! The meeting moved to Tuesday, March 5 2024 at 10:30 in
room 12B. Please bring the Q3 report (about 40 pages) and the budget of $1,250.00.
We shipped version 2.4.1 last week; v3 is planned for the summer. The API returns
JSON, and the HTTP status is 200 OK unless the request fails with 404 or 500.
Can you summarize this article in three bullet points? Translate "good morning"
into French and German. Write a haiku about autumn leaves and the color red.
def total(items: list[int]) -> int:
    return sum(x * 2 for x in items if x > 0)  # skip negatives
for (let i = 0; i < 10; i++) { console.log(`step ${i}`); }
SELECT name, count(*) FROM orders WHERE created_at > '2024-01-01' GROUP BY name;
{"model": "atrium-demo", "temperature": 0.7, "max_tokens": 256, "stream": true}
2024-05-01T12:00:00Z INFO worker started with 8 threads in 1.5 s (pid 4242)
The quick brown fox jumps over the lazy dog. Pack my box with five dozen jugs.
See https://example.com/docs/getting-started#install for the install guide.
Chapter 7, page 132: "It was the best of times, it was the worst of times."
Order #58213 ships in 3-5 business days; call us Monday to Friday, 9am to 5pm.
"""


class PatternRejected(ValueError):
    """A tenant's pattern is not accepted; the message says why, for the person who wrote it."""


@dataclass(frozen=True, slots=True)
class _Item:
    """What the checker knows of one parsed element."""

    text: str  # the element, re-emitted: possessive repetitions, atomic alternations
    first: frozenset[str]  # the characters a match of it can start with
    nullable: bool  # whether it can match the empty string
    cost: int  # the most steps the matcher spends in it at one start position


def _code(ch: int) -> str:
    char = chr(ch)
    if char.isalnum() and char.isascii():
        return char
    return f"\\x{ch:02x}" if ch < 0x100 else (f"\\u{ch:04x}" if ch < 0x10000
                                              else f"\\U{ch:08x}")


def _class(items: list) -> str:
    parts = []
    for op, av in items:
        if op is c.NEGATE:
            parts.insert(0, "^")
        elif op is c.LITERAL:
            parts.append(_code(av))
        elif op is c.RANGE:
            parts.append(f"{_code(av[0])}-{_code(av[1])}")
        elif op is c.CATEGORY and av in _CATEGORY:
            parts.append(_CATEGORY[av])
        else:
            raise PatternRejected(f"this kind of character class is not supported ({op})")
    return "[" + "".join(parts) + "]"


class _Checker:
    def __init__(self, flags: int) -> None:
        self.flags = flags & ~re.VERBOSE
        self._chars: dict[str, frozenset[str]] = {}

    def chars(self, single: str) -> frozenset[str]:
        """The characters (of _UNIVERSE) one single-character element matches."""
        if single not in self._chars:
            matcher = re.compile(single, self.flags)
            self._chars[single] = frozenset(ch for ch in _UNIVERSE if matcher.fullmatch(ch))
        return self._chars[single]

    def single(self, op, av) -> str:
        if op is c.LITERAL:
            return _code(av)
        if op is c.NOT_LITERAL:
            return f"[^{_code(av)}]"
        if op is c.ANY:
            return "."
        return _class(av)

    def sequence(self, items: list, follow: frozenset[str], tail: bool) -> _Item:
        """A sequence; ``follow``: what may come right after it; ``tail``: nothing comes."""
        parsed: list[_Item | None] = [None] * len(items)
        after, after_nullable = frozenset(), True
        # Right to left, so each element knows what can follow it.
        for i in range(len(items) - 1, -1, -1):
            op, av = items[i]
            here_follow = after | follow if after_nullable else after
            item = self.element(op, av, here_follow, tail and i == len(items) - 1)
            parsed[i] = item
            after = item.first | after if item.nullable else item.first
            after_nullable = after_nullable and item.nullable
        done = [p for p in parsed if p is not None]
        return _Item("".join(p.text for p in done), after, after_nullable,
                     sum(p.cost for p in done))

    def element(self, op, av, follow: frozenset[str], tail: bool) -> _Item:
        if op in _SINGLE:
            text = self.single(op, av)
            return _Item(text, self.chars(text), False, 1)
        if op is c.AT:
            if av not in _AT:
                raise PatternRejected("this anchor is not supported")
            return _Item(_AT[av], frozenset(), True, 1)
        if op is c.SUBPATTERN:
            _, add, remove, inner = av
            if (add | remove) & ~(re.IGNORECASE | re.MULTILINE | re.DOTALL):
                raise PatternRejected("only the flags i, m and s may be set on a group")
            body = self.sequence(list(inner), follow, tail)
            return _Item(f"(?{_flags(add)}{'-' + _flags(remove) if remove else ''}:"
                         f"{body.text})", body.first, body.nullable, body.cost)
        if op is c.ATOMIC_GROUP:
            body = self.sequence(list(av), follow, tail)
            return _Item(f"(?>{body.text})", body.first, body.nullable, body.cost)
        if op is c.BRANCH:
            return self.branch(av[1], follow, tail)
        if op in _REPEATS:
            return self.repeat(*av, follow=follow, tail=tail)
        if op is c.GROUPREF or op is c.GROUPREF_EXISTS:
            raise PatternRejected("backreferences and conditionals are not allowed")
        if op is c.ASSERT or op is c.ASSERT_NOT:
            raise PatternRejected(r"lookahead and lookbehind are not allowed; use \b for a "
                                  "word boundary")
        raise PatternRejected(f"this construct is not allowed ({op})")

    def branch(self, branches: list, follow: frozenset[str], tail: bool) -> _Item:
        alternatives = [list(b) for b in branches]
        if all(all(op is c.LITERAL for op, _ in alt) for alt in alternatives):
            # Plain words: the longest first, so "sk_live" is tried before "sk".
            alternatives.sort(key=len, reverse=True)
        parts = [self.sequence(alt, follow, tail) for alt in alternatives]
        if any(p.nullable for p in parts[:-1]):
            raise PatternRejected("only the last alternative may match nothing")
        first = frozenset().union(*(p.first for p in parts))
        return _Item("(?>" + "|".join(p.text for p in parts) + ")", first,
                     any(p.nullable for p in parts), sum(p.cost for p in parts))

    def repeat(self, low: int, high: int, body: list, *, follow: frozenset[str],
               tail: bool) -> _Item:
        body = _unwrap(list(body))
        unlimited = high is c.MAXREPEAT
        if unlimited and not tail:
            raise PatternRejected(f"an unlimited repetition (+, *, {{n,}}) may only end the "
                                  f"pattern; elsewhere give it a bound, at most {MAX_REPEAT}")
        if len(body) == 1 and body[0][0] in _SINGLE:
            inner = self.element(*body[0], frozenset(), False)
        elif all(op in _SINGLE or (op in _REPEATS and av[0] == av[1] and len(av[2]) == 1
                                   and av[2][0][0] in _SINGLE) for op, av in body):
            inner = self.sequence(body, frozenset(), False)
            inner = _Item(f"(?:{inner.text})", inner.first, inner.nullable, inner.cost)
        else:
            raise PatternRejected("only single characters, classes and groups of a fixed "
                                  "length may be repeated")
        width = inner.cost
        if not unlimited and high * width > MAX_REPEAT:
            raise PatternRejected(f"a repetition may take at most {MAX_REPEAT} characters")
        if low != high and inner.first & follow:
            shown = "".join(sorted(ch for ch in inner.first & follow if ch.isprintable())[:5])
            raise PatternRejected(
                f"a repetition here can also match what follows it ({shown!r}), and "
                f"repetitions never give characters back; exclude those characters from it, "
                f"e.g. [^;]*; instead of .*;")
        if unlimited:
            quant = "+" if low == 1 else ("*" if low == 0 else f"{{{low},}}")
            cost = low * width + 1  # the rest is paid by the characters the match consumes
        else:
            quant = f"{{{low}}}" if low == high else f"{{{low},{high}}}"
            cost = high * width
        possessive = "" if low == high else "+"
        return _Item(inner.text + quant + possessive, inner.first, low == 0, cost)


def _unwrap(body: list) -> list:
    """A repeated group without flags of its own is its content: (a|b){2} is [ab]{2}."""
    while len(body) == 1 and body[0][0] is c.SUBPATTERN and not (body[0][1][1] | body[0][1][2]):
        body = list(body[0][1][3])
    return body


def _flags(value: int) -> str:
    return "".join(ch for flag, ch in ((re.IGNORECASE, "i"), (re.MULTILINE, "m"),
                                       (re.DOTALL, "s")) if value & flag)


@functools.lru_cache(maxsize=2048)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """The pattern in the safe dialect, compiled; raises PatternRejected with the reason."""
    if not isinstance(pattern, str) or not pattern:
        raise PatternRejected("the pattern is empty")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternRejected(f"the pattern is longer than {MAX_PATTERN_CHARS} characters")
    try:
        parsed = sre.parse(pattern)
    except re.error as exc:
        raise PatternRejected(f"the pattern does not compile: {exc}") from None
    flags = parsed.state.flags
    if flags & ~_ALLOWED_FLAGS:
        raise PatternRejected("only the flags i, m, s, x and a are allowed")
    checker = _Checker(flags)
    item = checker.sequence(list(parsed), frozenset(), True)
    if item.cost > MAX_COST:
        raise PatternRejected(f"the pattern is too complex: up to {item.cost} steps at each "
                              f"position, more than {MAX_COST}")
    compiled = re.compile(item.text, checker.flags)
    low, _ = sre.parse(item.text, checker.flags).getwidth()
    if low < MIN_WIDTH:
        raise PatternRejected(f"the pattern can match fewer than {MIN_WIDTH} characters")
    hit = compiled.search(ORDINARY_TEXT)
    if hit is not None:
        raise PatternRejected(f"the pattern is too broad: it matches ordinary text "
                              f"({hit.group()[:40]!r})")
    return compiled

