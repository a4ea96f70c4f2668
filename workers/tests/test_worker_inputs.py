"""Issue 12, findings 1, 2 and 5 on the workers' endpoints: what an agent or an operator sends about a worker is bounded.

Names, GPU names, ``gpu_info`` (the upstream agent's) and heartbeat metrics with a NUL, numbers past
a column's range, a 2 MB ``gpu_info`` and labels without limits were accepted or crashed with 500 on
PostgreSQL. Each is now a 400 naming the field, and nothing is written.
"""

import json

import pytest

from audit import actions
from workers.models import Token, TokenKind, Worker, WorkerStatus
from workers.tests.factories import WorkerFactory
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

REGISTER = "/api/workers/register"
HEARTBEAT = "/api/workers/heartbeat"
WORKERS = "/api/admin/workers"


def _reload(obj):
    obj.refresh_from_db()
    return obj


def _post_raw(client, path, body):
    return client.post(path, data=json.dumps(body) if not isinstance(body, str) else body, content_type="application/json")


# --- register ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "gpu\x00"}, "name"),
        ({"gpu_name": "A100\x00"}, "gpu_name"),
        ({"hostname": "\ud800"}, "hostname"),
        ({"accelerator_type": "cu\x00da"}, "accelerator_type"),
        ({"driver_version": "5" * 65}, "driver_version"),
        ({"gpu_info": {"name": "A100\x00", "count": 1}}, "gpu_info"),
        ({"gpu_info": {"count": 1, "ex\x00tra": True}}, "gpu_info"),
        ({"gpus": [{"name": "\x00"}]}, "gpus"),
        ({"gpu_count": 2**31}, "gpu_count"),
        ({"gpu_count": 10**30}, "gpu_count"),
        ({"gpu_count": 1025}, "gpu_count"),
        ({"gpu_vram_gb": 1e300}, "gpu_vram_gb"),
        ({"gpu_info": {"blob": "x" * 70_000}}, "gpu_info"),  # over the 64 KiB MAX_GPU_INFO_BYTES
    ],
)
def test_register_with_unstorable_or_unbounded_fields_is_400_naming_the_field(worker_client, body, field):
    worker = WorkerFactory(fresh=True)

    response = _post_raw(worker_client(worker), REGISTER, body)

    assert response.status_code == 400, response.content
    assert (response.json()["code"], list(response.json()["errors"])) == ("invalid", [field])
    assert _reload(worker).status == WorkerStatus.CONNECTING
    assert audit_rows(actions.WORKER_REGISTERED) == []


@pytest.mark.parametrize(
    ("gpu_info", "field"),
    [({"count": 2**31}, "gpu_info.count"), ({"count": 1e30}, "gpu_info.count"), ({"vram_gb": 10**30}, "gpu_info.vram_gb")],
)
def test_register_with_nested_gpu_info_numbers_out_of_range_is_400_naming_them(worker_client, gpu_info, field):
    worker = WorkerFactory(fresh=True)

    response = _post_raw(worker_client(worker), REGISTER, {"gpu_info": gpu_info})

    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid_capabilities"
    assert response.json()["detail"].startswith(f"{field} must be a number from 0 to ")
    assert _reload(worker).connected_at is None


def test_register_at_the_limits_is_accepted(worker_client):
    worker = WorkerFactory(fresh=True)
    body = {"name": worker.name, "gpu_info": {"name": "G" * 200, "count": 1024, "vram_gb": 192.0, "extra": "x" * 60_000}}

    response = _post_raw(worker_client(worker), REGISTER, body)

    assert response.status_code == 200, response.content
    worker = _reload(worker)
    assert (worker.gpu_count, worker.gpu_name) == (1024, "G" * 200)


def test_refused_registration_with_a_nul_name_is_refused_and_audited_without_it(api_client):
    """A refused token is audited as a failed authentication (address, path, token prefix): the body's
    name, NUL included, is never read into the audit row."""
    response = _post_raw(api_client, REGISTER, {"name": "evil\x00name"})

    assert response.status_code == 401
    (refused,) = audit_rows(actions.AUTH_FAILED)
    assert "evil" not in json.dumps(refused.details) + refused.actor_name


# --- heartbeat ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"gpu_utilization": ["9\x00"]}, "gpu_utilization"),
        ({"gpus": [{"name\x00": 1}]}, "gpus"),
        ({"load_average": [1.0, "NaN"]}, None),  # a string is fine: it is not a number
        ({"cpu_percent": "nan"}, "cpu_percent"),
        ({"cpu_percent": 1e308 * 10}, "cpu_percent"),
        ('{"memory_percent": 1' + "0" * 400 + "}", "memory_percent"),  # an integer too large for a float
        ({"status": "idle\x00"}, "status"),
        ({"gpus": ["x" * 70_000]}, "gpus"),
    ],
)
def test_heartbeat_metrics_are_bounded(worker_client, body, field):
    worker = WorkerFactory()

    response = _post_raw(worker_client(worker), HEARTBEAT, body)

    if field is None:
        assert response.status_code == 200, response.content
        return
    assert response.status_code == 400, response.content
    assert list(response.json()["errors"]) == [field]


# --- an operator creating a worker --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"name": "w\x00"}, "invalid"),
        ({"name": "w" * 129}, "invalid"),
        ({"name": "w", "labels": {"gpu\x00": "a100"}}, "invalid"),
        ({"name": "w", "labels": {"gpu": "a\x00"}}, "invalid"),
        ({"name": "w", "labels": {"gpu type": "a100"}}, "invalid_labels"),
        ({"name": "w", "labels": {"gpu": "\x1b[31ma100"}}, "invalid_labels"),
        ({"name": "w", "labels": {f"l{i}": "v" for i in range(33)}}, "invalid_labels"),
        ({"name": "w", "labels": {"gpu": "v" * 201}}, "invalid_labels"),
        ({"name": "w", "labels": {"gpu": {"nested": 1}}}, "invalid_labels"),
    ],
)
def test_create_worker_with_unstorable_or_unbounded_input_is_400(operator_client, body, code):
    response = _post_raw(operator_client, WORKERS, body)

    assert response.status_code == 400, response.content
    assert response.json()["code"] == code
    if code == "invalid":
        assert list(response.json()["errors"]) in (["name"], ["labels"])
    else:
        assert response.json()["detail"].startswith("labels: ")
    assert Worker.objects.count() == 0
    assert Token.objects.filter(kind=TokenKind.WORKER).count() == 0
    assert audit_rows() == []


def test_create_worker_labels_at_the_limits(operator_client):
    labels = {f"team.{i}/x-y_z": "v" * 200 for i in range(30)}  # 32 with the two below

    response = _post_raw(operator_client, WORKERS, {"name": "w", "labels": {**labels, "gpus": 8, "spot": True}})

    assert response.status_code == 201, response.content
    assert Worker.objects.get().labels == {**labels, "gpus": "8", "spot": "true"}


def test_create_worker_command_refuses_bad_labels_and_long_names(capsys):
    from django.core.management import CommandError, call_command

    with pytest.raises(CommandError, match="labels: label name 'a b'"):
        call_command("create_worker", "w1", "--label", "a b=x")
    with pytest.raises(CommandError, match="name is 129 characters; at most 128"):
        call_command("create_worker", "w" * 129)
    assert Worker.objects.count() == 0
