"""Every API error is JSON with a stable code, including the ones DRF and Django produce themselves."""

import pytest

from workers.models import WorkerStatus

from .factories import WorkerFactory

pytestmark = pytest.mark.django_db


def test_malformed_json_is_400_parse_error_and_creates_nothing(operator_client):
    response = operator_client.post(
        "/api/admin/workers", data='{"name": ', content_type="application/json"
    )
    assert response.status_code == 400
    assert response.json()["code"] == "parse_error"
    assert not WorkerFactory._meta.model.objects.exists()


@pytest.mark.parametrize("path", ["/api/nowhere", "/api/queue/not-a-job", "/api/admin/workers/w_missing"])
def test_unknown_api_paths_and_objects_are_json_404(operator_client, path):
    response = operator_client.get(path)
    assert response.status_code == 404
    assert response.json()["code"] == "not_found"


def test_unknown_worker_status_filter_is_refused(operator_client):
    response = operator_client.get("/api/admin/workers?status=idle,bogus")
    assert response.status_code == 400
    assert response.json()["code"] == "invalid_filter"


def test_disconnect_before_first_registration_is_accepted_and_keeps_connecting(worker_client):
    worker = WorkerFactory(fresh=True)
    response = worker_client(worker).post("/api/workers/disconnect", {})
    assert response.status_code == 200
    assert response.json()["status"] == WorkerStatus.CONNECTING
    worker.refresh_from_db()
    assert worker.status == WorkerStatus.CONNECTING
