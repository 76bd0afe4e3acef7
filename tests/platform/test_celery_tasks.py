"""Every task the beat sends or a service queues by name is one the worker knows: a name
nobody registered is discarded by the worker ("unregistered task"), silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# What `celery worker` knows at start, in a fresh process (this one has imported every
# tasks module the suite touched, registered or not).
WORKER_TASKS = ("import json, django; django.setup(); from atrium.celery import app; "
                "app.loader.import_default_modules(); print(json.dumps(sorted(app.tasks)))")


def test_every_scheduled_and_routed_task_is_registered_in_the_worker(tmp_path):
    from django.conf import settings

    from adapters import queue as adapter_queue
    from batches import tasknames as batch_tasks
    from billing import queue as billing_queue

    env = {**os.environ, "ATRIUM_HOME": str(tmp_path),
           "DJANGO_SETTINGS_MODULE": "atrium.settings"}
    done = subprocess.run([sys.executable, "-c", WORKER_TASKS], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    known = set(json.loads(done.stdout.splitlines()[-1]))
    scheduled = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    queued = {batch_tasks.BATCH_RUN, adapter_queue.ADAPTER_VALIDATE,
              billing_queue.EXPORT_BUILD, billing_queue.WEBHOOK_DELIVER,
              *settings.CELERY_TASK_ROUTES}
    assert scheduled | queued <= known, sorted((scheduled | queued) - known)
