"""Fair share: decayed usage charged from the attempts, the order a freed worker is offered the queue in, and where a
queued job stands."""

import math
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from audit.services import Actor
from job_queue import dispatch, fairshare
from job_queue.fairshare import fairshare_charge, queue_positions, share_key, usage_add, usage_at
from job_queue.models import FairShare, Job, JobAttempt, JobStatus
from job_queue.tests.factories import JobFactory
from tenancy.models import Team
from workers.models import WorkerType
from workers.tests.factories import UserFactory, WorkerFactory

pytestmark = pytest.mark.django_db

HOUR = 3600.0


def test_usage_halves_each_half_life_and_the_stored_figure_orders_shares_at_any_instant():
    t0 = timezone.now()
    a = usage_add(None, 100.0, t0, half_life=HOUR)
    assert usage_at(a, t0, half_life=HOUR) == pytest.approx(100.0)
    assert usage_at(a, t0 + timedelta(hours=2), half_life=HOUR) == pytest.approx(25.0)
    # 100 GPU-seconds two hours ago weigh less than 30 now
    b = usage_add(None, 30.0, t0 + timedelta(hours=2), half_life=HOUR)
    assert a < b
    assert usage_add(a, 30.0, t0 + timedelta(hours=2), half_life=HOUR) > b
    # far from the epoch, with a short half-life, nothing overflows
    late = t0 + timedelta(days=365 * 50)
    c = usage_add(usage_add(None, 1.0, late, half_life=1.0), 1.0, late, half_life=1.0)
    assert math.isfinite(c) and usage_at(c, late, half_life=1.0) == pytest.approx(2.0)


def _attempt(job, *, started, finished=None, gpus=1):
    return JobAttempt.objects.create(
        job=job, number=job.attempt_count + 1, lease_id=f"a_{job.pk}_{started.timestamp()}", dispatched_at=started,
        started_at=started, finished_at=finished, outcome="completed" if finished else "", gpus=gpus,
    )


def test_the_charge_counts_running_attempts_up_to_now_and_never_twice(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "FAIRSHARE_HALF_LIFE": HOUR}
    user = UserFactory()
    team = Team.objects.create(name="nlp")
    now = timezone.now()
    ended = _attempt(JobFactory(team=team, submitted_by=user), started=now - timedelta(seconds=300), finished=now - timedelta(seconds=200), gpus=2)
    running = _attempt(JobFactory(team=team, submitted_by=user), started=now - timedelta(seconds=50), gpus=4)
    solo = _attempt(JobFactory(submitted_by=user), started=now - timedelta(seconds=10))

    assert fairshare_charge(now=now) == 3
    nlp = FairShare.objects.get(key=share_key(team_id=team.pk, user_id=user.pk))
    # 100 s x 2 GPUs, 200 s ago (decayed), plus 50 s x 4 GPUs now
    expected = 200 * 2 ** (-200 / HOUR) + 200
    assert usage_at(nlp.usage_log, now, half_life=HOUR) == pytest.approx(expected, rel=1e-9)
    assert usage_at(FairShare.objects.get(key=share_key(team_id=None, user_id=user.pk)).usage_log, now, half_life=HOUR) == pytest.approx(10)

    # a second run charges only what ran since: the running attempt's next 30 s
    assert fairshare_charge(now=now) == 2  # the running ones are read again, and charged nothing new
    later = now + timedelta(seconds=30)
    fairshare_charge(now=later)
    nlp.refresh_from_db()
    assert usage_at(nlp.usage_log, later, half_life=HOUR) == pytest.approx((expected + 0) * 2 ** (-30 / HOUR) + 120, rel=1e-9)
    ended.refresh_from_db()
    running.refresh_from_db()
    solo.refresh_from_db()
    assert ended.charged_until == ended.finished_at and running.charged_until == later


def _plan(query):
    with transaction.atomic(), connection.cursor() as cursor:
        for table in ("queue_job", "queue_fairshare"):
            cursor.execute(f"ANALYZE {table}")
        sql, params = query.query.sql_with_params()
        cursor.execute(("EXPLAIN " if connection.vendor == "postgresql" else "EXPLAIN QUERY PLAN ") + sql, params)
        return "\n".join(str(row[-1]) for row in cursor.fetchall())


def test_a_freed_workers_first_job_is_read_from_each_shares_head_not_a_sort_of_the_backlog():
    users = [UserFactory() for _ in range(20)]
    submitted = timezone.now()
    Job.objects.bulk_create(
        Job(config_name=f"c-{i}", status=JobStatus.COMPLETED if i % 7 == 0 else JobStatus.QUEUED, priority=i % 2,
            submitted_by=users[i % 20], submitted_at=submitted)
        for i in range(3000)
    )
    fairshare.shares_ensure_queued()

    plan = _plan(fairshare.first_head_for_worker(WorkerType.PERSISTENT, gpu_count=1))

    # each share's head from its index, the heads by primary key; only the heads (one per share) are sorted
    assert "job_share_order" in plan, plan
    if connection.vendor == "postgresql":
        assert "Seq Scan on queue_job" not in plan and "Hash" not in plan, plan
    else:
        assert "SEARCH queue_job USING INDEX" in plan and "SCAN queue_job" not in plan, plan


@pytest.fixture
def teams():
    found = {}
    for name in ("a", "b", "c"):
        user = UserFactory(username=f"user-{name}")
        team = Team.objects.create(name=name)
        team.members.set([user])
        found[name] = (team, user)
    return found


def _queued(team, user, **fields):
    return JobFactory(team=team, submitted_by=user, **fields)


def test_a_freed_worker_takes_the_least_used_share_first_priority_still_first_ties_to_the_older(teams, settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "FAIRSHARE_HALF_LIFE": HOUR}
    now = timezone.now()
    (a, ua), (b, ub), (c, uc) = teams["a"], teams["b"], teams["c"]
    _attempt(_queued(a, ua, status=JobStatus.COMPLETED), started=now - timedelta(seconds=1000), finished=now)
    _attempt(_queued(b, ub, status=JobStatus.COMPLETED), started=now - timedelta(seconds=100), finished=now)
    fairshare_charge(now=now)
    start = now - timedelta(minutes=10)
    a_old = _queued(a, ua, submitted_at=start)
    b_new = _queued(b, ub, submitted_at=start + timedelta(minutes=1))
    c_newer = _queued(c, uc, submitted_at=start + timedelta(minutes=2))  # c never ran: least of all
    a_urgent = _queued(a, ua, submitted_at=start + timedelta(minutes=3), priority=1)
    c_tie = _queued(c, uc, submitted_at=start + timedelta(minutes=4))

    expected = [a_urgent, c_newer, c_tie, b_new, a_old]
    assert queue_positions([job.pk for job in expected]) == {job.pk: i + 1 for i, job in enumerate(expected)}
    taken = [dispatch.dispatch_for_worker(WorkerFactory(name=f"w{i}").pk) for i in range(5)]
    assert [job.pk for job in taken] == [job.pk for job in expected]
    assert queue_positions([job.pk for job in expected]) == {}  # none is queued any more


def test_a_share_without_its_row_is_still_offered():
    job = Job.objects.create(config_name="c")  # not through the dispatcher: no share row yet
    assert not FairShare.objects.exists()
    assert dispatch.dispatch_for_worker(WorkerFactory().pk).pk == job.pk


def test_simulated_day_three_backlogged_teams_get_equal_gpu_time_and_an_idle_team_the_next_worker(teams, settings, monkeypatch):
    """Real services on a fake clock: submit, acknowledge and complete over the API's services, charge every minute."""
    from job_queue.reports import job_report
    from job_queue.services import job_submit
    from job_queue.usage import usage_rows

    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "FAIRSHARE_HALF_LIFE": 4 * HOUR}
    clock = [timezone.now().replace(microsecond=0)]
    monkeypatch.setattr(timezone, "now", lambda: clock[0])
    t0 = clock[0]
    idle_user = UserFactory(username="user-d")
    Team.objects.create(name="d").members.set([idle_user])
    actors = {name: Actor.for_user(user, "10.0.0.1") for name, (_, user) in teams.items()}
    actors["d"] = Actor.for_user(idle_user, "10.0.0.1")
    workers = [WorkerFactory(name=f"gpu-{i}", gpu_count=1) for i in range(6)]
    every = {"a": 3, "b": 6, "c": 12}  # minutes between submissions: all three stay backlogged
    ends = {}

    def acknowledge():
        for job in Job.objects.filter(status=JobStatus.DISPATCHED).select_related("worker"):
            job_report(worker_id=job.worker_id, job_id=job.pk, data={"status": "running", "attempt": job.lease_id},
                       actor=Actor.for_worker(job.worker))
            ends[job.pk] = clock[0] + timedelta(minutes=30)

    for name in ("a", "b", "c"):
        for _ in range(10):
            job_submit(config_name="c", actor=actors[name], gpu_count=1)
    for _ in range(4):  # d runs a little at first, then is idle for the rest of the day
        job_submit(config_name="c", actor=actors["d"], gpu_count=1)
    acknowledge()
    for minute in range(1, 24 * 60 + 1):
        clock[0] = t0 + timedelta(minutes=minute)
        for job_id, end in sorted(ends.items(), key=lambda item: item[1]):
            if end <= clock[0]:
                job = Job.objects.select_related("worker").get(pk=job_id)
                job_report(worker_id=job.worker_id, job_id=job.pk, data={"status": "completed", "attempt": job.lease_id},
                           actor=Actor.for_worker(job.worker))
                del ends[job_id]
        for name, period in every.items():
            if minute % period == 0:
                job_submit(config_name="c", actor=actors[name], gpu_count=1)
        acknowledge()
        fairshare_charge()
    for name in ("a", "b", "c"):
        assert Job.objects.filter(team__name=name, status=JobStatus.QUEUED).exists(), f"{name} ran out of backlog"

    used = {row["key"]: row["gpu_seconds"] for row in usage_rows(group_by="team", since=t0, until=clock[0], now=clock[0])}
    equal = sum(used[name] for name in ("a", "b", "c")) / 3
    for name in ("a", "b", "c"):
        assert abs(used[name] - equal) <= 0.1 * equal, (used, equal)
    assert len(workers) * 24 * HOUR * 0.95 <= sum(used.values())  # the fleet was kept busy

    # d, idle for most of the day, submits behind hundreds of queued jobs: the next free worker is its
    late, _ = job_submit(config_name="c", actor=actors["d"], gpu_count=1)
    assert late.status == JobStatus.QUEUED
    assert queue_positions([late.pk]) == {late.pk: 1}
    job_id = min(ends, key=ends.get)
    clock[0] = ends[job_id]
    job = Job.objects.select_related("worker").get(pk=job_id)
    job_report(worker_id=job.worker_id, job_id=job.pk, data={"status": "completed", "attempt": job.lease_id},
               actor=Actor.for_worker(job.worker))
    late.refresh_from_db()
    assert (late.status, late.worker_id) == (JobStatus.DISPATCHED, job.worker_id)


def test_the_job_detail_and_list_give_each_queued_job_its_place_in_one_query_for_the_page(teams, bearer_client):
    from django.test.utils import CaptureQueriesContext

    (a, ua), (b, ub), _ = teams["a"], teams["b"], teams["c"]
    start = timezone.now() - timedelta(minutes=10)
    first, second = _queued(a, ua, submitted_at=start), _queued(b, ub, submitted_at=start + timedelta(minutes=1))
    urgent = _queued(b, ub, submitted_at=start + timedelta(minutes=2), priority=3)
    done = _queued(a, ua, status=JobStatus.COMPLETED)
    client = bearer_client(UserFactory(groups=["viewer"]))

    assert client.get(f"/api/queue/{second.pk}").json()["queue_position"] == 3
    assert client.get(f"/api/queue/{done.pk}").json()["queue_position"] is None
    with CaptureQueriesContext(connection) as queries:
        listed = client.get("/api/queue/").json()
    rows = listed["results"] if isinstance(listed, dict) else listed
    assert {row["id"]: row["queue_position"] for row in rows} == {urgent.pk: 1, first.pk: 2, second.pk: 3, done.pk: None}
    assert sum(1 for q in queries.captured_queries if "ROW_NUMBER" in q["sql"]) == 1


def test_the_admin_job_page_shows_the_place_in_the_queue_with_the_waiting_reason(admin_client):
    from django.contrib.admin.utils import quote
    from django.urls import reverse

    start = timezone.now() - timedelta(minutes=5)
    JobFactory(submitted_at=start)
    job = JobFactory(submitted_at=start + timedelta(minutes=1))

    page = admin_client.get(reverse("admin:queue_job_change", args=[quote(job.pk)])).content.decode()

    assert "Place in the queue" in page and "Why it waits" in page
    assert '<div class="readonly">2</div>' in page, page[page.find("Place in the queue") - 200 : page.find("Place in the queue") + 300]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_charges_at_once_charge_each_attempt_once(postgres_url, settings):
    from job_queue.tests.test_concurrency import run_concurrently

    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "FAIRSHARE_HALF_LIFE": HOUR}
    now = timezone.now()
    users = [UserFactory() for _ in range(4)]
    for i in range(200):
        _attempt(JobFactory(submitted_by=users[i % 4], status=JobStatus.COMPLETED), started=now - timedelta(seconds=100),
                 finished=now - timedelta(seconds=10 + i % 7))

    run_concurrently([lambda: fairshare_charge(now=now, batch=7)] * 4)

    for user in users:
        share = FairShare.objects.get(key=share_key(team_id=None, user_id=user.pk))
        expected = sum(
            (90 - i % 7) * 2 ** (-(10 + i % 7) / HOUR) for i in range(200) if users[i % 4] == user
        )
        assert usage_at(share.usage_log, now, half_life=HOUR) == pytest.approx(expected, rel=1e-9)


def test_the_list_reads_the_fleet_and_the_limits_once_for_its_page(bearer_client):
    from django.test.utils import CaptureQueriesContext

    WorkerFactory(labels={"gpu": "a100"})
    for _ in range(6):
        JobFactory(worker_labels={"gpu": "h100"})  # no worker matches: each says why
    client = bearer_client(UserFactory(groups=["viewer"]))
    with CaptureQueriesContext(connection) as queries:
        listed = client.get("/api/queue/").json()
    rows = listed["results"] if isinstance(listed, dict) else listed
    assert {row["waiting_reason"] for row in rows} == {"no worker with >= 0 GPUs matches labels gpu=h100"}
    assert sum(1 for q in queries.captured_queries if 'FROM "workers_worker"' in q["sql"]) == 1
    assert sum(1 for q in queries.captured_queries if 'FROM "tenancy_limits"' in q["sql"]) == 1
