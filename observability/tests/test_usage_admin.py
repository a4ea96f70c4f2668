"""The admin's Teams pages (members, limits, usage) and the usage page (filters, weekly chart, CSV, quotas)."""

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from audit import actions
from audit.models import AuditEvent
from job_queue.models import Job, JobAttempt
from tenancy.models import LimitScope, Limits, Team
from workers.tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def signed_in(client, group):
    user = UserFactory(username=f"{group}-user", is_staff=True, groups=[group])
    client.force_login(user)
    return user


def charge(user, team, *, gpu_hours, hours_ago=1):
    end = timezone.now() - timedelta(hours=hours_ago)
    job = Job.objects.create(config_name="sdxl", submitted_by=user, team=team, status="completed", finished_at=end)
    JobAttempt.objects.create(job=job, number=1, lease_id=f"a_{job.pk}", dispatched_at=end, started_at=end - timedelta(hours=gpu_hours),
                              finished_at=end, outcome="completed", gpus=1)


def test_an_admin_adds_a_team_with_members_and_limits_through_the_services(client):
    signed_in(client, "admin")
    alice = UserFactory(username="alice")

    response = client.post(
        reverse("admin:tenancy_team_add"),
        {"name": "nlp", "members": [alice.pk], "max_running_jobs": "2", "max_gpus": "", "gpu_hours_per_30_days": "50"},
    )

    assert response.status_code == 302, response.content.decode()[:2000]
    team = Team.objects.get(name="nlp")
    assert list(team.members.all()) == [alice]
    assert (team.limits.max_running_jobs, team.limits.max_gpus, team.limits.gpu_hours_per_30_days) == (2, None, 50.0)
    assert set(AuditEvent.objects.values_list("action", flat=True)) >= {actions.TEAM_CREATED, actions.LIMITS_CHANGED}


def test_an_operator_may_view_teams_but_not_change_them(client):
    signed_in(client, "operator")
    team = Team.objects.create(name="nlp")

    assert client.get(reverse("admin:tenancy_team_changelist")).status_code == 200
    assert client.post(reverse("admin:tenancy_team_add"), {"name": "x"}).status_code == 403
    assert client.post(reverse("admin:tenancy_team_delete", args=[team.pk]), {"post": "yes"}).status_code == 403
    assert Team.objects.count() == 1


def test_deleting_a_team_with_a_running_job_is_refused_in_the_admin_too(client):
    signed_in(client, "admin")
    team = Team.objects.create(name="nlp")
    Job.objects.create(config_name="c", team=team, status="running")

    client.post(reverse("admin:tenancy_team_delete", args=[team.pk]), {"post": "yes"})

    assert Team.objects.filter(pk=team.pk).exists()


def test_the_team_list_shows_each_teams_usage_and_the_usage_page_its_table_chart_csv_and_quotas(client):
    signed_in(client, "operator")
    alice = UserFactory(username="alice")
    team = Team.objects.create(name="nlp")
    charge(alice, team, gpu_hours=3)
    Limits.objects.create(scope=LimitScope.TEAM, team=team, gpu_hours_per_30_days=3.5)

    listing = client.get(reverse("admin:tenancy_team_changelist")).content.decode()
    page = client.get(reverse("admin:tenancy_team_usage"), {"group_by": "team"}).content.decode()
    csv = client.get(reverse("admin:tenancy_team_usage"), {"group_by": "user", "format": "csv"})

    assert "3.00" in listing and 'id="usage-link"' in listing
    assert '<svg id="usage-chart"' in page and "<td>nlp</td><td>3.00</td>" in page
    assert 'class="st-quota-near"' in page and "<td>team</td><td>nlp</td>" in page
    assert csv["Content-Type"].startswith("text/csv")
    assert csv.content.decode().splitlines()[1].startswith("alice,10800.000,3.0000,1,1")


def test_a_viewer_sees_only_their_own_usage_and_a_bad_filter_is_a_400(client):
    viewer = signed_in(client, "viewer")
    charge(viewer, None, gpu_hours=1)
    charge(UserFactory(username="someone-else"), None, gpu_hours=2)

    page = client.get(reverse("admin:tenancy_team_usage")).content.decode()
    bad = client.get(reverse("admin:tenancy_team_usage"), {"since": "last week"})

    assert "viewer-user" in page and "someone-else" not in page and "Your own jobs only" in page
    assert bad.status_code == 400 and "since must be an RFC 3339" in bad.content.decode()


def test_a_team_page_shows_its_usage_by_member(client):
    signed_in(client, "admin")
    team = Team.objects.create(name="nlp")
    charge(UserFactory(username="alice"), team, gpu_hours=2)
    charge(UserFactory(username="bob"), None, gpu_hours=5)  # not the team's

    page = client.get(reverse("admin:tenancy_team_change", args=[team.pk])).content.decode()

    assert "2.00 GPU-hours (alice 2.00)" in page
