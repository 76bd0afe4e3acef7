from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import AllowAny

from adapters import internal as adapter_internal
from inference import views as inference
from webui import views as webui

_public = {"authentication_classes": [], "permission_classes": [AllowAny]}

urlpatterns = [
    path("v1/completions", inference.completions),
    path("v1/chat/completions", inference.chat_completions),
    path("v1/models", inference.models),
    path("v1/models/<path:model>", inference.model_detail),
    path("api/v1/", include("tenants.urls")),
    path("api/v1/", include("requestlogs.urls")),
    path("api/v1/", include("adapters.urls")),
    path("api/v1/", include("billing.urls")),
    path("internal/adapters/<str:adapter_hash>/<str:filename>", adapter_internal.adapter_file),
    path("api/schema/", SpectacularAPIView.as_view(**_public), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema", **_public),
         name="api-docs"),
    path("livez", webui.livez),
    path("readyz", webui.readyz),
    path("admin/", admin.site.urls),
    path("console/", include("webui.urls")),
    path("", webui.index, name="index"),
]
