"""Each detector finds what it should, leaves look-alikes alone, and runs in linear time."""

from __future__ import annotations

import json
import string
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from redaction import find, redact, redact_json
from redaction.detectors import luhn_ok
from tenants import keys

ROOT = Path(__file__).resolve().parents[2]
ALNUM = string.ascii_letters + string.digits
# Text around a datum: spaces and punctuation that end a token, never part of one.
around = st.sampled_from([" ", ", ", ". ", "\n", " (", ": "])


def _kinds(text: str) -> list[str]:
    return [kind for _, _, kind in find(text)]


def _luhn_complete(body: str) -> str:
    for check in string.digits:
        if luhn_ok(body + check):
            return body + check
    raise AssertionError


# --- cards ---------------------------------------------------------------------------------

cards = st.builds(lambda prefix, rest, n: _luhn_complete((prefix + rest)[:n - 1]),
                  st.sampled_from(["4", "51", "37", "6011", "2221"]),
                  st.text(string.digits, min_size=20, max_size=20), st.integers(13, 19))


def _grouped(card: str, sep: str) -> str:
    return sep.join(card[i:i + 4] for i in range(0, len(card), 4))


@given(cards, st.sampled_from(["", " ", "-"]))
def test_luhn_valid_cards_are_redacted_with_separators(card, sep):
    assert redact(f"pay with {_grouped(card, sep)} today") == "pay with [CARD] today"


@given(cards)
def test_luhn_invalid_numbers_are_not_cards(card):
    broken = card[:-1] + str((int(card[-1]) + 1) % 10)
    assert "CARD" not in _kinds(f"order {broken}")


cards16 = st.builds(lambda prefix, rest: _luhn_complete((prefix + rest)[:15]),
                    st.sampled_from(["4", "51", "6011", "2221"]),
                    st.text(string.digits, min_size=15, max_size=15))


@given(st.lists(cards16, min_size=2, max_size=4), st.sampled_from([" ", "-"]))
def test_cards_written_one_after_another_are_each_redacted(several, sep):
    text = " ".join(_grouped(card, sep) for card in several)
    assert redact(text) == " ".join(["[CARD]"] * len(several))


def test_phone_numbers_run_together_are_not_taken_for_cards():
    assert "CARD" not in _kinds("call 415 555 0132 415 555 0199 415 555 0101")


# --- personal data -------------------------------------------------------------------------

@given(st.emails(), around)
def test_emails_are_redacted(email, sep):
    assert "[EMAIL]" in redact(f"contact:{sep}{email} ")
    assert email not in redact(f"contact:{sep}{email} ")


def _names_someone(ip) -> bool:
    return not (ip.is_loopback or ip.is_unspecified)


@given(st.ip_addresses(v=4).filter(_names_someone), around)
def test_ipv4_addresses_are_redacted(ip, sep):
    assert redact(f"from{sep}{ip} ok") == f"from{sep}[IP] ok"


# NOTE: an IPv6 address with no digit at all ("dead::beef") is left alone: it reads as
# code ("a::b") far more often than as an address.
@given(st.ip_addresses(v=6).filter(lambda ip: _names_someone(ip)
                                   and any(ch.isdigit() for ch in ip.compressed)))
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


# (country, length of the part after the check digits, alphabet of that part)
IBAN_FORMATS = [("DE", 18, string.digits), ("GB", 18, string.ascii_uppercase[:4] + "0123"),
                ("FR", 23, string.digits), ("NL", 14, string.digits), ("ES", 20, string.digits),
                ("IT", 23, string.digits + "X"), ("CH", 17, string.digits),
                ("MT", 27, string.digits + "MALT")]


def _iban(country: str, bban: str) -> str:
    numeric = "".join(str(int(ch, 36)) for ch in bban + country + "00")
    return f"{country}{98 - int(numeric) % 97:02d}{bban}"


ibans = st.sampled_from(IBAN_FORMATS).flatmap(
    lambda f: st.text(f[2], min_size=f[1], max_size=f[1]).map(lambda b: _iban(f[0], b)))


@given(ibans, st.booleans())
def test_valid_ibans_are_redacted(iban, grouped):
    shown = " ".join(iban[i:i + 4] for i in range(0, len(iban), 4)) if grouped else iban
    assert redact(f"iban: {shown} thanks") == "iban: [IBAN] thanks"


@given(ibans)
def test_an_iban_with_a_wrong_check_is_left_alone(iban):
    wrong = iban[:2] + f"{(int(iban[2:4]) + 1) % 100:02d}" + iban[4:]
    assert "IBAN" not in _kinds(f"iban: {wrong}")


digits = st.text(string.digits, min_size=1, max_size=1)


@st.composite
def phones(draw) -> str:
    area = draw(st.integers(201, 989).filter(lambda a: a % 100 != 11))
    exchange, line = draw(st.integers(200, 999)), draw(st.integers(0, 9999))
    style = draw(st.sampled_from(["+1 {a}-{e}-{l}", "({a}) {e}-{l}", "{a}.{e}.{l}",
                                  "{a}-{e}-{l}", "+1 ({a}) {e} {l}", "+44 20 {e}4 {l}",
                                  "+49 30 {e}{d} {l}", "+33 1 {p} {q} {r} {s}"]))
    n = f"{line:04d}"
    return style.format(a=area, e=exchange, l=n, d=draw(digits),
                        p=n[:2], q=n[2:], r=f"{exchange % 100:02d}", s=f"{area % 100:02d}")


@given(phones(), around)
def test_phone_numbers_are_redacted(phone, sep):
    assert redact(f"call{sep}{phone} now") == f"call{sep}[PHONE] now"


@pytest.mark.parametrize("text", ["the year 2024 and 3 cats", "version 10.2", "pi is 3.14159",
                                  "room 12, floor 3", "order #12345", "v1.2.3.4 released",
                                  "std::vector<int> v; a::b", "at 12:30:45 sharp",
                                  "MAC 00:1A:2B:3C:4D:5E"])
def test_ordinary_numbers_and_code_are_left_alone(text):
    assert redact(text) == text


# --- secrets -------------------------------------------------------------------------------

def _token(alphabet: str, low: int, high: int):
    return st.text(alphabet, min_size=low, max_size=high)


SECRET_STRATEGIES = {
    "API_KEY": st.builds(lambda _: keys.generate().plaintext, st.integers()),
    "AWS_KEY": st.builds(lambda p, b: p + b, st.sampled_from(["AKIA", "ASIA"]),
                         _token(string.ascii_uppercase + string.digits, 16, 16)),
    "GITHUB_TOKEN": st.one_of(
        st.builds(lambda p, b: p + b, st.sampled_from(["ghp_", "gho_", "ghs_", "ghu_"]),
                  _token(ALNUM, 36, 40)),
        st.builds(lambda b: "github_pat_" + b, _token(ALNUM + "_", 22, 82))),
    "JWT": st.builds(lambda h, p, s: f"eyJ{h}.eyJ{p}.{s}", _token(ALNUM + "_-", 8, 40),
                     _token(ALNUM + "_-", 8, 120), _token(ALNUM + "_-", 0, 60)),
    "SECRET": st.builds(lambda p, b: p + b, st.sampled_from(["sk-", "sk-proj-", "sk_live_",
                                                             "xoxb-"]),
                        _token(ALNUM, 24, 48)),
}


@pytest.mark.parametrize("kind", sorted(SECRET_STRATEGIES))
def test_every_secret_format_is_redacted_in_any_context(kind):
    @given(SECRET_STRATEGIES[kind], around, around)
    def check(secret, before, after):
        # NOTE: a secret ending in a name ("…pwd", "…Token") before ": " reads as
        # "<name>: <value>", and the value ("done") is redacted too, rightly.
        assume(after != ": " or not secret[-1:].isalpha())
        text = f"here{before}{secret}{after}done"
        assert redact(text) == f"here{before}[{kind}]{after}done"

    check()


@given(_token(string.ascii_letters + string.digits + "+/", 40, 400))
def test_pem_private_key_blocks_are_redacted_whole(body):
    lines = "\n".join(body[i:i + 64] for i in range(0, len(body), 64))
    for label in ("RSA PRIVATE KEY", "OPENSSH PRIVATE KEY", "PRIVATE KEY", "EC PRIVATE KEY"):
        pem = f"-----BEGIN {label}-----\n{lines}\n-----END {label}-----"
        assert redact(f"key:\n{pem}\nthanks") == "key:\n[PRIVATE_KEY]\nthanks"


names = st.sampled_from(["password", "PASSWORD", "passwd", "pwd", "secret", "api_key",
                         "API-KEY", "apikey", "access_token", "auth_token", "client_secret",
                         "MY_API_KEY", "DB_PASSWORD", "aws_secret_access_key", "x-api-key",
                         "refresh_token", "private_key"])
values = _token(ALNUM + "!#$%*+-./:?@^_~", 1, 40)


@given(names, values, st.sampled_from(["{n}={v}", "{n}: {v}", "{n} = {v}", '"{n}": "{v}"',
                                       '{{"{n}":"{v}"}}', "'{n}': '{v}'", '{n}="{v}"',
                                       "export {n}='{v}'", '\\"{n}\\": \\"{v}\\"']))
def test_assignments_of_secrets_are_redacted_whatever_the_syntax(name, value, shape):
    assert redact(shape.format(n=name, v=value)) == shape.format(n=name, v="[SECRET]")


@given(st.sampled_from(["Bearer", "bearer", "BEARER"]),
       _token(ALNUM + "._~+/-", 1, 80).filter(lambda t: not t.isalpha()))
def test_bearer_tokens_of_any_length_are_redacted(scheme, token):
    assert redact(f"sent {scheme} {token} ok") == f"sent {scheme} [SECRET] ok"


@given(st.sampled_from(["Bearer", "Basic", "Digest", "Token", ""]), _token(ALNUM + "+/=", 1, 80),
       st.sampled_from(["Authorization: {s}{v}", '"Authorization": "{s}{v}"',
                        "{{'authorization': '{s}{v}'}}", "Proxy-Authorization: {s}{v}"]))
def test_authorization_headers_are_redacted_whatever_the_scheme(scheme, value, shape):
    shown = f"{scheme} " if scheme else ""
    assert redact(shape.format(s=shown, v=value)) == shape.format(s=shown, v="[SECRET]")


@pytest.mark.parametrize("text, expected", [
    ("Authorization: Bearer abc.DEF-123_456xyz", "Authorization: Bearer [SECRET]"),
    ("Authorization: Basic dXNlcjpwYXNz", "Authorization: Basic [SECRET]"),
    ("password=hunter22", "password=[SECRET]"),
    ('api_key: "sk-live-1234"', 'api_key: "[SECRET]"'),
    ("API-KEY = 9f8e7d6c", "API-KEY = [SECRET]"),
    ('{"password": "x"}', '{"password": "[SECRET]"}'),
    ('{"api_key":"k1"}', '{"api_key":"[SECRET]"}'),
    ("MY_API_KEY=abc", "MY_API_KEY=[SECRET]"),
    ("aws_secret_access_key=wJalrXUtnFEMI/K7MDENG", "aws_secret_access_key=[SECRET]"),
    ("Bearer abc123", "Bearer [SECRET]"),
    ("postgres://bob:s3cret@db.internal/app", "postgres://bob:[SECRET]@db.internal/app"),
    ("the bearer of bad news", "the bearer of bad news"),
    ("password_hint: your pet", "password_hint: your pet"),
    ("max_tokens=16", "max_tokens=16"),
])
def test_assignments_and_bearer_tokens_keep_their_name(text, expected):
    assert redact(text) == expected


def test_text_whose_lower_case_is_longer_is_redacted_the_same():
    # "İ".lower() is two characters: the folded detectors fall back to IGNORECASE.
    for prefix in ("İstanbul: ", "Istanbul: "):
        assert redact(f"{prefix}PASSWORD=hunter2 and bearer abc123") == \
            f"{prefix}PASSWORD=[SECRET] and bearer [SECRET]"


def test_atrium_invitation_tokens_are_secrets():
    assert redact("accept atrinv_Zm9vYmFyYmF6cXV4cXV1eDEyMzQ1Njc4 now") == "accept [API_KEY] now"


# --- the engine as a whole -----------------------------------------------------------------

def test_json_values_are_redacted_string_by_string():
    pem = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----"
    doc = [{"role": "user", "content": f"key {pem} and card 4111 1111 1111 1111"}]
    out = redact_json(doc)
    assert out == [{"role": "user", "content": "key [PRIVATE_KEY] and card [CARD]"}]
    # The serialized document would have hidden the key's body behind "\n" escapes.
    assert "MIIEvQ" in redact(json.dumps(doc))


@settings(max_examples=200)
@given(st.text(max_size=300))
def test_redaction_never_grows_secrets_back(text):
    once = redact(text)
    assert redact(once) == once


# Inputs built to make a backtracking pattern take minutes; each is evaluated in a child
# process so a catastrophic pattern fails this test at its time bound instead of hanging
# the suite (Python's re holds the GIL: a thread could not be interrupted).
ADVERSARIAL = [
    "'a' * 200_000",
    "'a@' * 100_000",
    "'1' * 200_000",
    "'1 ' * 100_000",
    "'1-' * 100_000",
    "':' * 200_000",
    "'a:' * 100_000",
    "'1:' * 100_000",
    "'-----BEGIN PRIVATE KEY-----' * 5_000",
    "'-----BEGIN PRIVATE KEY-----\\n' + 'A' * 200_000",
    "'password=' * 20_000",
    "'password' * 20_000 + '='",
    "'\"password\": \"' * 10_000",
    "'Authorization: ' * 10_000",
    "'Bearer ' * 30_000",
    "'Bearer ' + 'a' * 200_000",
    "'eyJ' + 'a' * 100_000 + '.eyJ' * 1000",
    "('x.' * 50_000) + '@'",
    "'1.1.1.' * 30_000",
    "'GB82 ' * 40_000",
    "'x@y.com ' * 25_000",
    "'4111 1111 1111 1111\\n' * 10_000",
    "'4111 ' * 50_000",
    "'+1 ' * 60_000",
    "'://a:' * 40_000",
    "'sk-' * 60_000",
    "'a' * 150_000 + '@x.io'",
    "'@x.io' * 40_000",
    "'ab.' * 60_000 + '@x.io'",
    "'1a:' * 60_000",
    "'fe80:' * 40_000",
    "'123-12-1234-' * 15_000",
    "'passwordpassword' * 12_000",
    "'PASSWORD: ' * 20_000",
    "'İ' * 100_000 + 'password=x'",
]
TIME_BOUND_S = 2.0  # linear patterns take well under a second on 200 kB


def run_bounded(code: str, bound_s: float) -> float:
    """Runs ``code`` (which prints its own duration) in a child; fails at the bound."""
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                             text=True, timeout=bound_s + 5.0, check=True)
    except subprocess.TimeoutExpired:
        pytest.fail(f"redaction did not finish within {bound_s + 5.0:.0f} s")
    return float(out.stdout.strip())


@pytest.mark.parametrize("expression", ADVERSARIAL, ids=lambda e: e[:24])
def test_hostile_inputs_finish_quickly(expression):
    code = ("import time\nfrom redaction import redact\n"
            f"text = {expression}\n"
            "t = time.perf_counter()\nredact(text)\nprint(time.perf_counter() - t)\n")
    assert run_bounded(code, TIME_BOUND_S) < TIME_BOUND_S


@pytest.mark.parametrize("ip", ["127.0.0.1", "127.8.9.10", "0.0.0.0", "::1", "::"])
def test_loopback_and_any_addresses_name_no_one_and_stay(ip):
    assert redact(f"listening on {ip} port 8000") == f"listening on {ip} port 8000"


# --- secrets side by side, in query strings, headers and encodings --------------------------

PERSONAL = {"EMAIL": st.emails(), "SSN": st.just("123-45-6789"),
            "CARD": st.just("4111 1111 1111 1111"), **SECRET_STRATEGIES}
# What joins two values in a URL, a header, a form or a log line; a few are themselves
# characters an e-mail address's local part may hold.
JOINERS = st.text(alphabet="&=?;:,|/\\\"' \t#+%!", min_size=1, max_size=4)
SECRET_NAMES = st.sampled_from(["api_key", "token", "password", "secret", "authorization"])


@given(SECRET_NAMES, st.sampled_from(sorted(PERSONAL)).flatmap(
    lambda kind: st.tuples(st.just(kind), PERSONAL[kind])), JOINERS, JOINERS)
def test_a_datum_right_after_an_assignment_is_caught_whatever_joins_them(
        name, kind_and_value, joiner, tail):
    """The finding of issue 16: an address straight after ``api_key=x&`` went through."""
    kind, value = kind_and_value
    text = f"GET /v1/x?{name}=hunter2-abc{joiner}{value}{tail}end"
    redacted = redact(text)
    assert "hunter2-abc" not in redacted, redacted
    assert value not in redacted, redacted


@given(st.sampled_from(sorted(PERSONAL)).flatmap(
    lambda kind: st.tuples(PERSONAL[kind], PERSONAL[kind])), JOINERS)
def test_two_data_side_by_side_are_both_caught(pair, joiner):
    first, second = pair
    redacted = redact(f"x {first}{joiner}{second} y")
    assert first not in redacted and second not in redacted, redacted


@given(st.emails(), st.sampled_from(["%40", "%2540"]), st.sampled_from(["?email=", " ", "&to="]))
def test_a_url_encoded_address_is_still_an_address(email, at, before):
    local, domain = email.rsplit("@", 1)
    redacted = redact(f"GET /x{before}{local}{at}{domain} now")
    # NOTE: "/", "?" and "=" may be part of a local part: the span may take them too.
    assert redacted.startswith("GET ") and redacted.endswith("[EMAIL] now"), redacted
