import json
import logging

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
