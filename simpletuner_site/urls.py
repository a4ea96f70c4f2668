"""URL routes: worker protocol, admin workers API, queue API, audit API, OpenAPI schema and docs, metrics, Django admin,
and for browsers the landing page at / and the favicon."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from common.http import ARTIFACTS_API_PREFIX
from observability.metrics import MetricsView

from .landing import favicon, landing
from .login import API_AUTH_URLS

urlpatterns = [
    # The streams before admin/: the admin's catch-all would otherwise answer the change feed.
    path("", include("realtime.urls")),
    path("admin/", admin.site.urls),
    path("", include("job_queue.api.agent_urls")),
    path("api/admin/workers", include("job_queue.api.fleet_urls")),
    path("api/admin/workers", include("workers.api.admin_urls")),
    path("api/queue/", include("job_queue.api.urls")),
    path(ARTIFACTS_API_PREFIX.lstrip("/"), include("artifacts.api.urls")),
    path("api/configs", include("training_configs.api.urls")),
    path("api/audit/", include("audit.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    # The browsable API's sign-in (throttled: simpletuner_site.login) and sign-out, in DRF's namespace.
    path("api-auth/", include((API_AUTH_URLS, "rest_framework"))),
    path("metrics", MetricsView.as_view(), name="metrics"),
    path("favicon.ico", favicon, name="favicon"),
    path("", landing, name="landing"),
]

handler404 = "common.http.not_found"
