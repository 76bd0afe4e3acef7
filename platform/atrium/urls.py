from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.permissions import AllowAny

from adapters import internal as adapter_internal
from inference import batch_views as batch_api
from inference import tokenizing
from inference import views as inference
from inference.protocols import messages_views as messages_api
from inference.protocols import responses_views as responses_api
from webui import views as webui

_public = {"authentication_classes": [], "permission_classes": [AllowAny]}

urlpatterns = [
    path("v1/completions", inference.completions),
    path("v1/chat/completions", inference.chat_completions),
    path("v1/responses", responses_api.create),
    path("v1/responses/<str:response_id>", responses_api.detail),
    path("v1/responses/<str:response_id>/cancel", responses_api.cancel),
    path("v1/responses/<str:response_id>/input_items", responses_api.input_items),
    path("v1/messages", messages_api.create),
    path("v1/messages/count_tokens", messages_api.count_tokens),
    path("v1/streams/<str:request_id>", inference.stream),
    path("v1/embeddings", inference.embeddings),
    path("v1/models", inference.models),
    # vLLM's paths, and the same under /v1/ beside the rest of the API.
    path("v1/tokenize", tokenizing.tokenize),
    path("v1/detokenize", tokenizing.detokenize),
    path("tokenize", tokenizing.tokenize),
    path("detokenize", tokenizing.detokenize),
    path("v1/models/<path:model>", inference.model_detail),
    path("v1/files", batch_api.files),
    path("v1/files/<str:file_id>", batch_api.file_detail),
    path("v1/files/<str:file_id>/content", batch_api.file_content),
    path("v1/batches", batch_api.batches),
    path("v1/batches/<str:batch_id>", batch_api.batch_detail),
    path("v1/batches/<str:batch_id>/cancel", batch_api.batch_cancel),
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
