"""Each detector finds what it should, leaves look-alikes alone, and runs in linear time."""

from __future__ import annotations

import string
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atrium.redaction import find, redact
from atrium.redaction.detectors import luhn_ok
from tenants import keys


def _kinds(text: str) -> list[str]:
    return [kind for _, _, kind in find(text)]


def _luhn_complete(body: str) -> str:
    for check in string.digits:
        if luhn_ok(body + check):
            return body + check
    raise AssertionError


cards = st.builds(lambda prefix, rest, n: _luhn_complete((prefix + rest)[:n - 1]),
                  st.sampled_from(["4", "51", "37", "6011", "2221"]),
                  st.text(string.digits, min_size=20, max_size=20), st.integers(13, 19))


@given(cards, st.sampled_from(["", " ", "-"]))
def test_luhn_valid_cards_are_redacted_with_separators(card, sep):
    grouped = sep.join(card[i:i + 4] for i in range(0, len(card), 4))
    assert redact(f"pay with {grouped} today") == "pay with [CARD] today"


@given(cards)
def test_luhn_invalid_numbers_are_not_cards(card):
    broken = card[:-1] + str((int(card[-1]) + 1) % 10)
    assert "CARD" not in _kinds(f"order {broken}")


@given(st.emails())
def test_emails_are_redacted(email):
    assert "[EMAIL]" in redact(f"contact: {email} ")
    assert email not in redact(f"contact: {email} ")


@given(st.ip_addresses(v=4))
def test_ipv4_addresses_are_redacted(ip):
    assert redact(f"from {ip} ok") == "from [IP] ok"


@given(st.ip_addresses(v=6))
def test_ipv6_addresses_are_redacted(ip):
    text = f"from {ip.compressed} ok"
    assert redact(text) == "from [IP] ok"


@given(st.integers(1, 899).filter(lambda a: a != 666), st.integers(1, 99), st.integers(1, 9999))
def test_ssns_are_redacted(area, group, serial):
    assert redact(f"ssn {area:03d}-{group:02d}-{serial:04d}.") == "ssn [SSN]."


@pytest.mark.parametrize("text", ["000-12-3456", "666-12-3456", "123-00-4567", "123-45-0000",
                                  "2024-01-15", "1234-56-789"])
def test_invalid_ssns_and_dates_are_left_alone(text):
    assert "SSN" not in _kinds(text)


@pytest.mark.parametrize("iban", ["GB82 WEST 1234 5698 7654 32", "DE89370400440532013000",
                                  "FR1420041010050500013M02606", "NL91ABNA0417164300"])
def test_valid_ibans_are_redacted(iban):
    assert redact(f"iban: {iban}") == "iban: [IBAN]"


def test_iban_with_a_wrong_checksum_is_left_alone():
    assert "IBAN" not in _kinds("iban: GB83 WEST 1234 5698 7654 32")


def test_atrium_keys_and_other_secrets_are_redacted():
    samples = {
        keys.generate().plaintext: "[API_KEY]",
        "AKIAIOSFODNN7EXAMPLE": "[AWS_KEY]",
        "ghp_" + "A1b2" * 9: "[GITHUB_TOKEN]",
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz": "[GITHUB_TOKEN]",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9":
            "[JWT]",
    }
    for secret, placeholder in samples.items():
        assert redact(f"x {secret} y") == f"x {placeholder} y"


@pytest.mark.parametrize("text, expected", [
    ("Authorization: Bearer abc.DEF-123_456xyz", "Authorization: Bearer [SECRET]"),
    ("password=hunter22", "password=[SECRET]"),
    ('api_key: "sk-live-1234"', 'api_key: "[SECRET]"'),
    ("API-KEY = 9f8e7d6c", "API-KEY = [SECRET]"),
])
def test_assignments_and_bearer_tokens_keep_their_name(text, expected):
    assert redact(text) == expected


def test_pem_private_key_blocks_are_redacted_whole():
    pem = ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\nQUJDREVG==\n"
           "-----END OPENSSH PRIVATE KEY-----")
    assert redact(f"key:\n{pem}\nthanks") == "key:\n[PRIVATE_KEY]\nthanks"


@pytest.mark.parametrize("text", ["call +1 415-555-0132 now", "call (020) 7946 0958 now",
                                  "call 415.555.0132 now"])
def test_phone_numbers_are_redacted(text):
    assert _kinds(text) == ["PHONE"]


@pytest.mark.parametrize("text", ["the year 2024 and 3 cats", "version 10.2", "pi is 3.14159",
                                  "room 12, floor 3", "order #12345"])
def test_ordinary_numbers_are_left_alone(text):
    assert redact(text) == text


@settings(max_examples=200)
@given(st.text(max_size=300))
def test_redaction_never_grows_secrets_back(text):
    once = redact(text)
    assert redact(once) == once


ADVERSARIAL = [
    "a" * 200_000,
    "a@" * 100_000,
    "1" * 200_000,
    "1 " * 100_000,
    "1-" * 100_000,
    ":" * 200_000,
    "a:" * 100_000,
    "-----BEGIN PRIVATE KEY-----" * 5_000,
    "password=" * 20_000,
    "Bearer " * 30_000,
    "eyJ" + "a" * 100_000 + ".eyJ" * 1000,
    ("x." * 50_000) + "@",
    "1.1.1." * 30_000,
    "GB82 " * 40_000,
    "x@y.com " * 25_000,  # many matches: overlap bookkeeping must not be quadratic
    "4111 1111 1111 1111\n" * 10_000,
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=lambda t: repr(t[:12]))
def test_hostile_inputs_finish_quickly(text):
    started = time.perf_counter()
    redact(text)
    # Linear patterns take well under a second on 200 kB; a backtracking one takes minutes.
    assert time.perf_counter() - started < 2.0
