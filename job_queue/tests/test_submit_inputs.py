"""Issue 12, findings 1, 2 and 5 on the operators' queue API: bad input is a 400 naming the field, never a 500.

NUL characters and unpaired surrogates anywhere in a submission (its name, its config's keys and
values, its dataloader, its label selectors) cannot be stored in PostgreSQL; integers past a column's
range overflowed it; ``num_processes`` in a config escaped the 1024-GPU cap; ``?limit=2**63`` crashed
a list. Each is refused (or, for pagination, clamped) and nothing is written.
"""

import json
import time

import pytest

from common.errors import InvalidInput
from job_queue.models import Job
from job_queue.services import required_gpus
from job_queue.tests.factories import JobFactory
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

SUBMIT = "/api/queue/submit"
LIST = "/api/queue/"


def _submit_raw(client, text):
    return client.post(SUBMIT, data=text, content_type="application/json")


def _refused(response, field, code="invalid"):
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["code"] == code, body
    if code == "invalid":
        assert list(body["errors"]) == [field], body
    else:
        assert body["detail"].startswith(field), body
    assert Job.objects.count() == 0
    assert audit_rows() == []
    return body


# --- finding 1: text that cannot be stored -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("submission", "field", "where"),
    [
        ({"config_name": "a\x00b"}, "config_name", "Null characters are not allowed."),
        ({"config_name": "a\ud800b"}, "config_name", "Surrogate characters are not allowed"),
        ({"config_name": "c", "config": {"lr\x00": 1}}, "config", "lr\ufffd: the key contains a NUL character"),
        ({"config_name": "c", "config": {"model": {"name": "x\x00"}}}, "config", "model.name: contains a NUL character"),
        ({"config_name": "c", "config": {"layers": [1, "\udc80"]}}, "config", "layers[1]: contains an unpaired surrogate"),
        ({"config_name": "c", "dataloader": [{"id": "p\x00"}]}, "dataloader", "[0].id: contains a NUL character"),
        ({"config_name": "c", "worker_labels": {"gpu\x00": "a100"}}, "worker_labels", "the key contains a NUL character"),
        ({"config_name": "c", "worker_labels": {"gpu": "a1\x0000"}}, "worker_labels", "gpu: contains a NUL character"),
        ({"config_name": "c", "config": {"lr": float("nan")}}, "config", "lr: nan is not a number JSON can hold"),
        ({"config_name": "c", "config": {"lr": float("inf")}}, "config", "lr: inf is not a number JSON can hold"),
    ],
)
def test_unstorable_text_or_numbers_in_a_submission_are_400_naming_the_field(operator_client, submission, field, where):
    body = _refused(_submit_raw(operator_client, json.dumps(submission)), field)

    assert any(where in message for message in body["errors"][field]), body


def test_1e400_in_a_config_is_refused_not_stored_as_infinity(operator_client):
    body = _refused(_submit_raw(operator_client, '{"config_name": "c", "config": {"lr": 1e400}}'), "config")

    assert body["errors"]["config"] == ["lr: inf is not a number JSON can hold"]


@pytest.mark.parametrize(
    "selectors",
    [
        {"": "a100"},
        {"gpu type": "a100"},
        {"k" * 64: "a100"},
        {"gpu": "a" * 201},
        {"gpu": "a\n100"},
        {f"label{i}": "*" for i in range(33)},
        {"gpu": ["a100"]},
    ],
)
def test_label_selectors_are_bounded_in_count_syntax_and_length(operator_client, selectors):
    _refused(_submit_raw(operator_client, json.dumps({"config_name": "c", "worker_labels": selectors})), "worker_labels", "invalid_labels")


def test_ten_thousand_globs_are_refused_at_once(operator_client):
    started = time.monotonic()

    _refused(operator_client.post(SUBMIT, {"config_name": "c", "worker_labels": {f"k{i}": "*a*b*c*" for i in range(10_000)}}), "worker_labels", "invalid_labels")

    assert time.monotonic() - started < 1.0


def test_selectors_within_the_limits_are_accepted(operator_client):
    selectors = {f"k-{i}.x/y_z": "a" * 200 for i in range(32)}

    response = operator_client.post(SUBMIT, {"config_name": "c", "worker_labels": {**selectors, "k-0.x/y_z": 100}})

    assert response.status_code == 201, response.content
    assert Job.objects.get().worker_labels == {**selectors, "k-0.x/y_z": "100"}


# --- finding 2: integers out of range ------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["gpu_count", "priority", "max_retries"])
@pytest.mark.parametrize("value", [2**31, 2**63, 10**30, -(2**63) - 1, "1e400", 1e30])
def test_integers_out_of_range_are_400_naming_the_field(operator_client, field, value):
    _refused(operator_client.post(SUBMIT, {"config_name": "c", field: value}), field)


@pytest.mark.parametrize("num_processes", [1025, 2**31, 10**30, 1e30])
def test_num_processes_in_the_config_keeps_to_the_gpu_cap(operator_client, num_processes):
    body = _refused(operator_client.post(SUBMIT, {"config_name": "c", "config": {"--num_processes": num_processes}}), "config", "invalid_config")

    assert body["detail"] == f"config --num_processes must be from 0 to 1024, got {int(num_processes)}"


@pytest.mark.parametrize("num_processes", [float("inf"), float("nan"), "1e400", [2]])
def test_num_processes_that_is_no_integer_is_refused(num_processes):
    # Infinity is not JSON: only an in-process caller (a form, a command) could pass it to the service.
    with pytest.raises(InvalidInput) as refused:
        required_gpus(gpu_count=None, config={"num_processes": num_processes})

    assert refused.value.code == "invalid_config"
    assert refused.value.detail.startswith("config num_processes must be an integer, got ")


def test_num_processes_at_the_cap_is_accepted(operator_client):
    response = operator_client.post(SUBMIT, {"config_name": "c", "config": {"num_processes": 1024}})

    assert response.status_code == 201, response.content
    assert Job.objects.get().gpu_count == 1024


# --- lists: pagination and filters ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "count"),
    [
        (f"limit={2**63}", 3),
        (f"limit={10**30}", 3),
        (f"limit={'9' * 5000}", 3),  # past Python's digit limit: still clamped to the page cap
        (f"offset={2**63}", 0),
        (f"limit={2**63}&offset={2**63}", 0),
        ("limit=2&offset=1", 2),
    ],
)
def test_huge_limit_and_offset_are_clamped(operator_client, query, count):
    JobFactory.create_batch(3)

    response = operator_client.get(f"{LIST}?{query}")

    assert response.status_code == 200, response.content
    assert (response.json()["count"], len(response.json()["results"])) == (3, count)


def test_a_limit_over_the_page_cap_returns_at_most_1000(operator_client):
    Job.objects.bulk_create(JobFactory.build_batch(1001))

    response = operator_client.get(f"{LIST}?limit={2**63}")

    assert len(response.json()["results"]) == 1000


@pytest.mark.parametrize("query", ["worker=%00", "worker=w%00x", "status=queued%00", "worker=" + "w" * 201])
def test_unstorable_filters_are_400(operator_client, query):
    response = operator_client.get(f"{LIST}?{query}")

    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid_filter"
