"""Redaction: typed placeholders for secrets and personal data, in linear time.

    >>> redact("mail bob@example.com, card 4111 1111 1111 1111")
    'mail [EMAIL], card [CARD]'

Pure Python and the standard library only, so every process can use it: the web
and Celery processes (through Django's LOGGING and the request log), and the
engine workers, which must not import Django (docs/request-logs.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from redaction.detectors import DETECTORS, Detector

__all__ = ["Detector", "DETECTORS", "redact", "redact_json", "find"]

Span = tuple[int, int, str]


def _group_span(match: re.Match[str], group: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(group, int):
        return match.span(group)
    for g in group:
        if match.start(g) != -1:
            return match.span(g)
    return 0, 0


_CASE_SENSITIVE: dict[re.Pattern[str], re.Pattern[str]] = {}


def _case_sensitive(pattern: re.Pattern[str]) -> re.Pattern[str]:
    """A folded detector's pattern without IGNORECASE, for lower-cased text."""
    found = _CASE_SENSITIVE.get(pattern)
    if found is None:
        found = _CASE_SENSITIVE[pattern] = re.compile(pattern.pattern,
                                                      pattern.flags & ~re.IGNORECASE)
    return found


def _detect(text: str, lowered: str, det: Detector) -> list[Span]:
    """One detector's spans, sorted and disjoint (finditer's matches never overlap)."""
    if det.triggers and not any(t in lowered for t in det.triggers):
        return []
    if det.fold and len(lowered) == len(text):
        # NOTE: same length, so every position in the lower-cased text is the original's.
        matches = _case_sensitive(det.pattern).finditer(lowered)
    else:
        matches = det.pattern.finditer(text)
    spans: list[Span] = []
    for match in matches:
        start, end = _group_span(match, det.group)
        if det.widen is not None:
            widened = det.widen(text, start)
            if widened is None:
                continue
            # NOTE: widened back into the previous match (two addresses joined by "="):
            # what lies between them is this one's.
            start = max(widened, spans[-1][1]) if spans else widened
        if start >= end:
            continue
        if det.split is not None:
            spans.extend((start + a, start + b, det.kind) for a, b in det.split(text[start:end]))
        elif det.validate is None or det.validate(text[start:end]):
            spans.append((start, end, det.kind))
    return spans


RESCAN_CONTEXT = 256  # characters before a piece that a detector may need (``api_key=``)


def _rescan(text: str, lowered: str, det: Detector, a: int, b: int) -> list[Span]:
    """``det``'s spans in ``text[a:b]``, the part of one of its matches that other detectors
    left: found in the piece alone ("&victim@example.org" right of an api_key is still an
    address, "@db.internal" right of a password is none) and, for detectors that need what
    precedes (``api_key=`` before a value), in the piece with its context, if they start in it.
    """
    spans = [(a + x, a + y, kind) for x, y, kind in _detect(text[a:b], lowered[a:b], det)]
    lo = max(0, a - RESCAN_CONTEXT)
    spans += [(lo + x, min(lo + y, b), kind)
              for x, y, kind in _detect(text[lo:b], lowered[lo:b], det) if lo + x >= a]
    spans.sort()
    merged: list[Span] = []
    for start, end, kind in spans:
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]), merged[-1][2])
        else:
            merged.append((start, end, kind))
    return merged


def _merge(text: str, lowered: str, det: Detector, taken: list[Span],
           new: list[Span]) -> list[Span]:
    """``taken`` plus whatever of ``new`` lies outside it, sorted.

    Where a new span overlaps taken ones, its detector is run again on the parts outside
    them: an e-mail address whose local part reached back over ``api_key=x&`` is still
    found after the key.
    NOTE: both lists are sorted and disjoint within themselves, so each new span only has
    to be checked against the taken spans from the first that ends after it starts.
    """
    out: list[Span] = []
    i = 0
    for start, end, kind in new:
        while i < len(taken) and taken[i][1] <= start:
            out.append(taken[i])
            i += 1
        if i == len(taken) or taken[i][0] >= end:
            out.append((start, end, kind))
            continue
        pieces, j = [], i
        while j < len(taken) and taken[j][0] < end:
            pieces.append((start, taken[j][0]))
            start = max(start, taken[j][1])
            j += 1
        pieces.append((start, end))
        out.extend(span for a, b in pieces if a < b for span in _rescan(text, lowered, det, a, b))
    out.extend(taken[i:])
    out.sort()
    return out


def find(text: str, extra: Iterable[Detector] = ()) -> list[Span]:
    """Non-overlapping (start, end, kind) spans, sorted; earlier detectors win overlaps.

    ``extra`` (a tenant's own detectors) run after the built-in ones.
    """
    taken: list[Span] = []
    lowered = text.lower()
    for det in (*DETECTORS, *extra):
        found = _detect(text, lowered, det)
        if found:
            taken = _merge(text, lowered, det, taken, found) if taken else found
    return taken


def redact(text: str, extra: Iterable[Detector] = ()) -> str:
    if not text:
        return text
    out, last = [], 0
    for start, end, kind in find(text, extra):
        out.append(text[last:start])
        out.append(f"[{kind}]")
        last = end
    out.append(text[last:])
    return "".join(out)


def redact_json(value: Any, extra: Iterable[Detector] = ()) -> Any:
    """Every string in a JSON-like value redacted, keys included; the structure kept.

    NOTE: redact the strings, never the serialized document: in JSON a private key's
    line breaks are the two characters backslash and n, which its detector would stop at.
    """
    extra = tuple(extra)
    if isinstance(value, str):
        return redact(value, extra)
    if isinstance(value, dict):
        return {redact(str(k), extra): redact_json(v, extra) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_json(v, extra) for v in value]
    return value


def tenant_detector(name: str, pattern: str) -> Detector:
    """A tenant's own pattern, checked and compiled by `redaction.custom`."""
    from redaction.custom import compile_pattern

    return Detector(name.upper(), compile_pattern(pattern))
