"""What the `atrium` commands share: the environment, tenants and keys by name, ports."""

from __future__ import annotations

import errno
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path


def django_setup() -> None:
    atrium_home()  # the SQLite file and the adapter store live there by default
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")
    import django

    django.setup()


def atrium_home() -> Path:
    home = Path(os.environ.get("ATRIUM_HOME", Path.home() / ".atrium")).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home


def tenant_or_exit(slug: str):
    from tenants.models import Tenant

    tenant = Tenant.objects.filter(slug=slug).first()
    if tenant is None:
        sys.exit(f"atrium: no tenant {slug!r}; create it with `atrium create-tenant`")
    return tenant


def new_key(tenant, *, name: str, scopes, expires_in: timedelta | None) -> str:
    from django.utils import timezone

    from core.errors import ApiError
    from tenants.services import api_key_create

    expires_at = timezone.now() + expires_in if expires_in else None
    try:
        key, plaintext = api_key_create(tenant=tenant, name=name, scopes=scopes,
                                        expires_at=expires_at)
    except ApiError as exc:
        sys.exit(f"atrium: {exc.message}")
    until = f"until {key.expires_at:%Y-%m-%d %H:%M} UTC" if key.expires_at else "no expiry"
    print(f"created key {key.pk} ({key.prefix}…, '{key.name}') for tenant '{tenant.slug}': "
          f"scopes {', '.join(key.scopes)}; {until}", file=sys.stderr)
    return plaintext


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # NOTE: the same option uvicorn binds with, so a port in TIME_WAIT counts as free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def refuse_busy_port(host: str, port: int, *, hint: str) -> None:
    """One clear line instead of a server's traceback when the port is taken."""
    try:
        free = port_free(host, port)
    except OSError as exc:
        sys.exit(f"atrium: cannot listen on {host}:{port}: {exc.strerror}")
    if free:
        return
    other = next((p for p in range(port + 1, min(port + 100, 65536)) if port_free(host, p)),
                 None)
    suggestion = f"; try `{hint.format(port=other)}`" if other else ""
    sys.exit(f"atrium: port {port} is in use{suggestion}")
