"""A job is charged to a team: the submitter's one team by default, a named team only for its members."""

from io import StringIO

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from job_queue.models import Job
from tenancy.models import Team
from workers.tests.factories import UserFactory

from .test_teams_api import client_of

pytestmark = pytest.mark.django_db


def team(name, *members):
    created = Team.objects.create(name=name)
    created.members.set(members)
    return created


def submit(user, **body):
    return client_of(user).post("/api/queue/submit", {"config_name": "c", **body}, format="json")


def test_a_user_in_one_team_is_charged_to_it_and_the_job_shows_team_and_submitter():
    alice = UserFactory(username="alice", groups=["operator"])
    team("nlp", alice)

    response = submit(alice)

    assert response.status_code == 201, response.content
    assert (response.json()["team"], response.json()["submitted_by"]) == ("nlp", "alice")
    job = Job.objects.get()
    assert job.team.name == "nlp" and job.submitted_by == alice
    viewer = client_of(UserFactory(groups=["viewer"]))
    assert viewer.get(f"/api/queue/{job.pk}").json()["team"] == "nlp"
    assert viewer.get("/api/queue/").json()["results"][0]["team"] == "nlp"


def test_a_user_in_no_team_submits_without_one():
    response = submit(UserFactory(groups=["operator"]))

    assert response.status_code == 201 and response.json()["team"] is None


def test_a_user_in_several_teams_must_name_one():
    bob = UserFactory(username="bob", groups=["operator"])
    team("vision", bob), team("nlp", bob)

    refused = submit(bob)

    assert refused.status_code == 400
    assert refused.json()["code"] == "team_required" and refused.json()["teams"] == ["nlp", "vision"]
    assert not Job.objects.exists()
    named = submit(bob, team="vision")
    assert named.status_code == 201 and named.json()["team"] == "vision"


def test_naming_a_team_one_is_not_in_is_403_and_an_unknown_team_404():
    carol = UserFactory(groups=["operator"])
    team("nlp", UserFactory())

    refused = submit(carol, team="nlp")
    unknown = submit(carol, team="ghost")
    wrong_type = submit(carol, team=5)

    assert refused.status_code == 403 and refused.json()["code"] == "not_a_team_member"
    assert unknown.status_code == 404
    assert wrong_type.status_code == 400 and "team" in wrong_type.json()["errors"]
    assert not Job.objects.exists()


def test_a_retry_keeps_the_team():
    alice = UserFactory(groups=["operator"])
    team("nlp", alice)
    job = Job.objects.get(pk=submit(alice).json()["id"])
    client_of(alice).post(f"/api/queue/{job.pk}/cancel", {}, format="json")

    retried = client_of(alice).post(f"/api/queue/{job.pk}/retry", {}, format="json")

    assert retried.status_code == 201 and retried.json()["team"] == "nlp"


@pytest.mark.parametrize("group", ["viewer", "operator", "admin"])
def test_create_api_token_creates_a_user_in_a_shipped_group(group):
    out = StringIO()
    UserFactory(groups=[group])  # the shipped groups exist, as after migrate

    call_command("create_api_token", f"new-{group}", "--group", group, stdout=out, stderr=StringIO())

    user = get_user_model().objects.get(username=f"new-{group}")
    assert list(user.groups.values_list("name", flat=True)) == [group] and not user.is_superuser
    token = out.getvalue().strip().splitlines()[-1]
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert client.get("/api/admin/teams").status_code == 200


def test_create_api_token_refuses_to_move_an_existing_user_between_groups():
    UserFactory(username="dave", groups=["viewer"])

    with pytest.raises(CommandError, match="not in group 'admin'"):
        call_command("create_api_token", "dave", "--group", "admin", stdout=StringIO(), stderr=StringIO())
    with pytest.raises(CommandError, match="not both"):
        call_command("create_api_token", "erin", "--group", "admin", "--superuser", stdout=StringIO(), stderr=StringIO())
    assert not get_user_model().objects.filter(username="erin").exists()


def test_the_jobs_admin_shows_and_filters_by_team(client):
    alice = UserFactory(username="alice", groups=["operator"], is_staff=True)
    team("nlp", alice)
    job = Job.objects.get(pk=submit(alice).json()["id"])
    Job.objects.create(config_name="teamless-config-x7")
    client.force_login(alice)

    listing = client.get("/admin/queue/job/", {"team__id__exact": job.team_id}).content.decode()
    page = client.get(f"/admin/queue/job/{quote(job.pk)}/change/").content.decode()

    assert job.pk in listing and "teamless-config-x7" not in listing and "nlp" in listing
    assert "nlp" in page and "alice" in page


@pytest.mark.django_db(transaction=True)
def test_a_team_deleted_while_its_job_is_submitted_is_a_404_and_nothing_is_made(monkeypatch):
    from job_queue import services

    alice = UserFactory(groups=["operator"])
    team("nlp", alice)
    read = services.team_for_submit

    def deleted_after_the_read(**kwargs):
        name = read(**kwargs)
        Team.objects.filter(name=name).delete()  # another transaction's team_delete, committed
        return name

    monkeypatch.setattr(services, "team_for_submit", deleted_after_the_read)

    response = submit(alice)

    assert response.status_code == 404, response.content
    assert "was deleted meanwhile" in response.json()["detail"]
    assert not Job.objects.exists()
