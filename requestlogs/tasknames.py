"""The names of the request logs' Celery tasks, for the beat schedule (settings, which loads
before Django: no Django here)."""

REQUEST_LOGS_EXPIRE = "requestlogs.tasks.request_logs_expire"
