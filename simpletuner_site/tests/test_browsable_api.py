"""The DRF browsable API renders the operator endpoints for a user signed in with a session."""

import pytest
from django.contrib.auth import get_user_model

from job_queue.tests.factories import JobFactory
from workers.tests.factories import WorkerFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def session_client(client):
    client.force_login(get_user_model().objects.create_superuser("ops", "ops@example.com", "pw"))
    return client


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        ("/api/queue/", "visible-config"),
        ("/api/queue/{job}", "visible-config"),
        ("/api/admin/workers", "visible-worker"),
        ("/api/admin/workers/{worker}", "visible-worker"),
        ("/api/audit/", "Audit Event List"),
    ],
)
def test_operator_endpoints_render_as_html_with_a_session(session_client, path, shown):
    job, worker = JobFactory(config_name="visible-config"), WorkerFactory(name="visible-worker")

    response = session_client.get(path.format(job=job.pk, worker=worker.pk), HTTP_ACCEPT="text/html")

    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html")
    body = response.content.decode()
    assert "Django REST framework" in body
    assert shown in body


def test_the_browsable_api_needs_a_login(client):
    response = client.get("/api/queue/", HTTP_ACCEPT="text/html")

    assert response.status_code in (401, 403)
