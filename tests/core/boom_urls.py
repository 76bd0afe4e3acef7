"""Views that fail, beside the real routes, for tests/core/test_middleware.py."""

from django.http import HttpRequest, HttpResponse
from django.urls import path

from atrium.urls import urlpatterns as real


def boom(request: HttpRequest) -> HttpResponse:
    body = request.body.decode()  # a local the debug page would show  # noqa: F841
    raise RuntimeError("boom " + request.GET.get("q", ""))


urlpatterns = [path("v1/boom", boom), path("console/boom", boom), *real]
