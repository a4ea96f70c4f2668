"""URL routes: worker protocol, admin workers API, queue API, audit API, OpenAPI schema and docs, metrics, Django admin,
and for browsers the landing page at / and the favicon."""

from django.contrib import admin
from django.contrib.auth.views import redirect_to_login
from django.urls import include, path, re_path, reverse
from drf_spectacular.utils import extend_schema
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.exceptions import NotAuthenticated

from common.http import ARTIFACTS_API_PREFIX
from observability.metrics import MetricsView
from observability.usage import UsageView
from training_configs.api.views import ConfigDetailView, ConfigListView

from .landing import favicon, landing
from .login import API_AUTH_URLS



class ApiDocsView(SpectacularSwaggerView):
    """The API's documentation page: a signed-out browser is sent to sign in, then back here (another
    client, which asks for no HTML, gets the API's 401)."""

    def handle_exception(self, exc):
        if isinstance(exc, NotAuthenticated) and "text/html" in self.request.headers.get("Accept", ""):
            return redirect_to_login(self.request.get_full_path(), reverse("rest_framework:login"))
        return super().handle_exception(exc)


def _alias(view):
    """``view`` under a second address, left out of the schema (which lists its first one)."""
    return extend_schema(exclude=True)(type(f"{view.__name__}Alias", (view,), {})).as_view()


urlpatterns = [
    # The streams before admin/: the admin's catch-all would otherwise answer the change feed.
    path("", include("realtime.urls")),
    path("admin/", admin.site.urls),
    path("", include("job_queue.api.agent_urls")),
    path("api/admin/workers", include("job_queue.api.fleet_urls")),
    path("api/admin/workers", include("workers.api.admin_urls")),
    path("api/admin/webhooks", include("webhooks.api.urls")),
    path("api/admin/", include("tenancy.api.urls")),
    path("api/queue/", include("job_queue.api.urls")),
    path(ARTIFACTS_API_PREFIX.lstrip("/"), include("artifacts.api.urls")),
    path("api/configs", include("training_configs.api.urls")),
    # With a trailing slash too, as /api/queue/ and /api/admin/workers/ answer.
    path("api/configs/", _alias(ConfigListView), name="config-list-slash"),
    re_path(r"^api/configs/(?P<name>[^/]+)/$", _alias(ConfigDetailView), name="config-detail-slash"),
    path("api/audit/", include("audit.api.urls")),
    path("api/usage", UsageView.as_view(), name="usage"),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", ApiDocsView.as_view(url_name="api-schema"), name="api-docs"),
    # The browsable API's sign-in (throttled: simpletuner_site.login) and sign-out, in DRF's namespace.
    path("api-auth/", include((API_AUTH_URLS, "rest_framework"))),
    path("metrics", MetricsView.as_view(), name="metrics"),
    path("favicon.ico", favicon, name="favicon"),
    path("", landing, name="landing"),
]

handler404 = "common.http.not_found"
