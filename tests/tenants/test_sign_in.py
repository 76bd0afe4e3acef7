"""Console sign-in by email, in any case, or by username."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

PASSWORD = "correct horse battery"


@pytest.fixture
def person(db):
    return get_user_model().objects.create_user(username="dana", email="Dana.Smith@Example.com",
                                                password=PASSWORD)


def _sign_in(client, identifier: str, password: str = PASSWORD):
    return client.post("/console/login", {"username": identifier, "password": password})


@pytest.mark.parametrize("identifier", ["dana", "dana.smith@example.com",
                                        "DANA.SMITH@EXAMPLE.COM", " Dana.Smith@Example.com "])
def test_a_person_signs_in_by_username_or_email_in_any_case(client, person, identifier):
    answer = _sign_in(client, identifier)
    assert answer.status_code == 302
    assert int(client.session["_auth_user_id"]) == person.pk


@pytest.mark.parametrize("identifier", ["dana", "dana.smith@example.com", "nobody@example.com"])
def test_a_wrong_password_or_unknown_person_stays_signed_out(client, person, identifier):
    answer = _sign_in(client, identifier, password="wrong horse battery")
    assert answer.status_code == 200
    assert "_auth_user_id" not in client.session
    assert "did not match" in answer.content.decode()


def test_an_email_two_accounts_share_signs_in_neither(client, person):
    get_user_model().objects.create_user(username="dana2", email="dana.smith@example.COM",
                                         password=PASSWORD)
    assert _sign_in(client, "dana.smith@example.com").status_code == 200
    assert "_auth_user_id" not in client.session
    assert _sign_in(client, "dana2").status_code == 302  # the username is unambiguous


def test_an_inactive_person_cannot_sign_in(client, person):
    person.is_active = False
    person.save()
    assert _sign_in(client, "dana.smith@example.com").status_code == 200
    assert "_auth_user_id" not in client.session


def test_the_form_asks_for_an_email_or_username(client, db):
    page = client.get("/console/login").content.decode()
    assert "Email or username" in page
