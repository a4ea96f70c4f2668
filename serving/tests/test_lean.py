"""The heads the fast paths answer with are the ones Django's middleware gives the same request, on every fast route,
under every setting the security headers depend on (``serving.lean.security_headers``)."""

import pytest
from django.test import override_settings

from serving.asgi import FastPathsASGIHandler, PooledASGIHandler, StreamASGIHandler
from serving.tests.test_heartbeat import _post, _worker
from serving.tests.test_streams import TOKEN, open_and_close, scope_of
from worker_agent import protocol
from workers.tests.factories import WorkerFactory, worker_token

pytestmark = pytest.mark.django_db(transaction=True)

PROXY = ("HTTP_X_FORWARDED_PROTO", "https")

SETTINGS = {
    "defaults": {},
    "HSTS with subdomains and preload": {"SECURE_HSTS_SECONDS": 60, "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
                                         "SECURE_HSTS_PRELOAD": True},
    "HSTS alone": {"SECURE_HSTS_SECONDS": 3600, "SECURE_HSTS_INCLUDE_SUBDOMAINS": False, "SECURE_HSTS_PRELOAD": False},
    "no nosniff, no referrer policy, no COOP": {"SECURE_CONTENT_TYPE_NOSNIFF": False, "SECURE_REFERRER_POLICY": None,
                                                "SECURE_CROSS_ORIGIN_OPENER_POLICY": None},
    "a referrer policy list": {"SECURE_REFERRER_POLICY": ["origin", "strict-origin"]},
    "framing same origin": {"X_FRAME_OPTIONS": "sameorigin", "SECURE_CROSS_ORIGIN_OPENER_POLICY": "same-origin-allow-popups"},
    "behind a TLS proxy": {"SECURE_PROXY_SSL_HEADER": PROXY, "SECURE_HSTS_SECONDS": 3600},
    "an HTTPS redirect": {"SECURE_SSL_REDIRECT": True},
}  # fmt: skip
REQUESTS = {
    "plain http": [],
    "https through the proxy": [(b"x-forwarded-proto", b"https")],
    "http through the proxy": [(b"x-forwarded-proto", b"http")],
}


@pytest.mark.parametrize("request_case", list(REQUESTS))
@pytest.mark.parametrize("settings_case", list(SETTINGS))
def test_a_heartbeats_head_is_the_middlewares(settings_case, request_case):
    from asgiref.sync import async_to_sync

    worker = _worker()
    token = worker_token(worker)
    body = {"worker_id": worker.pk, "status": "idle"}
    with override_settings(**SETTINGS[settings_case]):  # the middleware reads its settings when built
        fast = async_to_sync(_post)(FastPathsASGIHandler(), body, token=token, headers=REQUESTS[request_case])
        plain = async_to_sync(_post)(PooledASGIHandler(), body, token=token, headers=REQUESTS[request_case])
    assert fast == plain


@pytest.mark.parametrize("request_case", list(REQUESTS))
@pytest.mark.parametrize("settings_case", list(SETTINGS))
def test_a_worker_streams_head_is_the_middlewares(settings_case, request_case):
    worker = WorkerFactory()
    scope = scope_of(headers=[(TOKEN, worker_token(worker).encode()), *REQUESTS[request_case]])
    with override_settings(**SETTINGS[settings_case]):
        fast = open_and_close(FastPathsASGIHandler(), scope)
        plain = open_and_close(StreamASGIHandler(), scope)
    assert fast == plain


def test_the_fast_routes_are_the_heartbeat_and_the_worker_stream():
    """The two routes above are every route a fast path answers below Django's middleware."""
    app = FastPathsASGIHandler()
    routes = {(method, path) for method in ("GET", "POST", "PUT") for path in protocol.__dict__.values()
              if isinstance(path, str) and path.startswith("/")
              for scope in [scope_of(method, path=path)]
              if app.heartbeats.handles(scope) or app.worker_streams.handles(scope)}  # fmt: skip
    assert routes == {("POST", protocol.HEARTBEAT_PATH), ("GET", protocol.STREAM_PATH)}
