"""The Django project. Its Celery app is loaded with it, in every process that loads Django,
so tasks queued anywhere go to the platform's Redis (atrium/celery.py)."""

from atrium.celery import app as celery_app

__all__ = ("celery_app",)
