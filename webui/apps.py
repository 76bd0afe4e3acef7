from django.apps import AppConfig


class WebuiConfig(AppConfig):
    name = "webui"
    default_auto_field = "django.db.models.BigAutoField"
