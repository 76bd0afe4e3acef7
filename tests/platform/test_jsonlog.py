import json
import logging
import subprocess
import sys
from pathlib import Path

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


def test_the_servers_own_loopback_address_stays_readable_and_a_clients_does_not():
    started = _format("Uvicorn running on %s://%s:%d (Press CTRL+C to quit)",
                      "http", "127.0.0.1", 8000)
    assert started["msg"] == "Uvicorn running on http://127.0.0.1:8000 (Press CTRL+C to quit)"
    metrics = _format("Prometheus metrics on http://%s:%d/metrics", "0.0.0.0", 9100)
    assert metrics["msg"] == "Prometheus metrics on http://0.0.0.0:9100/metrics"
    assert _format("listening on [::1]:8000")["msg"] == "listening on [::1]:8000"
    client = _format('%s - "POST /v1/chat/completions HTTP/1.1" 200', "203.0.113.9:51234")
    assert client["msg"] == '[IP]:51234 - "POST /v1/chat/completions HTTP/1.1" 200'
    secrets = _format("from 127.0.0.1 mail %s key AKIAIOSFODNN7EXAMPLE", "bob@example.com")
    assert secrets["msg"] == "from 127.0.0.1 mail [EMAIL] key [AWS_KEY]"
