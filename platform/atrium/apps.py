from __future__ import annotations

from django.apps import AppConfig


class AtriumConfig(AppConfig):
    """The project's own checks, run as Django starts in every process."""

    name = "atrium"
    verbose_name = "Atrium"

    def ready(self) -> None:
        from atrium.celery import check_broker
        from core import cancellation

        cancellation.install()
        check_broker()
