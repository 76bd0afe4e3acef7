"""Plant every kind of secret in prompts, send them through the real API (the official
`openai` client, HTTP and websocket, streamed and not), with body logging on for one
tenant and off for another, then search every sink for them: the log output, every
database table (and the SQLite file itself), every Redis key, and every file written,
billing's exports of the ledger included.

The engine echoes its prompt (echo_engine.py), so each secret also travels back as
completion text through the events stream and the relay. What Redis holds is scanned
as text and, where it holds token ids, decoded to text first (docs/request-logs.md).
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import string
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis as redis_lib
from django.conf import settings
from django.db import connection
from openai import OpenAI
from tokenizers import Tokenizer

from engine import protocol
from redaction.detectors import luhn_ok
from redaction.jsonlog import JsonFormatter
from requestlogs.models import RequestLog
from requestlogs.services import log_policy_update, redaction_pattern_create
from tenants import keys
from tenants.access import SYSTEM
from tenants.models import Tenant
from tests.billing.conftest import export_dir  # noqa: F401 - a fixture
from tests.live import make_tenant_key
from tests.requestlogs.conftest import wait_for_logs

ALNUM = string.ascii_letters + string.digits
# Loggers of the client side of the test (they run in this process too, and log what
# the test sends); everything else in the process is the platform, the engine or a library.
CLIENT_LOGGERS = ("openai", "httpx", "httpcore", "websockets")


def _rand(alphabet: str, n: int) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(n))


def _card(prefix: str) -> str:
    body = prefix + _rand(string.digits, 15 - len(prefix))
    digits = next(body + d for d in string.digits if luhn_ok(body + d))
    return " ".join(digits[i:i + 4] for i in range(0, 16, 4))


def _iban() -> str:
    bban = _rand(string.digits, 18)
    numeric = "".join(str(int(ch, 36)) for ch in bban + "DE00")
    return f"DE{98 - int(numeric) % 97:02d}{bban}"


@dataclass
class Planted:
    kind: str  # the placeholder the kept body must show
    text: str  # what goes into the prompt
    needles: tuple[str, ...]  # what must be found nowhere


def plant() -> list[Planted]:
    pem_line = _rand(ALNUM + "+/", 64)
    basic = base64.b64encode(f"admin:{_rand(ALNUM, 12)}".encode()).decode()
    cards = (_card("4"), _card("51"))
    iban = _iban()
    api_key = keys.generate().plaintext
    values = {k: _rand(ALNUM, n) for k, n in (("pw", 10), ("myk", 24), ("aws_s", 40),
                                              ("bearer", 9), ("url", 14), ("json", 20))}
    email = f"{_rand(string.ascii_lowercase, 10)}@example.org"
    planted = [
        Planted("API_KEY", f"my atrium key is {api_key}", (api_key,)),
        Planted("AWS_KEY", f"aws id {(aws := 'AKIA' + _rand(string.ascii_uppercase, 16))}",
                (aws,)),
        Planted("GITHUB_TOKEN", f"token {(gh := 'ghp_' + _rand(ALNUM, 36))} here", (gh,)),
        Planted("JWT", f"jwt {(jwt := 'eyJhbGciOiJIUzI1NiJ9.eyJ' + _rand(ALNUM, 30) + '.' + _rand(ALNUM, 43))}",  # noqa: E501
                (jwt, jwt.split(".")[1], jwt.split(".")[2])),
        Planted("PRIVATE_KEY", f"-----BEGIN RSA PRIVATE KEY-----\n{pem_line}\n"
                               f"-----END RSA PRIVATE KEY-----", (pem_line,)),
        Planted("SECRET", f"Authorization: Basic {basic}", (basic,)),
        Planted("SECRET", f"curl -H 'Authorization: Bearer {values['bearer']}'",
                (values["bearer"],)),
        Planted("SECRET", f'config {{"password": "{values["pw"]}"}}', (values["pw"],)),
        Planted("SECRET", f'{{"api_key":"{values["json"]}"}}', (values["json"],)),
        Planted("SECRET", f"export MY_API_KEY={values['myk']}", (values["myk"],)),
        Planted("SECRET", f"aws_secret_access_key={values['aws_s']}", (values["aws_s"],)),
        Planted("SECRET", f"db at postgres://app:{values['url']}@db.internal/app",
                (values["url"],)),
        Planted("CARD", f"cards {cards[0]} {cards[1]} thanks",
                cards + tuple(c.replace(" ", "") for c in cards)),
        Planted("SSN", f"ssn {(ssn := f'{secrets.randbelow(600) + 100}-{secrets.randbelow(89) + 10}-{secrets.randbelow(8999) + 1000}')}",  # noqa: E501
                (ssn,)),
        Planted("IBAN", f"iban {iban}", (iban,)),
        Planted("EMAIL", f"write to {email}", (email,)),
        Planted("PHONE", f"call {(phone := f'+1 415-{secrets.randbelow(800) + 200}-{secrets.randbelow(9000) + 1000}')}",  # noqa: E501
                (phone, phone[3:])),
        Planted("IP", f"from {(ip := f'10.{secrets.randbelow(250)}.{secrets.randbelow(250)}.{secrets.randbelow(250) + 1}')} today",  # noqa: E501
                (ip,)),
        Planted("ACME_ID", f"customer ACME-{(acme := _rand(string.digits, 6))}",
                (f"ACME-{acme}",)),
    ]
    return planted


class Capture(logging.Handler):
    """Every record the process emits, as the platform's formatter writes it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonFormatter())
        self.lines: list[str] = []
        self.raw: list[str] = []  # messages before redaction, of the platform's loggers

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))
        if not record.name.startswith(CLIENT_LOGGERS):
            self.raw.append(record.getMessage())


@pytest.fixture
def captured_logs():
    root = logging.getLogger()
    handler, level = Capture(), root.level
    quiet = {name: logging.getLogger(name).level for name in CLIENT_LOGGERS}
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    for name in CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)
    for name, old in quiet.items():
        logging.getLogger(name).setLevel(old)


def _text(value) -> str:
    if isinstance(value, memoryview):
        value = value.tobytes()
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _database_text() -> str:
    parts = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            for row in cursor.fetchall():
                parts.append(" ".join(_text(v) for v in row))
    return "\n".join(parts)


def _redis_text(client: redis_lib.Redis, tokenizer: Tokenizer) -> str:
    parts = []
    for key in client.scan_iter(count=1000):
        parts.append(key.decode("latin-1"))
        kind = client.type(key).decode()
        if kind == "string":
            values = [client.get(key)]
        elif kind == "hash":
            values = [k + b"=" + v for k, v in client.hgetall(key).items()]
        elif kind == "list":
            values = client.lrange(key, 0, -1)
        elif kind == "set":
            values = list(client.smembers(key))
        elif kind == "zset":
            values = [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
        elif kind == "stream":
            values = [k + b"=" + v for _, fields in client.xrange(key)
                      for k, v in fields.items()]
        else:
            values = []
        for value in values:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            parts.append(text)
            parts.extend(_decoded_token_ids(text, tokenizer))
    return "\n".join(parts)


def _decoded_token_ids(text: str, tokenizer: Tokenizer) -> list[str]:
    """Token-id arrays in a JSON value, as the text they encode."""
    try:
        doc = json.loads(text)
    except ValueError:
        return []
    found: list[str] = []

    def walk(value) -> None:
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            found.append(tokenizer.decode(value))
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(doc)
    return found


def _files_text(since: float) -> str:
    parts = []
    roots = {Path(settings.ATRIUM_HOME), Path(settings.ATRIUM_ADAPTER_STORE),
             Path(settings.ATRIUM_EXPORT_DIR)}
    for root in roots:
        for path in root.rglob("*") if root.exists() else ():
            if path.is_file() and path.stat().st_mtime >= since:
                parts.append(path.read_bytes().decode("latin-1"))
    return "\n".join(parts)


def _send(client: OpenAI, model: str, prompt: str, how: str) -> None:
    if how == "chat":
        client.chat.completions.create(model=model, max_tokens=1024,
                                       messages=[{"role": "user", "content": prompt}])
    elif how == "chat-stream":
        for _ in client.chat.completions.create(
                model=model, max_tokens=1024, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": prompt}]):
            pass
    else:
        client.completions.create(model=model, prompt=prompt, max_tokens=1024)


def _send_websocket(api_server: str, key: str, model: str, prompt: str) -> None:
    from websockets.sync.client import connect

    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        ws.send(json.dumps({"type": "request", "id": "w", "endpoint": "chat.completions",
                            "body": {"model": model, "max_tokens": 1024,
                                     "messages": [{"role": "user", "content": prompt}]}}))
        while json.loads(ws.recv(timeout=30))["type"] not in ("done", "error"):
            pass


def _bill_and_export(tenants: list[Tenant], since: float) -> None:
    """The usage reports through the ledger, and the ledger out as every export there is."""
    from datetime import UTC, datetime, timedelta

    from billing import services as billing
    from billing.ingest import drain

    assert drain(redis_lib.Redis.from_url(settings.REDIS_URL)) > 0
    start = datetime.fromtimestamp(since, UTC)
    for tenant in tenants:
        for kind, fmt in (("ledger", "csv"), ("ledger", "jsonl"), ("meter_events", "jsonl"),
                          ("invoices", "csv")):
            export = billing.export_create(tenant=tenant, actor=SYSTEM, kind=kind, format=fmt,
                                           start=start, end=start + timedelta(days=1))
            assert billing.export_build(export_id=export.pk).rows > 0


def test_planted_secrets_reach_no_sink_unredacted(api_server, served_model, echo_engine,
                                                  tiny_model_path, captured_logs,
                                                  export_dir):  # noqa: F811
    started = time.time() - 1
    planted = plant()
    marker = f"plantmarker{_rand(string.ascii_lowercase, 12)}"
    callers = {"keeps": make_tenant_key("keeps"), "drops": make_tenant_key("drops")}
    log_policy_update(tenant=Tenant.objects.get(slug="keeps"), actor=SYSTEM, log_bodies=True)
    for slug in callers:
        redaction_pattern_create(tenant=Tenant.objects.get(slug=slug), actor=SYSTEM,
                                 name="ACME_ID", pattern=r"ACME-\d{6}")
    ways = ["chat", "chat-stream", "completion", "websocket"]
    sent = 0
    for caller in callers.values():
        client = OpenAI(base_url=f"{api_server}/v1", api_key=caller.key, max_retries=0,
                        timeout=60)
        for i, item in enumerate(planted):
            prompt = f"{marker} please repeat: {item.text}"
            how = ways[i % len(ways)]
            if how == "websocket":
                _send_websocket(api_server, caller.key, served_model, prompt)
            else:
                _send(client, served_model, prompt, how)
            sent += 1
        # Refused requests carry secrets too: in the model name, and in a bad parameter.
        with pytest.raises(Exception):  # noqa: B017 - 404 from the openai client
            client.completions.create(model=f"model-{planted[1].needles[0]}", prompt="x")
        with pytest.raises(Exception):  # noqa: B017 - 400 from the openai client
            client.completions.create(model=served_model, prompt=planted[0].text,
                                      max_tokens=10, temperature=f"{planted[2].needles[0]}")
        sent += 2
    logs = wait_for_logs(sent)

    # Bodies were kept, redacted, for one tenant, and not at all for the other.
    # In the order the requests were sent (one after another): the background writes
    # may land in the table in another order.
    kept = sorted((log for log in logs if log.tenant.slug == "keeps" and log.status == 200),
                  key=lambda log: log.created_at)
    assert len(kept) == len(planted)
    for log, item in zip(kept, planted, strict=True):
        assert f"[{item.kind}]" in json.dumps(log.prompt) and f"[{item.kind}]" in log.completion
    assert all(log.prompt is None and log.completion is None
               for log in RequestLog.objects.filter(tenant__slug="drops"))

    tokenizer = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    redis_text = _redis_text(redis_lib.Redis.from_url(settings.REDIS_URL), tokenizer)
    # The engines' usage reports wait in Redis for the billing ledger: scanned there, then
    # billed, and the ledger exported (docs/billing.md): scanned as table rows and files.
    assert protocol.usage_stream(served_model) in redis_text
    _bill_and_export(list(Tenant.objects.filter(slug__in=callers)), started)
    sinks = {
        "log output": "\n".join(captured_logs.lines),
        "database": _database_text(),
        "redis": redis_text,
        "files": _files_text(started),
    }
    needles = {n for item in planted for n in item.needles}
    needles |= {caller.key for caller in callers.values()}
    for sink, text in sinks.items():
        leaked = sorted(n for n in needles if n in text)
        assert not leaked, f"{sink} holds {leaked}"
    # Prompt text never reaches a log line at all, redacted or not.
    assert marker not in sinks["log output"]
    assert not [m for m in captured_logs.raw if marker in m or any(n in m for n in needles)]


def _hostile_http(api_server: str, key: str, model: str, planted: list[Planted]) -> int:
    """Requests carrying secrets everywhere a client can put them (all refused but one,
    whose query string is ignored); how many."""
    texts = [item.text for item in planted]
    auth = {"Authorization": f"Bearer {key}"}
    requests = [
        # Bodies that are not JSON, or not what the API takes.
        ("POST", "/v1/chat/completions", auth, "{" + texts[0] + "\ud800".encode(
            "utf-8", "surrogatepass").decode("latin-1")),
        ("POST", "/v1/chat/completions", auth, json.dumps(
            {"model": model, "messages": [{"role": [texts[1]], "content": texts[2]}]})),
        ("POST", "/v1/completions", auth, json.dumps(
            {"model": model, "prompt": texts[3], texts[4][:40]: texts[5]})),
        ("POST", "/v1/completions", auth, json.dumps({"model": texts[6], "prompt": "x"})),
        # Secrets in the query string and the path, with and without a key.
        ("GET", f"/v1/models?api_key={planted[7].needles[0]}&to={planted[15].needles[0]}",
         auth, None),
        # (A path segment is redacted when it looks like a secret: an atr_ key here. A
        # random word in a path is indistinguishable from a name, and is not.)
        ("GET", f"/v1/no-such/{planted[0].needles[0]}", {}, None),
        ("GET", f"/api/v1/tenants/x?password={planted[9].needles[0]}", {}, None),
        # Secrets in headers: a bad key, and headers nobody reads.
        ("GET", "/v1/models", {"Authorization": f"Bearer {planted[10].needles[0]}"}, None),
        ("POST", "/v1/chat/completions", {**auth, "X-Note": texts[11].replace("\n", " ")},
         "not json"),
    ]
    for method, path, headers, body in requests:
        answer = httpx.request(method, f"{api_server}{path}", headers=headers,
                               content=body, timeout=30)
        assert answer.status_code < 500, (path, answer.status_code, answer.text)
        assert answer.headers["content-type"].startswith("application/json")
    return len(requests)


def _hostile_websocket(api_server: str, key: str, model: str, planted: list[Planted]) -> None:
    from websockets.sync.client import connect

    url = api_server.replace("http://", "ws://") + "/v1/stream"
    frames = [
        f"not json {planted[12].text}",
        json.dumps({"type": "request", "id": planted[13].text[:100], "endpoint": "x"}),
        json.dumps({"type": "request", "id": "b", "endpoint": "chat.completions",
                    "body": {"model": model, "messages": [
                        {"role": "user", "content": planted[14].text, "x": planted[16].text}]}}),
        json.dumps({"type": planted[17].text, "id": "c"}),
    ]
    with connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        for frame in frames:
            ws.send(frame)
            assert json.loads(ws.recv(timeout=30))["type"] == "error"


@pytest.mark.parametrize("debug", [True, False], ids=["development", "production"])
def test_secrets_in_refused_requests_reach_no_sink_in_either_mode(
        api_server, served_model, echo_engine, tiny_model_path, captured_logs, settings,
        debug):
    """Issue 16: 4xx bodies, headers, query strings and websocket frames, with DEBUG on as
    a developer runs it and off as production does."""
    settings.DEBUG = debug
    started = time.time() - 1
    planted = plant()
    caller = make_tenant_key("keeps")
    log_policy_update(tenant=Tenant.objects.get(slug="keeps"), actor=SYSTEM, log_bodies=True)
    sent = _hostile_http(api_server, caller.key, served_model, planted)
    _hostile_websocket(api_server, caller.key, served_model, planted)
    assert sent
    # The request log is written in the background: a row for each POST to an inference
    # endpoint with the key (the five that got that far); the scan below must see them.
    wait_for_logs(5, tenant__slug="keeps")

    tokenizer = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    sinks = {
        "log output": "\n".join(captured_logs.lines),
        "database": _database_text(),
        "redis": _redis_text(redis_lib.Redis.from_url(settings.REDIS_URL), tokenizer),
        "files": _files_text(started),
    }
    needles = {n for item in planted for n in item.needles} | {caller.key}
    for sink, text in sinks.items():
        leaked = sorted(n for n in needles if n in text)
        assert not leaked, f"{sink} holds {leaked}"
