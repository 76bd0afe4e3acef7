"""The names of the batches app's Celery tasks, for whoever queues or schedules them
(settings' beat schedule among them, which loads before Django: no Django here)."""

FILES_EXPIRE = "batches.tasks.files_expire"
# A batch's runner: inference/tasks.py registers it under this name (the runner is the
# inference pipeline's); batches queues it. The name is this app's, so a lower layer never
# names a module of the layer above it.
BATCH_RUN = "batches.run"
