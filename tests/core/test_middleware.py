"""Every answer outside the console is JSON with an x-request-id, DEBUG or not; DEBUG's
error page for the console shows no secret (core/middleware.py, core/debug.py)."""

from __future__ import annotations

import pytest

SECRET = "sk-" + "Zq8xW2vL9mN4bR7tY1uK3pA6"  # an OpenAI-style key: redaction catches it
EMAIL = "victim.person@example.org"


@pytest.fixture(params=[False, True], ids=["production", "debug"])
def debug(request, settings):
    settings.DEBUG = request.param
    return request.param


def _is_json_error(response, status: int) -> None:
    assert response.status_code == status
    assert response["Content-Type"] == "application/json"
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert response["x-request-id"].startswith("req_")


@pytest.mark.django_db
@pytest.mark.parametrize("method, path, status", [
    ("get", "/v1/no-such-route", 404), ("get", "/api/v1/no-such-thing", 404),
    ("get", "/nothing/here", 404), ("get", "/v1/chat/completions", 405),
    ("post", "/v1/models", 405), ("get", "/v1/models", 401),
])
def test_an_error_outside_the_console_is_json_with_a_request_id(client, debug, method, path,
                                                                status):
    _is_json_error(getattr(client, method)(path), status)


@pytest.mark.django_db
def test_a_bad_host_header_is_a_json_400(client, debug):
    _is_json_error(client.get("/v1/models", headers={"host": "evil.example:1"}), 400)


@pytest.mark.django_db
@pytest.mark.urls("tests.core.boom_urls")
def test_an_exception_in_an_api_view_is_a_json_500_that_echoes_nothing(debug, settings):
    from django.test import Client

    client = Client(raise_request_exception=False)
    response = client.post(f"/v1/boom?q={SECRET}", data=f'{{"k": "{SECRET}", "e": "{EMAIL}"}}',
                           content_type="application/json",
                           headers={"authorization": f"Bearer {SECRET}"})
    _is_json_error(response, 500)
    assert SECRET not in response.content.decode() and "boom" not in response.content.decode()


@pytest.mark.django_db
@pytest.mark.urls("tests.core.boom_urls")
def test_the_debug_page_for_a_console_error_shows_no_secret(settings):
    from django.test import Client

    settings.DEBUG = True
    client = Client(raise_request_exception=False)
    response = client.post(f"/console/boom?q={SECRET}&api_key=x&{EMAIL}",
                           data=f"password={SECRET}&note={EMAIL}",
                           content_type="application/x-www-form-urlencoded",
                           headers={"authorization": f"Bearer {SECRET}",
                                    "x-forwarded-for": "203.0.113.9"})
    page = response.content.decode()
    assert response.status_code == 500 and "RuntimeError" in page  # the page still helps
    assert SECRET not in page and EMAIL not in page, [
        line for line in page.splitlines() if SECRET in line or EMAIL in line][:5]


@pytest.mark.django_db
def test_successes_carry_a_request_id_too(client):
    response = client.get("/healthz")
    assert response["x-request-id"].startswith("req_")
