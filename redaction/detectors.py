"""What counts as a secret or personal datum, and how to find it in linear time.

Every pattern is written so the regex engine cannot backtrack badly: bounded
repetition, character classes that cannot overlap at a boundary, and atomic
groups / possessive quantifiers where a run could be split several ways. Some
detectors also validate the match (Luhn for cards, mod-97 for IBANs, the
`ipaddress` module for IPs), which is what keeps precision high.

Pure Python and the standard library only: the engine imports this too.
"""

from __future__ import annotations

import ipaddress
import re
import string
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Detector:
    kind: str  # the placeholder's name: [EMAIL], [CARD], ...
    pattern: re.Pattern[str]
    validate: Callable[[str], bool] | None = None
    # The part of the match to replace: a group, or the first of several groups that took
    # part in the match (e.g. the value after "password=", quoted or not).
    group: int | tuple[int, ...] = 0
    # Cuts a match into the spans to replace (offsets within the match); used where one
    # match may hold several data, e.g. card numbers written one after another.
    split: Callable[[str], list[tuple[int, int]]] | None = None
    # Lower-case strings one of which every match contains (in the lower-cased text): a
    # text with none of them is skipped without running the pattern. Speed only.
    triggers: tuple[str, ...] = ()
    # The pattern ignores case (re.IGNORECASE) and means the same on lower-cased text;
    # it then runs case-sensitively on text.lower(), which is several times faster.
    fold: bool = False
    # Moves a match's start to the left (or refuses it: None), for patterns that start
    # at a rare character inside the datum ("@" of an email) and so are found fast.
    widen: Callable[[str, int], int | None] | None = None


def luhn_ok(digits: str) -> bool:
    total, parity = 0, len(digits) % 2
    for i, ch in enumerate(digits):
        d = ord(ch) - 48
        if i % 2 == parity:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


_DIGIT_GROUP = re.compile(r"\d+")


def _card_windows(sizes: list[int], i: int) -> list[int]:
    """How many groups from ``i`` on could form one card as people write them, longest first.

    One run of 13-19 digits; groups of four with a shorter last group (4-4-4-4,
    4-4-4-4-3, 4-4-4-1); American Express 4-6-5 and Diners 4-6-4.
    """
    first = sizes[i]
    if 13 <= first <= 19:
        return [1]
    if first != 4:
        return []
    windows = []
    rest = sizes[i + 1:i + 5]
    if len(rest) >= 4 and rest[:3] == [4, 4, 4] and 1 <= rest[3] <= 3:
        windows.append(5)
    if len(rest) >= 3 and rest[:2] == [4, 4] and 1 <= rest[2] <= 4:
        windows.append(4)
    if len(rest) >= 2 and rest[0] == 6 and rest[1] in (4, 5):
        windows.append(3)
    return windows


def card_spans(run: str) -> list[tuple[int, int]]:
    """The card numbers in a run of digit groups: several cards written one after another
    (``4111 1111 1111 1111 5500 0000 0000 0004``) are found one by one."""
    groups = [(m.start(), m.end()) for m in _DIGIT_GROUP.finditer(run)]
    sizes = [end - start for start, end in groups]
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(groups):
        taken = 0
        for count in _card_windows(sizes, i):
            digits = "".join(run[s:e] for s, e in groups[i:i + count])
            if digits[0] in "23456" and luhn_ok(digits):
                taken = count
                break
        if taken:
            spans.append((groups[i][0], groups[i + taken - 1][1]))
            i += taken
        else:
            i += 1
    return spans


def _iban(match: str) -> bool:
    compact = match.replace(" ", "").upper()
    if not 15 <= len(compact) <= 34:
        return False
    rearranged = compact[4:] + compact[:4]
    number = "".join(str(int(c, 36)) for c in rearranged)
    return int(number) % 97 == 1


def _personal(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Loopback and "any" addresses name no one: they are a server's own configuration
    (``Uvicorn running on http://127.0.0.1:8000``), so they stay readable."""
    return not (address.is_loopback or address.is_unspecified)


def _ipv4(match: str) -> bool:
    try:
        return _personal(ipaddress.IPv4Address(match))
    except ValueError:
        return False


def _ipv6(match: str) -> bool:
    # NOTE: a digit is required: "a::b" and "dead::beef" are code far more often.
    if match.count(":") < 2 or not any(c.isdigit() for c in match):
        return False
    try:
        return _personal(ipaddress.IPv6Address(match))
    except ValueError:
        return False


def _ssn(match: str) -> bool:
    area, group, serial = match.split("-")
    return area not in ("000", "666") and area[0] != "9" and group != "00" and serial != "0000"


def _phone(match: str) -> bool:
    digits = sum(c.isdigit() for c in match)
    return 10 <= digits <= 15


# Boundaries. NOTE: a pattern that starts with a lookbehind gets no fast scan from the
# regex engine (it tries every position), so patterns start with their first character
# or literal and look behind it: atr_(?<!\watr_) rather than (?<!\w)atr_.
_LOCAL = frozenset(string.ascii_letters + string.digits + "!#$%&'*+/=?^_`{|}~.-")
_HEX = frozenset(string.hexdigits)
_NOT_BEFORE_IPV6 = frozenset(string.ascii_letters + string.digits + "_:")


def _email_start(text: str, at: int) -> int | None:
    """The start of the local part before the "@" at ``at``: 1 to 64 characters.

    NOTE: a longer run (a URL's path and query before ``victim@example.org``) is cut to its
    last 64 characters rather than skipped: the address in it is still one.
    """
    start = at
    while start > 0 and text[start - 1] in _LOCAL and at - start < 64:
        start -= 1
    return start if start < at else None


def _ipv6_start(text: str, colon: int) -> int | None:
    """The start of the group (0 to 4 hex digits) before an address's first colon."""
    start = colon
    while start > 0 and text[start - 1] in _HEX and colon - start <= 4:
        start -= 1
    if colon - start > 4 or (start > 0 and text[start - 1] in _NOT_BEFORE_IPV6):
        return None
    return start


def _first(letter: str) -> str:
    """A name's first letter, not preceded by a letter or digit (see _NAME_START)."""
    return f"{letter}(?<![a-z0-9]{letter})"


_W = "A-Za-z0-9_"
_E = r"(?![A-Za-z0-9_])"
# Where a setting's name may start: also right after "_" or "-", so MY_API_KEY and
# aws_secret_access_key are names too.
_NAME_START = r"(?<![a-z0-9])"  # folded patterns run on lower-cased text
# Setting names that hold secrets, grouped by first letter so the pattern starts with a
# character class the regex engine scans for quickly.
_SECRET_NAMES = "|".join(_first(letter) + rest for letter, rest in (
    ("p", r"(?:assw(?:or)?d|assphrase|wd|ass|rivate[_-]?key)"),
    ("s", r"(?:ecret(?:[_-]?(?:access[_-]?)?key)?|igning[_-]?key|ession[_-]?token)"),
    ("c", r"(?:lient[_-]?secret(?:[_-]?(?:access[_-]?)?key)?|redentials?"
          r"|onnection[_-]?string)"),
    ("a", r"(?:pi[_-]?key|pikey|ccess[_-]?key|uth[_-]?token|ccess[_-]?token)"),
    ("r", r"efresh[_-]?token"),
    ("i", r"d[_-]?token"),
    ("t", r"oken"),
))
_NAME_TRIGGERS = ("pass", "pwd", "secret", "key", "token", "credential", "connection")
# After the name: a closing quote (JSON, dicts, escaped JSON), then = : => := or ==.
_ASSIGN = r"(?:\\?[\"'])?+\]?+[ \t]{0,8}+(?:=>|:=|==|[:=])[ \t]{0,8}+"
# The value: quoted (any characters up to the quote) or bare (up to a space or delimiter).
_VALUE = (r"(?:\\?\"([^\"\\\r\n]{1,256}+)|\\?'([^'\\\r\n]{1,256}+)"
          r"|([^\s\"'`,;&|<>(){}\[\]\\=][^\s\"'`,;&|<>(){}\[\]\\]{0,255}+))")
_SCHEMES = r"(?:bearer|basic|digest|token|negotiate|ntlm|apikey|aws4-hmac-sha256)"
_TOKEN68 = r"a-z0-9._~+/=-"


def _folded(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


# Order matters: earlier detectors win overlaps. Secrets first (a JWT or key may contain
# things that look like other data), then structured numbers, then addresses.
DETECTORS: tuple[Detector, ...] = (
    Detector("PRIVATE_KEY", re.compile(
        r"-----BEGIN (?:[A-Z0-9]{1,20} ){0,3}PRIVATE KEY(?: BLOCK)?-----"
        r"(?:[A-Za-z0-9+/=\s:,]|-(?!-)){0,16384}+"  # base64 and Proc-Type/DEK-Info lines
        r"(?:-----END (?:[A-Z0-9]{1,20} ){0,3}PRIVATE KEY(?: BLOCK)?-----)?"),
        triggers=("-----begin",)),
    # Atrium keys are atr_ + 36 characters; a longer or mangled one is still a key, while
    # the 12-character prefix shown in lists and logs is not matched.
    Detector("API_KEY", re.compile(rf"atr_(?<![{_W}]atr_)[A-Za-z0-9]{{30,64}}+{_E}"),
             triggers=("atr_",)),
    Detector("API_KEY", re.compile(rf"atrinv_(?<![{_W}]atrinv_)[A-Za-z0-9_-]{{20,64}}+"),
             triggers=("atrinv_",)),
    Detector("AWS_KEY", re.compile(
        rf"(?:AKIA|ASIA|ABIA|ACCA)(?<![{_W}][A-Z]{{4}})[A-Z0-9]{{16}}{_E}"),
        triggers=("akia", "asia", "abia", "acca")),
    Detector("GITHUB_TOKEN", re.compile(
        rf"(?:gh[pousr]_(?<![{_W}]gh[pousr]_)[A-Za-z0-9]{{36,251}}+"
        rf"|github_pat_(?<![{_W}]github_pat_)[A-Za-z0-9_]{{22,247}}+){_E}"),
        triggers=("gh", "github_pat_")),
    Detector("JWT", re.compile(
        rf"eyJ(?<![{_W}]eyJ)[A-Za-z0-9_-]{{8,}}+\.eyJ[A-Za-z0-9_-]{{8,}}+\.[A-Za-z0-9_-]*+"),
        triggers=("eyj",)),
    # Well-known key formats: OpenAI-style sk-..., Stripe, Slack, Google API keys.
    Detector("SECRET", re.compile(
        rf"(?<![{_W}])(?:sk-(?:proj-)?[A-Za-z0-9_-]{{20,200}}+"
        rf"|(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{{10,200}}+"
        rf"|xox[abposr]-[A-Za-z0-9-]{{10,200}}+|AIza[A-Za-z0-9_-]{{35}}){_E}"),
        triggers=("sk-", "sk_", "rk_", "xox", "aiza")),
    # The Authorization header: everything after the scheme, to the end of the value.
    Detector("SECRET", _folded(
        _NAME_START + r"(?:proxy-)?authorization" + _ASSIGN
        + r"(?:\\?\"(?:" + _SCHEMES + r"[ \t]++)?+([^\"\\\r\n]{1,4096}+)"
        r"|\\?'(?:" + _SCHEMES + r"[ \t]++)?+([^'\\\r\n]{1,4096}+)"
        r"|(?:" + _SCHEMES + r"[ \t]++)?+([^\s\"'][^\r\n]{0,4095}+))"), group=(1, 2, 3),
        triggers=("authorization",), fold=True),
    # "Bearer <token>" anywhere: a token with a digit or a symbol, or a long run of letters
    # (so "bearer bonds" stays prose).
    Detector("SECRET", _folded(
        _NAME_START + r"bearer[ \t]++((?=[a-z]{0,4096}+[0-9._~+/=-])[" + _TOKEN68
        + r"]{1,4096}+|[a-z]{12,4096}+(?![" + _TOKEN68 + r"]))"), group=1,
        triggers=("bearer",), fold=True),
    Detector("SECRET", _folded(r"(?:" + _SECRET_NAMES + r")" + _ASSIGN + _VALUE),
             group=(1, 2, 3), triggers=_NAME_TRIGGERS, fold=True),
    # A password in a URL: scheme://user:password@host.
    Detector("SECRET", re.compile(r"(?<=://)[^\s/:@]{0,128}+:([^\s/@]{1,256}+)@"), group=1,
             triggers=("://",)),
    Detector("IBAN", re.compile(
        rf"[A-Z](?<![{_W}][A-Z])[A-Z]\d{{2}}(?: ?+[A-Z0-9]{{4}}){{2,7}}+(?: ?+[A-Z0-9]{{1,4}})?+"
        + _E), _iban),
    # Runs of digit groups; card_spans picks the Luhn-valid card numbers out of a run.
    Detector("CARD", re.compile(rf"\d(?<![{_W}]\d)(?:[ -]?+\d){{12,}}+{_E}"), split=card_spans),
    # Found from the first "-": three digits behind it, not inside a longer token.
    Detector("SSN", re.compile(rf"-(?<=(?<![{_W}])\d{{3}}-)\d{{2}}-\d{{4}}{_E}"), _ssn,
             widen=lambda text, start: start - 3),
    # Found from the "@" (or "%40", "%2540": URL-encoded once or twice, as in a query
    # string), then widened over the local part (1 to 64 characters).
    Detector("EMAIL", re.compile(r"(?:@|%(?:25)?+40)[A-Za-z0-9-]{1,63}+"
                                 r"(?:\.[A-Za-z0-9-]{1,63}+){1,32}+"),
             widen=_email_start),
    Detector("IP", re.compile(r"\d(?<![\d.vV]\d)\d{0,2}\.\d{1,3}\.\d{1,3}\.\d{1,3}(?![\d.])"),
             _ipv4, triggers=(".",)),
    # Found from the first ":", then widened over the hex digits of the first group.
    Detector("IP", re.compile(
        r":(?<!::)(?:[0-9A-Fa-f]{0,4}:){1,6}+[0-9A-Fa-f]{0,4}(?![0-9A-Za-z_:])"),
        _ipv6, widen=_ipv6_start),
    Detector("PHONE", re.compile(
        r"(?:\+(?<![\w+./-]\+)\d{1,3}[ .-]?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])"
        r"|\((?<![\w+./-]\()\d{2,4}\)[ .-]?|\d(?<![\w+./-]\d)\d{1,3}[ .-])"
        r"\d{3,4}[ .-]?\d{3,4}(?!\w)"), _phone),
    # International numbers written in pairs or small groups: +33 1 23 45 67 89.
    Detector("PHONE", re.compile(r"\+(?<![\w+]\+)\d{1,3}(?:[ .-]?+\d{1,4}+){2,7}+(?![\w])"),
             _phone, triggers=("+",)),
)
