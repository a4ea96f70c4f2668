"""The OpenAPI schema (/api/schema/) and Swagger UI (/api/docs/): valid, complete, served without a CDN."""

import re

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from drf_spectacular.validation import validate_schema

from workers.tests.factories import UserFactory

pytestmark = pytest.mark.django_db

SELF_ROUTES = {"/api/schema", "/api/docs"}


def _normalise(route):
    """Turn a joined Django route (path converters or regex) into an OpenAPI-style path without trailing slash."""
    route = route.replace("^", "").replace("$", "").replace("/?", "")
    route = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", route)
    route = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)
    return "/" + route.strip("/")


def _api_routes(patterns=None, prefix=""):
    """Yield every routed path under /api/, normalised."""
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        route = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            yield from _api_routes(entry.url_patterns, route)
        elif isinstance(entry, URLPattern):
            path = _normalise(route)
            if path.startswith("/api/"):
                yield path


@pytest.fixture
def schema(operator_client):
    response = operator_client.get("/api/schema/", {"format": "json"})
    assert response.status_code == 200, response.content
    return response.json()


def test_schema_is_openapi_3_and_validates(schema):
    assert schema["openapi"].startswith("3.")
    assert schema["info"]["title"] == "SimpleTuner orchestrator API"
    validate_schema(schema)


def test_schema_is_also_served_as_yaml(operator_client):
    response = operator_client.get("/api/schema/")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/vnd.oai.openapi")
    assert response.content.startswith(b"openapi: 3.")


def test_schema_needs_an_authenticated_operator(api_client):
    response = api_client.get("/api/schema/", {"format": "json"})
    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"


def test_generation_has_no_warnings_or_errors():
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", "/dev/null")


def test_every_api_route_is_in_the_schema(schema):
    documented = {path.rstrip("/") for path in schema["paths"]}
    routed = set(_api_routes()) - SELF_ROUTES
    assert routed, "the URL walk found no /api/ routes"
    assert routed - documented == set()
    assert documented - routed == set()


def test_every_operation_documents_responses_and_errors(schema):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert any(code.startswith("2") for code in responses), (method, path)
            assert "401" in responses, (method, path)
            for code, response in responses.items():
                if code.startswith(("4", "5")):
                    body = response["content"]["application/json"]["schema"]
                    assert body == {"$ref": "#/components/schemas/Error"}, (method, path, code)
            if method in {"post", "put", "patch"} and "requestBody" in operation:
                assert operation["requestBody"]["content"], (method, path)


def test_error_component_and_security_schemes(schema):
    components = schema["components"]
    assert set(components["schemas"]["Error"]["required"]) == {"code", "detail"}
    assert components["securitySchemes"]["operatorToken"] == {
        "type": "http",
        "scheme": "bearer",
        "description": components["securitySchemes"]["operatorToken"]["description"],
    }
    worker_scheme = components["securitySchemes"]["workerToken"]
    assert (worker_scheme["type"], worker_scheme["in"], worker_scheme["name"]) == ("apiKey", "header", "X-Worker-Token")
    assert schema["paths"]["/api/workers/register/"]["post"]["security"] == [{"workerToken": []}]
    assert {"operatorToken": []} in schema["paths"]["/api/queue/submit/"]["post"]["security"]


def test_the_stream_is_documented_as_server_sent_events(schema):
    operation = schema["paths"]["/api/workers/stream"]["get"]
    assert "text/event-stream" in operation["responses"]["200"]["content"]
    assert operation["security"] == [{"workerToken": []}]


def test_swagger_ui_renders_with_local_assets():
    client = Client()
    client.force_login(UserFactory())
    response = client.get("/api/docs/")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html")
    html = response.content.decode()
    assert "/api/schema/" in html
    assets = re.findall(r'(?:src|href)="([^"]+swagger-ui[^"]*)"', html)
    assert assets and all(url.startswith("/static/drf_spectacular_sidecar/") for url in assets), assets
    assert not re.search(r"https?://(cdn\.jsdelivr\.net|unpkg\.com|cdnjs)", html)
    asset = client.get(next(url for url in assets if url.endswith(".js")))
    assert asset.status_code == 200
