"""Usage accounting: what each attempt is charged, GET /api/usage (who sees what, bad input), the CSV, /metrics."""

import random
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.utils import timezone

from audit.services import Actor
from job_queue.models import AttemptOutcome, Job, JobAttempt, JobStatus
from job_queue.services import job_cancel, job_submit
from job_queue.transitions import jobs_acknowledge, jobs_release
from job_queue.usage import charged_attempts, held_seconds, usage_rows, usage_totals
from observability.usage import usage_csv
from tenancy.models import Team
from tenancy.tests.test_teams_api import client_of
from workers.tests.factories import UserFactory, WorkerFactory

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=dt_timezone.utc)


def attempt(job, *, start, seconds, gpus, number=1, outcome=AttemptOutcome.COMPLETED):
    """An attempt of ``job`` acknowledged at ``start`` and ended ``seconds`` later (None: still running)."""
    return JobAttempt.objects.create(
        job=job, number=number, lease_id=f"a_{job.pk}_{number}", dispatched_at=start - timedelta(seconds=5),
        started_at=start, finished_at=start + timedelta(seconds=seconds) if seconds is not None else None,
        outcome=outcome if seconds is not None else "", gpus=gpus,
    )


def test_each_attempt_is_charged_its_gpus_from_acknowledgement_to_its_end_and_a_running_one_to_now():
    alice, bob = UserFactory(username="alice"), UserFactory(username="bob")
    nlp = Team.objects.create(name="nlp")
    first = Job.objects.create(config_name="sdxl", submitted_by=alice, team=nlp)
    attempt(first, start=T0, seconds=100, gpus=2, outcome=AttemptOutcome.LOST)  # lost: up to when declared lost
    attempt(first, start=T0 + timedelta(hours=1), seconds=50, gpus=2, number=2)
    second = Job.objects.create(config_name="flux", submitted_by=bob)
    attempt(second, start=T0, seconds=None, gpus=8)  # running
    never = Job.objects.create(config_name="flux", submitted_by=bob)
    JobAttempt.objects.create(job=never, number=1, lease_id="a_never", dispatched_at=T0, gpus=4,
                              finished_at=T0 + timedelta(seconds=60), outcome=AttemptOutcome.UNACKNOWLEDGED)
    now, since = T0 + timedelta(seconds=30), T0 - timedelta(days=1)

    by_user = usage_rows(group_by="user", since=since, until=T0 + timedelta(days=1), now=now)
    by_team = usage_rows(group_by="team", since=since, until=T0 + timedelta(days=1), now=now)
    by_config = usage_rows(group_by="config", since=since, until=T0 + timedelta(days=1), now=now)

    assert by_user == [
        {"key": "alice", "gpu_seconds": 300.0, "jobs": 1, "attempts": 2},  # (100 + 50) s x 2 GPUs
        {"key": "bob", "gpu_seconds": 240.0, "jobs": 1, "attempts": 1},  # 30 s so far x 8 GPUs; never acknowledged: nothing
    ]
    assert by_team == [{"key": "nlp", "gpu_seconds": 300.0, "jobs": 1, "attempts": 2}, {"key": None, "gpu_seconds": 240.0, "jobs": 1, "attempts": 1}]
    assert [row["key"] for row in by_config] == ["sdxl", "flux"]
    assert usage_totals(now=now) == {("nlp", "alice"): 300.0, ("", "bob"): 240.0}


def test_the_sql_and_the_python_form_of_the_gpu_time_rule_agree_on_every_attempt_and_window():
    """charged_attempts (SQL: usage, quotas, /metrics) and held_seconds (Python: fair share's charge, a quota's
    frees-at) are the one rule in two forms: the same GPU-seconds for ended, running and cut attempts, windows
    before, across, inside and after them, and unbounded ends."""
    rng = random.Random(29)
    job = Job.objects.create(config_name="c", submitted_by=UserFactory(username="rule"))
    now = T0 + timedelta(hours=10)
    for number in range(1, 41):
        start = T0 + timedelta(seconds=rng.randrange(0, 9 * 3600), microseconds=rng.randrange(0, 10**6))
        ended = rng.random() < 0.7
        seconds = rng.uniform(0.5, 3600) if ended else None
        if ended and start + timedelta(seconds=seconds) > now:
            seconds = (now - start).total_seconds() * rng.random()
        attempt(job, start=start, seconds=seconds, gpus=rng.choice([1, 2, 8]), number=number)
    windows = [(None, None), (T0 - timedelta(days=1), None), (None, T0 + timedelta(hours=3))]
    for _ in range(12):
        a, b = sorted(T0 + timedelta(seconds=rng.uniform(-3600, 11 * 3600)) for _ in range(2))
        windows.append((a, b))

    for since, until in windows:
        in_sql = {a.lease_id: a.gpu_seconds for a in charged_attempts(since=since, until=until, now=now)}
        for run in JobAttempt.objects.filter(job=job):
            in_python = held_seconds(run.started_at, run.finished_at, since=since, until=until, now=now) * run.gpus
            assert in_sql.get(run.lease_id, 0.0) == pytest.approx(in_python, abs=1e-3), (run.lease_id, since, until)
    assert held_seconds(T0, T0 + timedelta(seconds=5), since=T0 + timedelta(seconds=9), now=now) == 0.0  # never negative


def test_a_window_charges_only_the_part_of_each_attempt_inside_it():
    job = Job.objects.create(config_name="c", submitted_by=UserFactory(username="carol"))
    attempt(job, start=T0, seconds=3600, gpus=1)

    rows = usage_rows(group_by="user", since=T0 + timedelta(minutes=45), until=T0 + timedelta(hours=5), now=T0 + timedelta(days=1))
    before = usage_rows(group_by="user", since=T0 - timedelta(hours=5), until=T0, now=T0 + timedelta(days=1))

    assert rows == [{"key": "carol", "gpu_seconds": 900.0, "jobs": 1, "attempts": 1}]
    assert before == []


def test_the_transitions_charge_a_real_run_a_lost_attempt_and_a_cancel():
    """Through the services: dispatch records the GPUs held (the worker's, for a job that asks for none), the
    acknowledgement starts the charge, a loss and a cancel end it."""
    user = UserFactory(username="dave", groups=["operator"])
    WorkerFactory(gpu_count=4)
    actor = Actor.for_user(user)
    job, dispatched = job_submit(config_name="c", actor=actor)
    assert dispatched
    (held,) = JobAttempt.objects.filter(job=job)
    assert held.gpus == 4
    job.refresh_from_db()
    jobs_acknowledge(jobs=[job], actor=actor, reason="starting", now=T0)
    jobs_release(jobs=[job], actor=actor, reason="worker lost", now=T0 + timedelta(seconds=10))
    assert JobAttempt.objects.get(pk=held.pk).outcome == AttemptOutcome.LOST

    sized, _ = job_submit(config_name="c", actor=actor, gpu_count=2)
    Job.objects.filter(pk=sized.pk).update(status=JobStatus.RUNNING)  # as acknowledged (no worker is free: queued)
    JobAttempt.objects.create(job=sized, number=1, lease_id="a_sized", dispatched_at=T0, started_at=T0, gpus=2)
    Job.objects.filter(pk=sized.pk).update(lease_id="a_sized")
    job_cancel(job_id=sized.pk, actor=actor)
    cancelled = JobAttempt.objects.get(lease_id="a_sized")
    assert cancelled.outcome == AttemptOutcome.CANCELLED and cancelled.finished_at is not None

    charged = {a.lease_id: a.gpu_seconds for a in charged_attempts(now=timezone.now())}
    assert charged[held.lease_id] == pytest.approx(40.0)  # 10 s x 4 GPUs
    assert charged["a_sized"] == pytest.approx((cancelled.finished_at - T0).total_seconds() * 2, rel=1e-6)


def test_operators_and_admins_see_every_row_a_viewer_only_their_own():
    viewer, operator = UserFactory(username="vera", groups=["viewer"]), UserFactory(username="otto", groups=["operator"])
    now = timezone.now()
    for user in (viewer, operator):
        attempt(Job.objects.create(config_name="c", submitted_by=user), start=now - timedelta(hours=1), seconds=60, gpus=1)

    seen = {
        role: client_of(user).get("/api/usage", {"group_by": "user"}).json()
        for role, user in (("viewer", viewer), ("operator", operator), ("admin", UserFactory(groups=["admin"])))
    }

    assert [row["key"] for row in seen["viewer"]["rows"]] == ["vera"] and seen["viewer"]["only_mine"]
    assert sorted(row["key"] for row in seen["operator"]["rows"]) == ["otto", "vera"]
    assert sorted(row["key"] for row in seen["admin"]["rows"]) == ["otto", "vera"]
    window = datetime.fromisoformat(seen["admin"]["until"]) - datetime.fromisoformat(seen["admin"]["since"])
    assert window == timedelta(days=30)
    assert client_of(UserFactory()).get("/api/usage").status_code == 403  # no group: no permission


@pytest.mark.parametrize(
    "query",
    [{"group_by": "worker"}, {"since": "yesterday"}, {"until": "2026-02-30T00:00:00Z"}, {"since": ""},
     {"since": "2026-11-02T00:00:00Z", "until": "2026-11-01T00:00:00Z"}],
)
def test_bad_usage_filters_are_a_400_naming_them(query):
    response = client_of(UserFactory(groups=["admin"])).get("/api/usage", query)

    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid_filter" and next(iter(query)) in response.json()["detail"]


def test_since_and_until_are_taken_in_rfc_3339():
    response = client_of(UserFactory(groups=["admin"])).get(
        "/api/usage", {"group_by": "team", "since": "2026-11-01T00:00:00+02:00", "until": "2026-11-08T00:00:00Z"}
    )

    assert response.status_code == 200
    assert response.json()["since"] == "2026-10-31T22:00:00+00:00" and response.json()["group_by"] == "team"


def test_the_csv_has_a_header_and_defuses_formulas():
    text = usage_csv([{"key": "=cmd()", "gpu_seconds": 7200.0, "jobs": 1, "attempts": 2}, {"key": None, "gpu_seconds": 0.0, "jobs": 1, "attempts": 1}])

    assert text.splitlines() == ["key,gpu_seconds,gpu_hours,jobs,attempts", "'=cmd(),7200.000,2.0000,1,2", ",0.000,0.0000,1,1"]


def test_metrics_expose_gpu_seconds_by_team_and_user(client, settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "METRICS": "public"}
    job = Job.objects.create(config_name="c", submitted_by=UserFactory(username="erin"), team=Team.objects.create(name="vision"))
    attempt(job, start=timezone.now() - timedelta(hours=2), seconds=90, gpus=2)

    text = client.get("/metrics").content.decode()

    assert 'simpletuner_gpu_seconds_total{team="vision",user="erin"} 180.0' in text
