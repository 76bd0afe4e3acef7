"""API key format: recognisable, checksummed, stored only as a digest.

A key reads ``atr_<30 base62 chars of entropy><6 base62 chars of CRC32>``. The
fixed ``atr_`` prefix lets secret scanners find leaked keys, and the checksum
lets them (and us, before any lookup) reject a string that is not a key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
import zlib
from dataclasses import dataclass

KEY_PREFIX = "atr_"
_ALPHABET = string.digits + string.ascii_letters
_ENTROPY_CHARS = 30  # ~178 bits
_CHECKSUM_CHARS = 6
KEY_LENGTH = len(KEY_PREFIX) + _ENTROPY_CHARS + _CHECKSUM_CHARS
VISIBLE_PREFIX_CHARS = 12  # "atr_" + 8 chars: enough to tell keys apart in a list


@dataclass(frozen=True, slots=True)
class GeneratedKey:
    plaintext: str
    prefix: str
    digest: str


def _base62(number: int, width: int) -> str:
    chars = []
    for _ in range(width):
        number, rem = divmod(number, 62)
        chars.append(_ALPHABET[rem])
    return "".join(reversed(chars))


def _checksum(body: str) -> str:
    return _base62(zlib.crc32(body.encode()), _CHECKSUM_CHARS)


def digest(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def generate() -> GeneratedKey:
    body = "".join(secrets.choice(_ALPHABET) for _ in range(_ENTROPY_CHARS))
    plaintext = KEY_PREFIX + body + _checksum(body)
    return GeneratedKey(plaintext=plaintext, prefix=plaintext[:VISIBLE_PREFIX_CHARS],
                        digest=digest(plaintext))


def is_well_formed(candidate: str) -> bool:
    """Format and checksum only; says nothing about whether the key exists."""
    if len(candidate) != KEY_LENGTH or not candidate.startswith(KEY_PREFIX):
        return False
    rest = candidate[len(KEY_PREFIX):]
    if any(c not in _ALPHABET for c in rest):
        return False
    body, check = rest[:_ENTROPY_CHARS], rest[_ENTROPY_CHARS:]
    return hmac.compare_digest(check, _checksum(body))
