import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from redaction.jsonlog import JsonFormatter
from tenants import keys


def _format(record_msg: str, *args, **extra) -> dict:
    record = logging.LogRecord("atrium.test", logging.INFO, __file__, 1, record_msg, args, None)
    for k, v in extra.items():
        setattr(record, k, v)
    return json.loads(JsonFormatter().format(record))


def test_log_lines_are_json_with_secrets_redacted():
    key = keys.generate().plaintext
    line = _format("auth failed for %s from %s", key, "bob@example.com")
    assert line["msg"] == "auth failed for [API_KEY] from [EMAIL]"
    assert line["level"] == "INFO" and line["logger"] == "atrium.test"


def test_extra_fields_are_redacted_and_secret_named_fields_dropped():
    line = _format("request", path="/v1/x?card=4111111111111111",
                   authorization="Bearer abcdefghijklmnop", headers={"Cookie": "s=1", "a": 1})
    assert line["path"] == "/v1/x?card=[CARD]"
    assert line["authorization"] == "[REDACTED]"
    assert line["headers"] == {"Cookie": "[REDACTED]", "a": 1}


def test_exception_text_is_redacted():
    try:
        raise ValueError("bad prompt mentioning 123-45-6789")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "boom", (), sys.exc_info())
    line = json.loads(JsonFormatter().format(record))
    assert "123-45-6789" not in line["exc"] and "[SSN]" in line["exc"]


# --- every process logs JSON through redaction ----------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _json_lines(stderr: str) -> list[dict]:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # fails on any line that is not JSON


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)


def test_the_engine_worker_logs_json_through_redaction_without_django():
    out = _run(
        "import logging, sys\n"
        "import engine.worker as worker\n"
        "worker.run_worker = lambda **kw: logging.getLogger('engine.worker').warning(\n"
        "    'auth header was %s', 'Bearer abc123secret')\n"
        "worker.main(['--model-dir', '/nonexistent'])\n"
        "print('django' in sys.modules)\n")
    [line] = [entry for entry in _json_lines(out.stderr) if entry["logger"] == "engine.worker"]
    assert line["msg"] == "auth header was Bearer [SECRET]" and line["level"] == "WARNING"
    assert out.stdout.strip() == "False"


def test_celery_keeps_the_json_root_logger_for_its_own_and_task_loggers():
    out = _run(
        "import logging, django\n"
        "django.setup()\n"
        "from atrium.celery import app\n"
        "from celery.utils.log import get_task_logger\n"
        "app.log.setup(loglevel='INFO', redirect_stdouts=True)\n"
        "logging.getLogger('celery.worker').info('card %s', '4111 1111 1111 1111')\n"
        "get_task_logger('requestlogs.tasks').warning('retrying with password=hunter22')\n"
        "print(type(logging.getLogger().handlers[0].formatter).__name__)\n")
    assert out.stdout.strip() == "JsonFormatter"
    lines = {entry["logger"]: entry["msg"] for entry in _json_lines(out.stderr)}
    assert lines["celery.worker"] == "card [CARD]"
    assert lines["requestlogs.tasks"] == "retrying with password=[SECRET]"


# --- the server's own lines stay readable, a client's data does not ------------------------
# The rule (redaction/detectors.py:_personal): loopback and "any" addresses name no one, so
# they are never redacted; everything else in a line is, whoever logged it.


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@contextmanager
def _captured(name: str) -> Iterator[list[dict]]:
    """Logger ``name``'s lines as the JSON formatter writes them.

    NOTE: on the logger itself, not the root: a uvicorn server started by an earlier
    test configures "uvicorn" not to propagate and "uvicorn.error" to WARNING.
    """
    handler, logger = _Lines(), logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.parametrize(("host", "url"), [
    ("127.0.0.1", "http://127.0.0.1:8000"), ("0.0.0.0", "http://0.0.0.0:8000"),
    ("::1", "http://[::1]:8000"), ("::", "http://[::]:8000"),
    ("localhost", "http://localhost:8000")])
def test_uvicorns_startup_line_keeps_its_url(host, url):
    import uvicorn
    from uvicorn.server import Server

    config = uvicorn.Config("atrium.asgi:application", host=host, port=8000, log_config=None)
    config.ssl = None  # set by Config.load(), which this test does not need
    with _captured("uvicorn.error") as lines:
        Server(config)._log_started_message([])
    [line] = lines
    assert line["msg"] == f"Uvicorn running on {url} (Press CTRL+C to quit)"


def test_uvicorns_terminal_colour_copy_of_a_line_is_left_out():
    line = _format("Started server process [%d]", 42,
                   color_message="Started server process [\x1b[36m%d\x1b[0m]")
    assert line["msg"] == "Started server process [42]" and "color_message" not in line


def test_the_engines_metrics_line_keeps_its_url():
    from engine.metrics_server import serve_metrics

    with _captured("engine.metrics_server") as lines:
        server = serve_metrics(lambda: None, lambda: (True, True), port=0, model_name="m",
                               engine="e")
    try:
        [line] = lines
        port = server.server_address[1]
        assert line["msg"] == f"Prometheus metrics on http://127.0.0.1:{port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_a_clients_public_address_is_redacted():
    line = _format('%s - "POST /v1/chat/completions HTTP/1.1" 200', "203.0.113.9:51234")
    assert line["msg"] == '[IP]:51234 - "POST /v1/chat/completions HTTP/1.1" 200'


def test_a_private_network_address_is_redacted():
    assert _format("bound to http://%s:%d", "10.1.2.3", 8000)["msg"] == "bound to http://[IP]:8000"


def test_secrets_and_personal_data_beside_a_loopback_address_are_redacted():
    line = _format("from 127.0.0.1 mail %s key %s", "bob@example.com", "AKIAIOSFODNN7EXAMPLE")
    assert line["msg"] == "from 127.0.0.1 mail [EMAIL] key [AWS_KEY]"


def test_a_password_in_a_loopback_url_is_redacted():
    line = _format("broker %s", "redis://:hunter22@127.0.0.1:6379/0")
    assert line["msg"] == "broker redis://:[SECRET]@127.0.0.1:6379/0"


# --- every handler of every logger, in development and in production ----------------------

_EVERY_HANDLER = """
import json, logging, django
django.setup()
from django.conf import settings
from django.test import RequestFactory
from django.utils.log import log_response
from django.http import HttpResponseBadRequest
seen = {}
for name in ["", *logging.Logger.manager.loggerDict]:
    logger = logging.getLogger(name)
    for handler in getattr(logger, "handlers", []):
        if isinstance(handler, logging.NullHandler):
            continue  # writes nothing
        seen[f"{name or 'root'}:{type(handler).__name__}"] = type(handler.formatter).__name__
# Django's 4xx line, as its handler writes it for a client's bad request.
request = RequestFactory().get("/v1/x?api_key=sk-Zq8xW2vL9mN4bR7tY1uK3pA6&to=victim@example.org")
log_response("Bad Request: %s", request.get_full_path(), response=HttpResponseBadRequest(),
             request=request)
logging.getLogger("django.server").warning('"GET /?password=hunter22 HTTP/1.1" 400')
print(json.dumps({"debug": settings.DEBUG, "handlers": seen}))
"""


@pytest.mark.parametrize("env", [{"ATRIUM_DEBUG": "1"},
                                 {"ATRIUM_ENV": "production", "ATRIUM_SECRET_KEY": "x" * 50,
                                  "ATRIUM_ALLOWED_HOSTS": "testserver"}],
                         ids=["development", "production"])
def test_every_handler_in_every_mode_writes_redacted_json(env):
    import os

    out = subprocess.run([sys.executable, "-c", _EVERY_HANDLER], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True, env={**os.environ, **env})
    report = json.loads(out.stdout)
    assert report["debug"] is (env.get("ATRIUM_DEBUG") == "1")
    assert report["handlers"] and set(report["handlers"].values()) == {"JsonFormatter"}, report
    lines = _json_lines(out.stderr)
    assert {line["logger"] for line in lines} >= {"django.request", "django.server"}
    for secret in ("sk-Zq8xW2vL9mN4bR7tY1uK3pA6", "victim@example.org", "hunter22"):
        assert secret not in out.stderr, out.stderr
