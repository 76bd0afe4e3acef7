"""What counts as a secret or personal datum, and how to find it in linear time.

Every pattern is written so the regex engine cannot backtrack badly: bounded
repetition, character classes that cannot overlap at a boundary, and atomic
groups / possessive quantifiers where a run could be split several ways. Some
detectors also validate the match (Luhn for cards, mod-97 for IBANs, the
`ipaddress` module for IPs), which is what keeps precision high.
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
    group: int = 0  # the part of the match to replace (e.g. the value after "password=")


def luhn_ok(digits: str) -> bool:
    total, parity = 0, len(digits) % 2
    for i, ch in enumerate(digits):
        d = ord(ch) - 48
        if i % 2 == parity:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card(match: str) -> bool:
    digits = re.sub(r"[ -]", "", match)
    return 13 <= len(digits) <= 19 and digits[0] in "2345636" and luhn_ok(digits)


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
    if match.count(":") < 2:
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

# Order matters: secrets first (a JWT or key may contain things that look like
# other data), then structured numbers, then addresses.
DETECTORS: tuple[Detector, ...] = (
    Detector("PRIVATE_KEY", re.compile(
        r"-----BEGIN (?:[A-Z0-9]{1,20} ){0,3}PRIVATE KEY-----"
        r"(?:[A-Za-z0-9+/=\s:,]|-(?!-)){0,16384}+"  # base64 and Proc-Type/DEK-Info lines
        r"(?:-----END (?:[A-Z0-9]{1,20} ){0,3}PRIVATE KEY-----)?")),
    Detector("API_KEY", re.compile(_B + r"atr_[A-Za-z0-9]{36}" + _E)),
    Detector("AWS_KEY", re.compile(_B + r"(?:AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}" + _E)),
    Detector("GITHUB_TOKEN", re.compile(
        _B + r"(?:gh[pousr]_[A-Za-z0-9]{36,251}+|github_pat_[A-Za-z0-9_]{22,247}+)" + _E)),
    Detector("JWT", re.compile(
        _B + r"eyJ[A-Za-z0-9_-]{8,}+\.eyJ[A-Za-z0-9_-]{8,}+\.[A-Za-z0-9_-]{8,}+")),
    Detector("SECRET", re.compile(
        r"(?i:\bbearer)[ \t]++([A-Za-z0-9._~+/=-]{12,}+)"), group=1),
    Detector("SECRET", re.compile(
        r"(?i:\b(?:password|passwd|pwd|secret|client_secret|api[_-]?key|apikey|"
        r"access[_-]?key|auth[_-]?token|token)\b)"
        r"[ \t]{0,8}+[:=][ \t]{0,8}+[\"']?+([^\s\"',;]{4,256}+)"), group=1),
    Detector("CARD", re.compile(_B + r"\d(?:[ -]?+\d){12,18}+" + _E), _card),
    Detector("SSN", re.compile(
        _B + r"(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}" + _E)),
    Detector("IBAN", re.compile(
        _B + r"[A-Z]{2}\d{2}(?: ?+[A-Z0-9]{4}){2,7}+(?: ?+[A-Z0-9]{1,4})?+" + _E), _iban),
    Detector("EMAIL", re.compile(
        r"(?<![A-Za-z0-9!#$%&'*+/=?^_`{|}~.-])[A-Za-z0-9!#$%&'*+/=?^_`{|}~.-]{1,64}+"
        r"@[A-Za-z0-9-]{1,63}+(?:\.[A-Za-z0-9-]{1,63}+){1,8}+")),
    Detector("IP", re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])"), _ipv4),
    Detector("IP", re.compile(
        r"(?<![0-9A-Fa-f:])(?:[0-9A-Fa-f]{0,4}:){2,7}+[0-9A-Fa-f]{0,4}(?![0-9A-Fa-f:])"),
        _ipv6),
    Detector("PHONE", re.compile(
        r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?+(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])"
        r"\d{3,4}[ .-]?\d{3,4}(?!\w)"), _phone),
)
