"""Teams and limits over the API: who may do what (viewer, operator, admin), bad input, audit rows, deletion."""

import pytest
from rest_framework.test import APIClient

from audit import actions
from audit.models import AuditEvent
from job_queue.models import Job, JobStatus
from tenancy.models import Limits, Team
from workers.tests.factories import UserFactory, api_token

pytestmark = pytest.mark.django_db


def client_of(user):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_token(user)}")
    return client


@pytest.fixture
def people():
    return {
        role: UserFactory(username=role, groups=[role] if role != "root" else [], is_superuser=role == "root")
        for role in ("viewer", "operator", "admin", "root")
    }


def state():
    return {
        "teams": list(Team.objects.order_by("pk").values()),
        "members": list(Team.members.through.objects.order_by("pk").values()),
        "limits": list(Limits.objects.order_by("pk").values()),
        "audit": AuditEvent.objects.count(),
    }


def test_an_admin_creates_lists_reads_changes_and_deletes_a_team(people):
    admin = client_of(people["admin"])
    UserFactory(username="alice"), UserFactory(username="bob")

    created = admin.post("/api/admin/teams", {"name": "nlp", "members": ["alice", "bob"]}, format="json")
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["name"] == "nlp" and body["members"] == ["alice", "bob"]
    assert body["limits"] == {"max_running_jobs": None, "max_gpus": None, "gpu_hours_per_30_days": None}
    assert body["url"].endswith("/api/admin/teams/nlp")

    assert [t["name"] for t in admin.get("/api/admin/teams").json()["teams"]] == ["nlp"]
    patched = admin.patch("/api/admin/teams/nlp", {"members": ["bob"], "limits": {"max_gpus": 8}}, format="json")
    assert patched.status_code == 200, patched.content
    assert patched.json()["members"] == ["bob"] and patched.json()["limits"]["max_gpus"] == 8
    assert admin.get("/api/admin/teams/nlp").json()["limits"]["max_gpus"] == 8

    assert admin.delete("/api/admin/teams/nlp").status_code == 204
    assert not Team.objects.exists() and not Limits.objects.exists()
    done = list(AuditEvent.objects.filter(action__startswith="team.").values_list("action", flat=True).order_by("pk"))
    assert done == [actions.TEAM_CREATED, actions.TEAM_MEMBERS_CHANGED, actions.TEAM_DELETED]
    (limits_row,) = AuditEvent.objects.filter(action=actions.LIMITS_CHANGED)
    assert limits_row.details["after"]["max_gpus"] == 8 and limits_row.details["before"]["max_gpus"] is None
    assert limits_row.actor_name == "admin"


def test_a_team_with_a_queued_or_running_job_is_not_deleted(people):
    admin = client_of(people["admin"])
    team = Team.objects.create(name="vision")
    job = Job.objects.create(config_name="c", team=team, status=JobStatus.RUNNING)
    before = state()

    refused = admin.delete("/api/admin/teams/vision")

    assert refused.status_code == 409
    assert refused.json()["code"] == "team_in_use" and "1 queued or running" in refused.json()["detail"]
    assert state() == before
    Job.objects.filter(pk=job.pk).update(status=JobStatus.COMPLETED, finished_at="2026-01-01T00:00:00Z")
    assert admin.delete("/api/admin/teams/vision").status_code == 204
    assert Job.objects.get(pk=job.pk).team is None  # the finished job stays, without its team


@pytest.mark.parametrize(
    ("method", "url", "body"),
    [
        ("post", "/api/admin/teams", {"name": "x"}),
        ("patch", "/api/admin/teams/nlp", {"members": []}),
        ("delete", "/api/admin/teams/nlp", None),
        ("put", "/api/admin/limits", {"max_gpus": 1}),
        ("put", "/api/admin/teams/nlp/limits", {"max_gpus": 1}),
        ("put", "/api/admin/users/viewer/limits", {"max_gpus": 1}),
        ("patch", "/api/admin/teams/nlp", {"limits": {"max_gpus": 1}}),
    ],
)
def test_viewers_and_operators_may_not_change_teams_or_limits(people, method, url, body):
    Team.objects.create(name="nlp")
    for role in ("viewer", "operator"):
        before = state()
        response = getattr(client_of(people[role]), method)(url, body, format="json")
        assert response.status_code == 403, (role, response.content)
        assert response.json()["code"] == "permission_denied"
        assert state() == before


def test_everyone_reads_teams_and_the_global_limits(people):
    Team.objects.create(name="nlp")
    for role in ("viewer", "operator", "admin"):
        client = client_of(people[role])
        assert client.get("/api/admin/teams/nlp").status_code == 200
        assert client.get("/api/admin/limits").json() == {"max_running_jobs": None, "max_gpus": None, "gpu_hours_per_30_days": None}


def test_limits_at_three_levels_are_set_by_an_admin_and_a_superuser_and_audited(people):
    Team.objects.create(name="nlp")
    for role, figure in (("admin", 4), ("root", 5)):
        client = client_of(people[role])
        assert client.put("/api/admin/limits", {"max_running_jobs": figure}, format="json").json()["max_running_jobs"] == figure
        team = client.put("/api/admin/teams/nlp/limits", {"gpu_hours_per_30_days": 10.5, "max_gpus": figure}, format="json")
        assert team.status_code == 200 and team.json() == {"max_running_jobs": None, "max_gpus": figure, "gpu_hours_per_30_days": 10.5}
        user = client.put("/api/admin/users/viewer/limits", {"max_running_jobs": 1}, format="json")
        assert user.status_code == 200, user.content
    assert Limits.objects.count() == 3
    assert AuditEvent.objects.filter(action=actions.LIMITS_CHANGED).count() == 5  # the user's second PUT changed nothing
    # A PUT sets every field: one left out is no limit.
    client_of(people["admin"]).put("/api/admin/limits", {}, format="json")
    assert client_of(people["viewer"]).get("/api/admin/limits").json()["max_running_jobs"] is None


@pytest.mark.parametrize(
    ("method", "url", "body", "field", "status"),
    [
        ("put", "/api/admin/limits", {"max_gpus": -1}, "max_gpus", 400),
        ("put", "/api/admin/limits", {"max_gpus": 10**12}, "max_gpus", 400),
        ("put", "/api/admin/limits", {"max_gpus": "4"}, "max_gpus", 400),
        ("put", "/api/admin/limits", {"max_gpus": 1.5}, "max_gpus", 400),
        ("put", "/api/admin/limits", {"max_running_jobs": True}, "max_running_jobs", 400),
        ("put", "/api/admin/limits", {"gpu_hours_per_30_days": -0.5}, "gpu_hours_per_30_days", 400),
        ("put", "/api/admin/limits", {"gpu_hours_per_30_days": 1e300}, "gpu_hours_per_30_days", 400),
        ("put", "/api/admin/limits", {"max_gpu": 1}, "max_gpu", 400),
        ("put", "/api/admin/teams/ghost/limits", {"max_gpus": 1}, None, 404),
        ("put", "/api/admin/users/ghost/limits", {"max_gpus": 1}, None, 404),
        ("post", "/api/admin/teams", {"name": "nlp", "members": ["ghost"]}, "members", 404),
        ("post", "/api/admin/teams", {"name": "bad name!", "members": []}, "name", 400),
        ("post", "/api/admin/teams", {"name": 5}, "name", 400),
        ("post", "/api/admin/teams", {"name": "new", "members": "alice"}, "members", 400),
        ("post", "/api/admin/teams", {"name": "taken"}, None, 409),
        ("patch", "/api/admin/teams/taken", {"limits": {"max_gpus": -3}}, "limits", 400),
        ("patch", "/api/admin/teams/taken", {"limits": {"bogus": 1}}, "limits", 400),
        ("patch", "/api/admin/teams/taken", {"members": ["ghost"], "limits": {"max_gpus": 2}}, "members", 404),
        ("patch", "/api/admin/teams/ghost", {"members": []}, None, 404),
        ("delete", "/api/admin/teams/ghost", None, None, 404),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field_and_changes_nothing(people, method, url, body, field, status):
    Team.objects.create(name="taken")
    before = state()

    response = getattr(client_of(people["admin"]), method)(url, body, format="json")

    assert response.status_code == status, response.content
    answer = response.json()
    assert answer["code"] and answer["detail"]
    if field:
        assert field in answer["errors"], answer
    assert state() == before
