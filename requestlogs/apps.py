from django.apps import AppConfig


class RequestLogsConfig(AppConfig):
    name = "requestlogs"
    verbose_name = "Request logs"
    default_auto_field = "django.db.models.BigAutoField"
