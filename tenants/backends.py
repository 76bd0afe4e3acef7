"""Console sign-in: by username or by email address, whatever its case."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend


class EmailOrUsernameBackend(ModelBackend):
    """Django's model backend, with the identifier matched as a username first and then as an
    email address, case-insensitively. An email two accounts share signs in neither."""

    def authenticate(self, request, username: str | None = None, password: str | None = None,
                     **kwargs):
        if username is None or password is None:
            return None
        users = get_user_model()._default_manager
        user = users.filter(username=username).first()
        if user is None:
            matches = list(users.filter(email__iexact=username.strip())[:2])
            user = matches[0] if len(matches) == 1 else None
        if user is None:
            # NOTE: hash anyway, so an unknown identifier takes as long as a wrong password.
            get_user_model()().set_password(password)
            return None
        if user.check_password(password) and self.user_can_authenticate(user):
            return user
        return None
