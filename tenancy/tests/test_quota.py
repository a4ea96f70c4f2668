"""GPU-hour quotas at submit: a user, team or fleet that has used up its gpu_hours_per_30_days is refused (403
gpu_quota_exceeded) naming the quota, the usage and when enough frees up; the tightest quota applies."""

from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from job_queue.models import Job, JobAttempt
from tenancy.models import LimitScope, Limits, Team
from workers.tests.factories import UserFactory

from .test_teams_api import client_of

pytestmark = pytest.mark.django_db


def used(user, *, hours_ago, gpu_hours, team=None, gpus=1):
    """Charge ``user`` (and ``team``) ``gpu_hours`` by an attempt that ended ``hours_ago`` hours ago."""
    end = timezone.now() - timedelta(hours=hours_ago)
    job = Job.objects.create(config_name="c", submitted_by=user, team=team, status="completed", finished_at=end)
    JobAttempt.objects.create(
        job=job, number=1, lease_id=f"a_{job.pk}", dispatched_at=end, started_at=end - timedelta(hours=gpu_hours / gpus),
        finished_at=end, outcome="completed", gpus=gpus,
    )


def submit(user, **body):
    return client_of(user).post("/api/queue/submit", {"config_name": "c", **body}, format="json")


def test_a_user_over_their_quota_is_refused_naming_quota_usage_and_when_it_frees_up():
    alice = UserFactory(username="alice", groups=["operator"])
    Limits.objects.create(scope=LimitScope.USER, user=alice, gpu_hours_per_30_days=10)
    used(alice, hours_ago=24 * 29, gpu_hours=6)  # leaves the window in about a day
    used(alice, hours_ago=2, gpu_hours=5)
    jobs = Job.objects.count()

    refused = submit(alice)

    assert refused.status_code == 403, refused.content
    body = refused.json()
    assert body["code"] == "gpu_quota_exceeded"
    assert "your quota of 10 GPU-hours per 30 days" in body["detail"] and "11.00 GPU-hours used" in body["detail"]
    assert body["quota"] == {"scope": "user", "name": None, "gpu_hours_per_30_days": 10.0}
    assert body["used_gpu_hours"] == pytest.approx(11.0, abs=0.01)
    # Over 1 GPU-hour must leave the window: the old run's first hour, 30 days and 1 hour after it began.
    frees = datetime.fromisoformat(body["frees_at"])
    expected = timezone.now() - timedelta(hours=24 * 29 + 6) + timedelta(days=30) + timedelta(hours=1)
    assert abs((frees - expected).total_seconds()) < 5
    assert Job.objects.count() == jobs


def test_under_the_quota_a_submit_goes_through_and_other_users_are_not_charged():
    alice, bob = UserFactory(groups=["operator"]), UserFactory(groups=["operator"])
    Limits.objects.create(scope=LimitScope.USER, user=alice, gpu_hours_per_30_days=10)
    used(alice, hours_ago=2, gpu_hours=9)
    used(bob, hours_ago=2, gpu_hours=100)
    used(alice, hours_ago=24 * 31, gpu_hours=100)  # outside the 30 days

    assert submit(alice).status_code == 201


def test_a_team_quota_counts_every_member_and_the_tightest_quota_holds():
    alice, bob = UserFactory(groups=["operator"]), UserFactory(groups=["operator"])
    nlp = Team.objects.create(name="nlp")
    nlp.members.set([alice, bob])
    Limits.objects.create(scope=LimitScope.TEAM, team=nlp, gpu_hours_per_30_days=8)
    Limits.objects.create(scope=LimitScope.USER, user=bob, gpu_hours_per_30_days=1000)
    used(alice, hours_ago=3, gpu_hours=5, team=nlp)
    used(bob, hours_ago=3, gpu_hours=4, team=nlp, gpus=4)

    refused = submit(bob)

    assert refused.status_code == 403 and refused.json()["code"] == "gpu_quota_exceeded"
    assert "team nlp's quota of 8 GPU-hours" in refused.json()["detail"]
    Limits.objects.filter(team=nlp).update(gpu_hours_per_30_days=None)
    assert submit(bob).status_code == 201


def test_the_fleet_quota_and_a_quota_of_zero():
    alice = UserFactory(groups=["operator"])
    Limits.objects.create(scope=LimitScope.GLOBAL, gpu_hours_per_30_days=0)

    refused = submit(alice)

    assert refused.status_code == 403
    assert "the fleet's quota of 0 GPU-hours" in refused.json()["detail"] and refused.json()["frees_at"] is None
    assert "never frees up" in refused.json()["detail"]
