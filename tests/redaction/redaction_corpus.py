"""A labelled corpus for redaction: true positives in the contexts people paste them in,
and look-alikes that must be left alone. Scored by `score`; the figures are in
docs/request-logs.md and bench/results/redaction.json (bench/redaction.py).

Every value below is made up or a published test value (AWS's documented example key,
card networks' test numbers, IBAN registry examples). A case lists each secret or
personal datum in its text with its kind; a case with none is a look-alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from redaction import find

SECRET_KINDS = {"API_KEY", "AWS_KEY", "GITHUB_TOKEN", "JWT", "PRIVATE_KEY", "SECRET"}
CARD_KINDS = {"CARD"}
PERSONAL_KINDS = {"EMAIL", "PHONE", "SSN", "IBAN", "IP"}

PEM = ("-----BEGIN RSA PRIVATE KEY-----\n"
       "MIIBOgIBAAJBAKj34GkxFhD90vcNLYLInFEX6Ppy1tPf9Cnzj4p4WGeKLs1Pt8Qu\n"
       "KUpRKfFLfRYC9AIKjbJTWit+CqvjWYzvQwECAwEAAQJAIJLixBy2qpFoS4DSmoEm\n"
       "-----END RSA PRIVATE KEY-----")
OPENSSH = ("-----BEGIN OPENSSH PRIVATE KEY-----\n"
           "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
           "QyNTUxOQAAACDVnPBVMt2kQn2cOxKMl2JTwZ8tQfGhV1U1HvUGWVX1ZQAAAJgm8Z4BJvGe\n"
           "-----END OPENSSH PRIVATE KEY-----")
JWT = ("eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4g"
       "RG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c")


@dataclass(frozen=True, slots=True)
class Case:
    text: str
    labels: tuple[tuple[str, str], ...] = ()  # (kind, the exact value that must go)


def P(text: str, *labels: tuple[str, str]) -> Case:  # noqa: N802 - reads as a table
    return Case(text, labels)


def N(text: str) -> Case:  # noqa: N802
    return Case(text)


POSITIVES: list[Case] = [
    # --- Atrium's own keys and invitation tokens
    P("my key is atr_4fGh7Jk2Lm9Np3Qr5St8Vw1Xy6Za0Bc2De4F and it stopped working",
      ("API_KEY", "atr_4fGh7Jk2Lm9Np3Qr5St8Vw1Xy6Za0Bc2De4F")),
    P('client = OpenAI(api_key="atr_Zx8Cv7Bn6Mm5Lk4Jh3Gf2Ds1Aq0Wp9Oe8Ir7Uy")',
      ("API_KEY", "atr_Zx8Cv7Bn6Mm5Lk4Jh3Gf2Ds1Aq0Wp9Oe8Ir7Uy")),
    P("ATRIUM_KEY=atr_00aa11bb22cc33dd44ee55ff66gg77hh88ii",
      ("API_KEY", "atr_00aa11bb22cc33dd44ee55ff66gg77hh88ii")),
    P("join with atrinv_Q2hlY2tvdXRUaGlzSW52aXRhdGlvblRva2Vu please",
      ("API_KEY", "atrinv_Q2hlY2tvdXRUaGlzSW52aXRhdGlvblRva2Vu")),
    # --- AWS
    P("aws_access_key_id = AKIAIOSFODNN7EXAMPLE", ("AWS_KEY", "AKIAIOSFODNN7EXAMPLE")),
    P("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
      ("SECRET", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")),
    P("export AWS_SECRET_ACCESS_KEY='je7MtGbClwBF/2Zp9Utk/h3yCo8nvbEXAMPLEKEY'",
      ("SECRET", "je7MtGbClwBF/2Zp9Utk/h3yCo8nvbEXAMPLEKEY")),
    P("temporary creds ASIAY34FZKBOKMUTVV7A expire at noon",
      ("AWS_KEY", "ASIAY34FZKBOKMUTVV7A")),
    P('{"AccessKeyId": "AKIAI44QH8DHBEXAMPLE", "SecretAccessKey": "wJalrXUtnFEMI/K7MDENG"}',
      ("AWS_KEY", "AKIAI44QH8DHBEXAMPLE"), ("SECRET", "wJalrXUtnFEMI/K7MDENG")),
    # --- GitHub
    P("git clone https://ghp_16C7e42F292c6912E7710c838347Ae178B4a@github.com/acme/app.git",
      ("GITHUB_TOKEN", "ghp_16C7e42F292c6912E7710c838347Ae178B4a")),
    P("GITHUB_TOKEN: gho_aB3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW3xY5",
      ("GITHUB_TOKEN", "gho_aB3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW3xY5")),
    P("use github_pat_11ABCDEFG0aBcDeFgHiJkL_mNoPqRsTuVwXyZ0123456789abcdefghijklmnopqrstuv",
      ("GITHUB_TOKEN", "github_pat_11ABCDEFG0aBcDeFgHiJkL_mNoPqRsTuVwXyZ0123456789abcdefghijklmnopqrstuv")),  # noqa: E501
    # --- JWTs
    P(f"the session cookie holds {JWT}", ("JWT", JWT)),
    P(f"id_token={JWT}&state=xyz", ("JWT", JWT)),
    # --- PEM private keys
    P(f"here is the deploy key:\n{PEM}\nwhy does ssh refuse it?", ("PRIVATE_KEY", PEM)),
    P(f"{OPENSSH}", ("PRIVATE_KEY", OPENSSH)),
    P("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7\n"
      "(the rest got cut off)",
      ("PRIVATE_KEY", "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7")),  # noqa: E501
    # --- Authorization and Bearer
    P("curl -H 'Authorization: Bearer sk-proj-abcDEF123ghiJKL456mnoPQR789' https://api.x.io",
      ("SECRET", "sk-proj-abcDEF123ghiJKL456mnoPQR789")),
    P("Authorization: Basic YWxhZGRpbjpvcGVuc2VzYW1l", ("SECRET", "YWxhZGRpbjpvcGVuc2VzYW1l")),
    P('headers = {"Authorization": "Bearer eyJraWQiOiIxIn0x9f"}',
      ("SECRET", "eyJraWQiOiIxIn0x9f")),
    P("requests.get(url, headers={'authorization': 'Token 9944b09199c62bcf9418ad846dd0e4bb'})",
      ("SECRET", "9944b09199c62bcf9418ad846dd0e4bb")),
    P("send Bearer abc123 in the header", ("SECRET", "abc123")),
    P("it failed with bearer t0k3n.x", ("SECRET", "t0k3n.x")),
    P("Proxy-Authorization: Basic dXNlcjpwYXNzd29yZA==", ("SECRET", "dXNlcjpwYXNzd29yZA==")),
    P("Authorization: Digest username=\"bob\", response=\"6629fae49393a05397450978507c4ef1\"",
      ("SECRET", "username=\"bob\", response=\"6629fae49393a05397450978507c4ef1\"")),
    # --- assignments, config files, JSON
    P("password=hunter2", ("SECRET", "hunter2")),
    P('{"password": "x"}', ("SECRET", "x")),
    P('{"username": "bob", "password": "correct horse battery staple"}',
      ("SECRET", "correct horse battery staple")),
    P('{"api_key":"k-9f8e7d6c5b4a"}', ("SECRET", "k-9f8e7d6c5b4a")),
    P("MY_API_KEY=3f9a1c7e5b", ("SECRET", "3f9a1c7e5b")),
    P("DB_PASSWORD=Sup3r$ecret!", ("SECRET", "Sup3r$ecret!")),
    P("STRIPE_SECRET_KEY: sk_live_51Hx9aB2cD3eF4gH5iJ6kL7mN",
      ("SECRET", "sk_live_51Hx9aB2cD3eF4gH5iJ6kL7mN")),
    P("client_secret: 'Xy7_kP2-qR9sT4uV'", ("SECRET", "Xy7_kP2-qR9sT4uV")),
    P("  password: s3cr3t-v@lue\n  user: admin", ("SECRET", "s3cr3t-v@lue")),
    P("refresh_token=1//0gAbCdEfGhIjKlMnOp&grant_type=refresh_token",
      ("SECRET", "1//0gAbCdEfGhIjKlMnOp")),
    P("X-API-Key: 7c4a8d09ca3762af61e59520943dc264",
      ("SECRET", "7c4a8d09ca3762af61e59520943dc264")),
    P("$config['db_pass'] = 'letmein42';", ("SECRET", "letmein42")),
    P(":password => \"rails-pw-99\"", ("SECRET", "rails-pw-99")),
    P('{\\"password\\": \\"escaped-pw\\"}', ("SECRET", "escaped-pw")),
    P("if password == \"admin123\": grant()", ("SECRET", "admin123")),
    P("DATABASE_URL=postgres://app:Pa55w0rd@db.internal:5432/prod", ("SECRET", "Pa55w0rd")),
    P("redis://:r3disPass@cache:6379/0", ("SECRET", "r3disPass")),
    P("OPENAI_API_KEY=sk-abcdefghijklmnopqrstuvwxyz012345",
      ("SECRET", "sk-abcdefghijklmnopqrstuvwxyz012345")),
    P("slack bot token xoxb-123456789012-abcdefABCDEF",
      ("SECRET", "xoxb-123456789012-abcdefABCDEF")),
    P("maps key AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStUvW", ("SECRET", "AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStUvW")),  # noqa: E501
    P("access_token: ya29.a0AfH6SMBx3", ("SECRET", "ya29.a0AfH6SMBx3")),
    P("passphrase=open sesame", ("SECRET", "open")),
    # --- cards
    P("card 4111 1111 1111 1111 exp 12/27", ("CARD", "4111 1111 1111 1111")),
    P("pay with 5555-5555-5555-4444 please", ("CARD", "5555-5555-5555-4444")),
    P("amex 3782 822463 10005 on file", ("CARD", "3782 822463 10005")),
    P("4012888888881881", ("CARD", "4012888888881881")),
    P("cards: 4111 1111 1111 1111 4000 0566 5566 5556",
      ("CARD", "4111 1111 1111 1111"), ("CARD", "4000 0566 5566 5556")),
    P("4242424242424242,5105105105105100", ("CARD", "4242424242424242"),
      ("CARD", "5105105105105100")),
    P("discover 6011 1111 1111 1117.", ("CARD", "6011 1111 1111 1117")),
    P("diners 3056 930902 5904", ("CARD", "3056 930902 5904")),
    P('{"number": "2223003122003222", "cvc": "123"}', ("CARD", "2223003122003222")),
    P("my visa is 4000-0000-0000-0002; my mastercard is 5200 8282 8282 8210",
      ("CARD", "4000-0000-0000-0002"), ("CARD", "5200 8282 8282 8210")),
    # --- personal data
    P("mail me at jane.doe+work@example.co.uk", ("EMAIL", "jane.doe+work@example.co.uk")),
    P("From: Bob <bob@mail.example.com>", ("EMAIL", "bob@mail.example.com")),
    P("call +1 415-555-0132 after 5", ("PHONE", "+1 415-555-0132")),
    P("office (020) 7946 0958", ("PHONE", "(020) 7946 0958")),
    P("Tel: +44 20 7946 0958", ("PHONE", "+44 20 7946 0958")),
    P("reach me on 415.555.0199", ("PHONE", "415.555.0199")),
    P("numéro +33 1 23 45 67 89", ("PHONE", "+33 1 23 45 67 89")),
    P("SSN 078-05-1120 on the form", ("SSN", "078-05-1120")),
    P("IBAN GB82 WEST 1234 5698 7654 32", ("IBAN", "GB82 WEST 1234 5698 7654 32")),
    P("überweisen an DE89370400440532013000 bitte", ("IBAN", "DE89370400440532013000")),
    P("IBAN: FR14 2004 1010 0505 0001 3M02 606", ("IBAN", "FR14 2004 1010 0505 0001 3M02 606")),
    P("client 203.0.113.42 made 40 requests", ("IP", "203.0.113.42")),
    P("ssh root@192.168.1.10", ("IP", "192.168.1.10")),
    P("listen on [2001:db8::ff00:42:8329]:443", ("IP", "2001:db8::ff00:42:8329")),
    P("fe80::1%eth0 is link-local", ("IP", "fe80::1")),
]

NEGATIVES: list[Case] = [
    N("The meeting is on 2024-05-01 at 12:30:45 UTC."),
    N("version 3.11.4 was released; upgrade from 3.10"),
    N("commit 9fceb02d0ae598e95dc970b74767f19372d61af8 fixed it"),
    N("request id 3f2504e0-4f89-11d3-9a0c-0305e82c3301"),
    N("sha256: e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
    N("order #4111111111111112 (luhn fails)"),
    N("tracking number 1Z999AA10123456784"),
    N("ISBN 978-3-16-148410-0"),
    N("The total is $1,234.56 for 12 items"),
    N("pi = 3.14159265358979"),
    N("coordinates 37.7749, -122.4194"),
    N("Forgot your password? Reset it from the login page."),
    N("Choose a strong password and never share it."),
    N("The token limit is 4096; max_tokens=256 and prompt_token_ids=[1, 2, 3]."),
    N("Tokenization splits text into tokens: each token has an id."),
    N("the bearer of this letter is a friend"),
    N("Bearer bonds were popular in the 1980s."),
    N("use sk-learn (scikit-learn) for the baseline"),
    N("@app.route('/users/<int:id>') decorates the view"),
    N("thanks @alice and @bob for the review"),
    N("std::vector<int> v; std::map<std::string, int> m;"),
    N("MAC address 00:1A:2B:3C:4D:5E"),
    N("ratio 16:9, time 10:45, score 3:2"),
    N("IBAN GB83 WEST 1234 5698 7654 32 (typo in the check digits)"),
    N("SSN 000-12-3456 is not a valid number"),
    N("room 101, floor 3, building 12"),
    N("phone extension 4521"),
    N("matrix = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]"),
    N("for i in range(1000000): total += i"),
    N("base64 of hello is aGVsbG8="),
    N("password_hint: the name of your first pet"),
    N("api_key_id=42"),
    N("The secretary: Jane Smith"),
    N("See RFC 6750 for the Bearer token usage."),
    N("Authorization failed."),
    N("pass the salt, please"),
    N("user@localhost cannot receive external mail"),
    N("The file is at C:\\Users\\bob\\Documents\\report.docx"),
    N("https://example.com/search?q=python+regex&page=2"),
    N("phone numbers have 10 digits in the US"),
    N("the year 1984 and the number 42"),
    N("product code 4006381333931 (EAN-13)"),
    N("invoice INV-2024-000123 is due"),
    N("call me maybe, 555 is a fake prefix"),
    N("git checkout -b feature/ABC-1234"),
    N("ghp is a prefix GitHub uses for tokens"),
    N("the AKIA prefix marks AWS access keys"),
    N("JWTs start with eyJ because of base64url"),
    N("-----BEGIN CERTIFICATE-----\nMIIDdzCCAl+gAwIBAgIEAgAAuTANBgkqhkiG9w0BAQUFADBaMQswCQYDVQQG\n"
      "-----END CERTIFICATE-----"),
    N("ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 bob@laptop.local is a public key comment"
      .replace("bob@laptop.local", "bob-laptop")),
    N("temperature=0.7, top_p=0.9, seed=1234"),
    N("numbers 1234 5678 9012 are grouped"),
    N("dimensions 1920x1080 at 60Hz"),
    N("a::b::c is a path in Rust"),
    N("dead::beef looks like hex"),
    N("backup_2024_05_01_1230.tar.gz"),
    N("error code 0x80070005"),
    N("US zip 94107-1234"),
    N("credit card payments are processed nightly"),
    N("Enter your card number below."),
    N("1.2.3 < 1.10.0 in semver"),
    N("she was born in 1990 and moved in 2010"),
    N("the token was rejected because it expired"),
    N("our secret sauce is good tests"),
    N("Q3 revenue grew 12% to $4.5M"),
    N("lat/long 51.5074 N, 0.1278 W"),
    N("Order 123-45-678 shipped"),
    N("He scored 4111 points in 1111 games"),
    N("serial SN-2024-0001-XYZ"),
    N("the function returns -1 on error"),
]


@dataclass(frozen=True, slots=True)
class Scores:
    labelled: dict[str, int]  # by group
    found: dict[str, int]  # labelled values fully redacted, by group
    detections: int
    correct_detections: int
    false_positives: list[str]  # the text of each detection that redacts nothing labelled

    def recall(self, group: str) -> float:
        return self.found[group] / self.labelled[group] if self.labelled[group] else 1.0

    @property
    def precision(self) -> float:
        return self.correct_detections / self.detections if self.detections else 1.0


def _group(kind: str) -> str:
    if kind in SECRET_KINDS:
        return "secrets"
    return "cards" if kind in CARD_KINDS else "personal"


def score(cases: list[Case] | None = None) -> Scores:
    """Recall: a labelled value counts as found when redaction covers all of it (whatever
    placeholder it gets). Precision: a detection is correct when it overlaps a labelled
    value."""
    cases = cases if cases is not None else POSITIVES + NEGATIVES
    labelled = {"secrets": 0, "cards": 0, "personal": 0}
    found = dict(labelled)
    detections = correct = 0
    false_positives = []
    for case in cases:
        spans = find(case.text)
        wanted = []
        for kind, value in case.labels:
            start = case.text.index(value)
            wanted.append((start, start + len(value)))
            labelled[_group(kind)] += 1
            covered = set()
            for s, e, _ in spans:
                covered.update(range(max(s, start), min(e, start + len(value))))
            if len(covered) == len(value):
                found[_group(kind)] += 1
        for s, e, _ in spans:
            detections += 1
            if any(s < we and ws < e for ws, we in wanted):
                correct += 1
            else:
                false_positives.append(case.text[s:e])
    return Scores(labelled, found, detections, correct, false_positives)
