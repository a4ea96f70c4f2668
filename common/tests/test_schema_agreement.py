"""The server takes what its OpenAPI schema says, and nothing it says is an error (issue 12, schemathesis).

Each case here is one schemathesis found: DRF coerced a value of another JSON type (0 for a name, "5"
for a number, 0 for a boolean), pagination ignored a parameter that was not an integer, a nullable
field was declared where the server refuses null, a 405 had no ``Allow`` header, and the schema did
not say which label names, statuses and date-times are taken. ``tests/e2e/test_schemathesis.py`` runs
the tool itself; these pin the rules it checked.
"""

import pytest

from common.fields import BoundedInt, BoundedText, StrictBoolean
from job_queue.models import Job
from workers.models import Worker
from workers.tests.factories import WorkerFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def schema():
    from drf_spectacular.generators import SchemaGenerator

    return SchemaGenerator().get_schema(request=None, public=True)


# --- strict JSON types ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "taken"),
    [
        (BoundedText(max_length=10), "abc", True),
        (BoundedText(max_length=10), 0, False),
        (BoundedText(max_length=10), ["a"], False),
        (BoundedInt(min_value=0, max_value=10), 5, True),
        (BoundedInt(min_value=0, max_value=10), 5.0, True),
        (BoundedInt(min_value=0, max_value=10), "5", False),
        (BoundedInt(min_value=0, max_value=10), 5.5, False),
        (BoundedInt(min_value=0, max_value=10), True, False),
        (StrictBoolean(), True, True),
        (StrictBoolean(), 0, False),
        (StrictBoolean(), "true", False),
    ],
)
def test_fields_take_only_their_own_json_type(field, value, taken):
    from rest_framework import serializers

    if taken:
        field.run_validation(value)
    else:
        with pytest.raises(serializers.ValidationError):
            field.run_validation(value)


def test_a_worker_name_that_is_a_number_is_refused_and_nothing_is_created(operator_client):
    response = operator_client.post("/api/admin/workers", {"name": 0}, format="json")

    assert response.status_code == 400, response.content
    assert response.json()["errors"]["name"] == ["Must be a string."]
    assert not Worker.objects.exists()


def test_retry_on_failure_must_be_a_boolean(operator_client):
    response = operator_client.post("/api/queue/submit", {"config_name": "x", "retry_on_failure": 0}, format="json")

    assert response.status_code == 400, response.content
    assert "retry_on_failure" in response.json()["errors"]
    assert not Job.objects.exists()


@pytest.mark.parametrize("labels", [{"gpu": "a100\n"}, {"gpu": "ä100"}, {"gpu\n": "a100"}])
def test_label_values_are_printable_ascii_and_names_end_where_they_end(operator_client, labels):
    response = operator_client.post("/api/admin/workers", {"name": "w", "labels": labels}, format="json")

    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid_labels"


# --- query parameters ----------------------------------------------------------------------------


@pytest.mark.parametrize("query", ["offset=null", "limit=", "limit=0", "offset=-1", "limit=1.5", "offset=%00"])
def test_pagination_parameters_that_are_not_integers_are_a_400(operator_client, query):
    response = operator_client.get(f"/api/queue/?{query}")

    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid_filter"


def test_an_empty_status_filter_is_no_filter(operator_client):
    WorkerFactory()

    response = operator_client.get("/api/admin/workers?status=")

    assert response.status_code == 200
    assert len(response.json()["workers"]) == 1


@pytest.mark.parametrize("value", ["", "2026-01-01", "2026-01-01T10:00:00", "2026-02-30T10:00:00Z", "x"])
def test_audit_dates_are_rfc3339_date_times(operator_client, value):
    response = operator_client.get("/api/audit/", {"since": value})

    assert response.status_code == 400, response.content


@pytest.mark.parametrize("value", ["2026-01-01T10:00:00Z", "2026-01-01t10:00:00.5+02:00"])
def test_audit_takes_an_rfc3339_date_time(operator_client, value):
    response = operator_client.get("/api/audit/", {"since": value})

    assert response.status_code == 200, response.content


@pytest.mark.parametrize("value", ["True", "1", ""])
def test_audit_success_is_true_or_false(operator_client, value):
    assert operator_client.get("/api/audit/", {"success": value}).status_code == 400


# --- what the schema declares --------------------------------------------------------------------


def test_the_schema_is_openapi_3_1_and_declares_label_names(schema):
    labels = schema["components"]["schemas"]["WorkerCreateRequest"]["properties"]["labels"]

    assert schema["openapi"].startswith("3.1")
    assert labels["propertyNames"]["pattern"].startswith("^[A-Za-z0-9_]")
    assert labels["additionalProperties"]["oneOf"][0]["pattern"] == "^[ -~]*$"


def test_fields_the_server_refuses_as_null_are_not_nullable(schema):
    submit = schema["components"]["schemas"]["JobSubmitRequest"]["properties"]

    assert submit["config"]["type"] == "object"
    assert submit["worker_labels"]["type"] == "object"
    assert {"type": "null"} in submit["dataloader"]["anyOf"]


def test_no_schema_says_any_value_or_null_in_a_way_nothing_satisfies(schema):
    text = str(schema)

    assert "'oneOf': [{}, {'type': 'null'}]" not in text
    assert "'null', 'null'" not in text


def test_the_stream_405_names_the_method_it_takes(worker_client):
    response = worker_client(WorkerFactory()).post("/api/workers/stream")

    assert response.status_code == 405
    assert response["Allow"] == "GET"
    assert response.json()["code"] == "method_not_allowed"
