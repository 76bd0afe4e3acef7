"""The Celery app is loaded wherever Django is, and only ever sends to the platform's Redis."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from atrium.celery import celery_redis_url

# What services queue through (adapters/queue.py, billing/queue.py): Celery's current app.
SHOW_BROKER = ("import django; django.setup(); "
               "from celery import current_app as app; "
               "print(app.main, app.conf.broker_url, app.conf.result_backend)")


def _run(args: list[str], tmp_path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("CELERY_", "REDIS_URL", "DATABASE_URL"))}
    return subprocess.run(args, env={**base, "ATRIUM_HOME": str(tmp_path),
                                     "DJANGO_SETTINGS_MODULE": "atrium.settings", **env},
                          capture_output=True, text=True, timeout=120)


def test_django_alone_loads_the_celery_app_with_the_configured_redis(tmp_path):
    # NOTE: a fresh process that never imports atrium.celery itself, as the web server is.
    shown = _run([sys.executable, "-c", SHOW_BROKER], tmp_path,
                 REDIS_URL="redis://127.0.0.1:6399/3")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == ["atrium", "redis://127.0.0.1:6399/3",
                                    "redis://127.0.0.1:6399/3"]


@pytest.mark.parametrize("variable", ["CELERY_BROKER_URL", "CELERY_BROKER_WRITE_URL"])
def test_another_broker_in_the_environment_stops_the_process_with_one_line(tmp_path, variable):
    refused = _run([sys.executable, "-m", "atrium.cli", "migrate"], tmp_path,
                   REDIS_URL="redis://127.0.0.1:6399/3", **{variable: "amqp://localhost:5672"})
    assert refused.returncode != 0
    assert refused.stderr.startswith("atrium: Celery must use the platform's Redis")
    assert "amqp://localhost:5672" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "atrium.sqlite3").exists()  # refused before touching anything


def test_a_redis_url_that_is_not_redis_is_refused(tmp_path):
    refused = _run([sys.executable, "-m", "atrium.cli", "migrate"], tmp_path,
                   REDIS_URL="amqp://localhost:5672")
    assert refused.returncode != 0
    assert refused.stderr.startswith("atrium: REDIS_URL must start with")


def test_a_unix_socket_keeps_its_database_in_kombus_spelling():
    assert celery_redis_url("unix:///tmp/r.sock?db=15") == \
        "redis+socket:///tmp/r.sock?virtual_host=15"
    assert celery_redis_url("unix:///tmp/r.sock") == "redis+socket:///tmp/r.sock?virtual_host=0"
    assert celery_redis_url("rediss://h:6380/2") == "rediss://h:6380/2"


def test_under_sentinel_celery_names_the_sentinels_and_the_master(tmp_path):
    show = (SHOW_BROKER[:-1] + ", app.conf.broker_transport_options['master_name'], "
            "app.conf.result_backend_transport_options['master_name'])")
    shown = _run([sys.executable, "-c", show], tmp_path,
                 REDIS_URL="redis://:pw@ignored:6379/2",
                 ATRIUM_REDIS_SENTINELS="127.0.0.1:26379,127.0.0.1:26380",
                 ATRIUM_REDIS_SENTINEL_MASTER="main")
    assert shown.returncode == 0, shown.stderr
    url = "sentinel://:pw@127.0.0.1:26379/2;sentinel://:pw@127.0.0.1:26380/2"
    assert shown.stdout.split() == ["atrium", url, url, "main", "main"]


def test_beat_alone_queues_the_periodic_tasks_and_stops_on_sigterm(tmp_path):
    import signal
    import time

    import redis
    from django.conf import settings

    broker = redis.Redis.from_url(settings.REDIS_URL)
    broker.delete("celery")  # the default queue: no worker reads it in this test
    process = subprocess.Popen(
        [sys.executable, "-m", "atrium.cli", "beat"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("CELERY_")},
             "ATRIUM_HOME": str(tmp_path), "REDIS_URL": settings.REDIS_URL,
             "DJANGO_SETTINGS_MODULE": "atrium.settings"})
    try:
        deadline = time.monotonic() + 60
        while not broker.llen("celery"):  # a periodic task, sent (webhooks: every 5 s)
            assert process.poll() is None, "beat exited"
            assert time.monotonic() < deadline, "beat queued nothing in 60 s"
            time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        broker.delete("celery")
        broker.close()
