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


def _ipv4(match: str) -> bool:
    try:
        ipaddress.IPv4Address(match)
    except ValueError:
        return False
    return True


def _ipv6(match: str) -> bool:
    # NOTE: a digit is required: "a::b" and "dead::beef" are code far more often.
    if match.count(":") < 2 or not any(c.isdigit() for c in match):
        return False
    try:
        ipaddress.IPv6Address(match)
    except ValueError:
        return False
    return True


def _phone(match: str) -> bool:
    digits = sum(c.isdigit() for c in match)
    return 10 <= digits <= 15


_B = r"(?<![A-Za-z0-9_])"  # a start boundary that never backtracks
_E = r"(?![A-Za-z0-9_])"
# Where a setting's name may start: also right after "_" or "-", so MY_API_KEY and
# aws_secret_access_key are names too.
_NAME_START = r"(?<![A-Za-z0-9])"
_SECRET_NAMES = (
    r"passw(?:or)?d|passphrase|pwd|pass|"
    r"(?:client[_-]?)?secret(?:[_-]?(?:access[_-]?)?key)?|"
    r"api[_-]?key|apikey|access[_-]?key|private[_-]?key|signing[_-]?key|"
    r"(?:auth|access|refresh|session|id)[_-]?token|token|"
    r"credentials?|connection[_-]?string"
)
# After the name: a closing quote (JSON, dicts, escaped JSON), then = : => := or ==.
_ASSIGN = r"(?:\\?[\"'])?+\]?+[ \t]{0,8}+(?:=>|:=|==|[:=])[ \t]{0,8}+"
# The value: quoted (any characters up to the quote) or bare (up to a space or delimiter).
_VALUE = (r"(?:\\?\"([^\"\\\r\n]{1,256}+)|\\?'([^'\\\r\n]{1,256}+)"
          r"|([^\s\"'`,;&|<>(){}\[\]\\=][^\s\"'`,;&|<>(){}\[\]\\]{0,255}+))")
_SCHEMES = r"(?i:bearer|basic|digest|token|negotiate|ntlm|apikey|aws4-hmac-sha256)"
_TOKEN68 = r"A-Za-z0-9._~+/=-"

# Order matters: earlier detectors win overlaps. Secrets first (a JWT or key may contain
# things that look like other data), then structured numbers, then addresses.
DETECTORS: tuple[Detector, ...] = (
    Detector("PRIVATE_KEY", re.compile(
        r"-----BEGIN (?:[A-Z0-9]{1,20} ){0,3}PRIVATE KEY(?: BLOCK)?-----"
        r"(?:[A-Za-z0-9+/=\s:,]|-(?!-)){0,16384}+"  # base64 and Proc-Type/DEK-Info lines
        r"(?:-----END (?:[A-Z0-9]{1,20} ){0,3}PRIVATE KEY(?: BLOCK)?-----)?")),
    # Atrium keys are atr_ + 36 characters; a longer or mangled one is still a key, while
    # the 12-character prefix shown in lists and logs is not matched.
    Detector("API_KEY", re.compile(_B + r"atr_[A-Za-z0-9]{30,64}+" + _E)),
    Detector("API_KEY", re.compile(_B + r"atrinv_[A-Za-z0-9_-]{20,64}+")),
    Detector("AWS_KEY", re.compile(_B + r"(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}" + _E)),
    Detector("GITHUB_TOKEN", re.compile(
        _B + r"(?:gh[pousr]_[A-Za-z0-9]{36,251}+|github_pat_[A-Za-z0-9_]{22,247}+)" + _E)),
    Detector("JWT", re.compile(
        _B + r"eyJ[A-Za-z0-9_-]{8,}+\.eyJ[A-Za-z0-9_-]{8,}+\.[A-Za-z0-9_-]*+")),
    # Well-known key formats: OpenAI-style sk-..., Stripe, Slack, Google API keys.
    Detector("SECRET", re.compile(
        _B + r"(?:sk-(?:proj-)?[A-Za-z0-9_-]{20,200}+|(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{10,200}+"
        r"|xox[abposr]-[A-Za-z0-9-]{10,200}+|AIza[A-Za-z0-9_-]{35})" + _E)),
    # The Authorization header: everything after the scheme, to the end of the value.
    Detector("SECRET", re.compile(
        _NAME_START + r"(?i:(?:proxy-)?authorization)" + _ASSIGN
        + r"(?:\\?\"(?:" + _SCHEMES + r"[ \t]++)?+([^\"\\\r\n]{1,4096}+)"
        r"|\\?'(?:" + _SCHEMES + r"[ \t]++)?+([^'\\\r\n]{1,4096}+)"
        r"|(?:" + _SCHEMES + r"[ \t]++)?+([^\s\"'][^\r\n]{0,4095}+))"), group=(1, 2, 3)),
    # "Bearer <token>" anywhere: a token with a digit or a symbol, or a long run of letters
    # (so "bearer bonds" stays prose).
    Detector("SECRET", re.compile(
        _NAME_START + r"(?i:bearer)[ \t]++((?=[A-Za-z]{0,4096}+[0-9._~+/=-])[" + _TOKEN68
        + r"]{1,4096}+|[A-Za-z]{12,4096}+(?![" + _TOKEN68 + r"]))"), group=1),
    Detector("SECRET", re.compile(
        _NAME_START + r"(?i:" + _SECRET_NAMES + r")" + _ASSIGN + _VALUE), group=(1, 2, 3)),
    # A password in a URL: scheme://user:password@host.
    Detector("SECRET", re.compile(
        r"(?<=://)[^\s/:@]{0,128}+:([^\s/@]{1,256}+)@"), group=1),
    Detector("IBAN", re.compile(
        _B + r"[A-Z]{2}\d{2}(?: ?+[A-Z0-9]{4}){2,7}+(?: ?+[A-Z0-9]{1,4})?+" + _E), _iban),
    # Runs of digit groups; card_spans picks the Luhn-valid card numbers out of a run.
    Detector("CARD", re.compile(_B + r"\d(?:[ -]?+\d){12,}+" + _E), split=card_spans),
    Detector("SSN", re.compile(
        _B + r"(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}" + _E)),
    Detector("EMAIL", re.compile(
        r"(?<![A-Za-z0-9!#$%&'*+/=?^_`{|}~.-])[A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]{1,64}+"
        r"@[A-Za-z0-9-]{1,63}+(?:\.[A-Za-z0-9-]{1,63}+){1,8}+")),
    Detector("IP", re.compile(r"(?<![\d.vV])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])"), _ipv4),
    Detector("IP", re.compile(
        r"(?<![0-9A-Za-z_:])(?:[0-9A-Fa-f]{0,4}:){2,7}+[0-9A-Fa-f]{0,4}(?![0-9A-Za-z_:])"),
        _ipv6),
    Detector("PHONE", re.compile(
        r"(?<![\w+./-])(?:\+\d{1,3}[ .-]?)?+(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])"
        r"\d{3,4}[ .-]?\d{3,4}(?!\w)"), _phone),
    # International numbers written in pairs or small groups: +33 1 23 45 67 89.
    Detector("PHONE", re.compile(r"(?<![\w+])\+\d{1,3}(?:[ .-]?+\d{1,4}+){2,7}+(?![\w])"),
             _phone),
)
