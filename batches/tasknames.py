"""The names of the batches app's Celery tasks, for whoever queues or schedules them
(settings' beat schedule among them, which loads before Django: no Django here)."""

FILES_EXPIRE = "batches.tasks.files_expire"
