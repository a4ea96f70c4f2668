"""A priority above 0 needs its own permission: operators up to the ceiling (100), admins any (up to 1000)."""

import pytest
from django.urls import reverse

from job_queue.models import Job
from tenancy.permissions import OPERATOR_PRIORITY_CEILING
from workers.tests.factories import UserFactory

from .test_teams_api import client_of

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("who", "priority", "status"),
    [
        ("submitter", 0, 201),
        ("submitter", -5, 201),
        ("submitter", 1, 403),
        ("operator", OPERATOR_PRIORITY_CEILING, 201),
        ("operator", OPERATOR_PRIORITY_CEILING + 1, 403),
        ("admin", 1000, 201),
        ("superuser", 1000, 201),
    ],
)
def test_a_priority_above_0_needs_its_permission(who, priority, status):
    user = {
        "submitter": lambda: UserFactory(permissions=["queue.submit_job"]),
        "operator": lambda: UserFactory(groups=["operator"]),
        "admin": lambda: UserFactory(groups=["admin"]),
        "superuser": lambda: UserFactory(is_superuser=True),
    }[who]()

    response = client_of(user).post("/api/queue/submit", {"config_name": "c", "priority": priority}, format="json")

    assert response.status_code == status, response.content
    if status == 403:
        assert response.json()["code"] == "permission_denied" and "tenancy.prioritize_jobs" in response.json()["detail"]
        assert not Job.objects.exists()
    else:
        assert Job.objects.get().priority == priority


def test_the_admins_submit_form_refuses_a_priority_beyond_the_operators_ceiling(client):
    client.force_login(UserFactory(is_staff=True, groups=["operator"]))

    response = client.post(
        reverse("admin:queue_job_add"), {"config_name": "c", "config": "{}", "target": "worker", "priority": "500", "max_retries": "3"}
    )

    assert response.status_code == 200
    assert "tenancy.prioritize_jobs_any" in response.content.decode()
    assert not Job.objects.exists()
