"""The names of the inference app's Celery tasks, for whoever schedules or routes them
(settings' beat schedule and atrium/lanes.py, which load before Django: no Django here).
A batch's runner is registered here too, under the batches app's name for it
(batches/tasknames.py)."""

ENGINES_PRUNE = "inference.tasks.engines_prune"
QUOTA_RECONCILE = "inference.tasks.quota_reconcile"
BATCHES_RESUME = "inference.tasks.batches_resume"
