"""Running and GPU limits at dispatch: a job a limit holds back waits with the limit in its waiting reason, the jobs
behind it that fit go meanwhile, and the room a job leaves when it ends is offered at once."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from audit.services import Actor
from job_queue import dispatch
from job_queue.models import Job, JobStatus
from job_queue.reports import job_report
from job_queue.selectors import job_waiting_reason
from job_queue.services import job_submit
from tenancy.models import LimitScope, Team
from tenancy.services import limits_set
from workers.tests.factories import UserFactory, WorkerFactory

pytestmark = pytest.mark.django_db

ADMIN = Actor.system("test")


@pytest.fixture
def people():
    alice, bob, carol = (UserFactory(username=name) for name in ("alice", "bob", "carol"))
    Team.objects.create(name="nlp").members.set([alice, carol])
    Team.objects.create(name="vision").members.set([bob])
    return {user.username: Actor.for_user(user, "10.0.0.1") for user in (alice, bob, carol)}


def submit(actor, **fields):
    job, _ = job_submit(config_name="c", actor=actor, **fields)
    job.refresh_from_db()
    return job


def complete(job):
    job.refresh_from_db()
    worker = job.worker
    job_report(worker_id=worker.pk, job_id=job.pk, data={"status": "running", "attempt": job.lease_id}, actor=Actor.for_worker(worker))
    return job_report(worker_id=worker.pk, job_id=job.pk, data={"status": "completed", "attempt": job.lease_id}, actor=Actor.for_worker(worker))


def test_a_team_at_its_limit_holds_its_next_job_and_the_jobs_behind_it_go(people, commit):
    for i in range(4):
        WorkerFactory(name=f"w{i}")
    limits_set(scope=LimitScope.TEAM, team="nlp", values={"max_running_jobs": 2}, actor=ADMIN)
    with commit():
        first, second = submit(people["alice"]), submit(people["carol"])
        held = submit(people["alice"])
        behind = submit(people["bob"])

    assert first.status == second.status == JobStatus.DISPATCHED
    assert held.status == JobStatus.QUEUED
    assert behind.status == JobStatus.DISPATCHED  # no head-of-line blocking
    assert job_waiting_reason(held) == "team nlp is at its limit of 2 running jobs"
    # the periodic pass and a worker's own offer of the queue hold it back too
    assert dispatch.dispatch_pending() == 0
    assert dispatch.dispatch_for_worker(WorkerFactory(name="late").pk) is None
    held.refresh_from_db()
    assert held.status == JobStatus.QUEUED


def test_a_user_limit_and_a_gpu_limit_name_their_figures(people, commit):
    WorkerFactory(name="big", gpu_count=8)
    WorkerFactory(name="big2", gpu_count=8)
    limits_set(scope=LimitScope.USER, username="alice", values={"max_gpus": 4}, actor=ADMIN)
    with commit():
        running = submit(people["alice"], gpu_count=3)
        held = submit(people["alice"], gpu_count=2)
        other = submit(people["carol"], gpu_count=2)  # same team, another user: not under alice's limit

    assert (running.status, held.status, other.status) == (JobStatus.DISPATCHED, JobStatus.QUEUED, JobStatus.DISPATCHED)
    assert job_waiting_reason(held) == "user alice is at its limit of 4 GPUs (3 held; this job needs 2)"


def test_a_running_multi_node_job_holds_its_gpus_on_every_node(people, commit):
    from django.contrib.auth import get_user_model

    WorkerFactory(name="spare", gpu_count=8)
    alice = get_user_model().objects.get(username="alice")
    Job.objects.create(config_name="gang", status=JobStatus.RUNNING, gpu_count=2, num_nodes=2, submitted_by=alice)
    limits_set(scope=LimitScope.USER, username="alice", values={"max_gpus": 4}, actor=ADMIN)
    with commit():
        held = submit(people["alice"], gpu_count=1)
    assert held.status == JobStatus.QUEUED
    assert job_waiting_reason(held) == "user alice is at its limit of 4 GPUs (4 held; this job needs 1)"


def test_the_global_limit_holds_every_team(people, commit):
    WorkerFactory.create_batch(3)
    limits_set(scope=LimitScope.GLOBAL, values={"max_running_jobs": 1}, actor=ADMIN)
    with commit():
        submit(people["alice"])
        held = submit(people["bob"])
    assert held.status == JobStatus.QUEUED
    assert job_waiting_reason(held) == "the fleet is at its limit of 1 running job"


def test_a_job_without_a_gpu_count_is_charged_its_workers_gpus(people, commit):
    WorkerFactory(name="eight", gpu_count=8)
    limits_set(scope=LimitScope.TEAM, team="nlp", values={"max_gpus": 4}, actor=ADMIN)
    with commit():
        job = submit(people["alice"])  # any worker: it would hold all 8
    assert job.status == JobStatus.QUEUED
    WorkerFactory(name="four", gpu_count=4)
    assert dispatch.dispatch_for_job(job.pk).name == "four"


def test_room_freed_by_a_job_ending_on_one_worker_is_offered_to_another_idle_worker_at_once(people, commit):
    a = WorkerFactory(name="a", labels={"pool": "main"})
    WorkerFactory(name="b", labels={"gpu": "a100"})
    limits_set(scope=LimitScope.TEAM, team="nlp", values={"max_running_jobs": 1}, actor=ADMIN)
    with commit():
        running = submit(people["alice"], worker_labels={"pool": "main"})
        held = submit(people["alice"], worker_labels={"gpu": "a100"})  # only b fits it; b is idle
    assert running.worker_id == a.pk and held.status == JobStatus.QUEUED

    with commit():
        complete(running)  # a is freed and offered the queue: held does not fit a

    held.refresh_from_db()
    assert (held.status, held.worker.name) == (JobStatus.DISPATCHED, "b")


def test_a_freed_worker_passes_over_a_held_share_for_the_next(people, commit):
    limits_set(scope=LimitScope.TEAM, team="nlp", values={"max_running_jobs": 1}, actor=ADMIN)
    WorkerFactory(name="first")
    with commit():
        submit(people["alice"])
        held = submit(people["carol"])  # first in fair order: older, same usage (none)
        behind = submit(people["bob"])
    assert (held.status, behind.status) == (JobStatus.QUEUED, JobStatus.QUEUED)

    assert dispatch.dispatch_for_worker(WorkerFactory(name="second").pk).pk == behind.pk


def test_with_no_limit_set_a_freed_worker_reads_no_limit(people, commit):
    worker = WorkerFactory()
    with commit():
        job = submit(people["alice"])
        queued = submit(people["bob"])
    assert queued.status == JobStatus.QUEUED
    with CaptureQueriesContext(connection) as queries, commit():
        complete(job)
    queued.refresh_from_db()
    assert queued.worker_id == worker.pk
    # whether a limit is set rides on the reads of the worker and the queue: no statement of its own
    statements = [q["sql"] for q in queries.captured_queries]
    assert not [sql for sql in statements if sql.startswith(('SELECT "tenancy_limits"', 'SELECT 1 AS "a" FROM "tenancy_limits"'))]
    assert sum(1 for sql in statements if '"tenancy_limits"' in sql) == 2  # the freed worker's lock, the queue's read
    assert Job.objects.filter(status=JobStatus.DISPATCHED).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_dispatching_submit_under_a_limit_costs_two_statements_more():
    from workers import events as worker_events

    alice = UserFactory(username="alice")
    Team.objects.create(name="nlp").members.set([alice])
    actor = Actor.for_user(alice, "10.0.0.1")
    WorkerFactory(name="warm-up")
    job_submit(config_name="c", actor=actor)  # steady state: the event channel exists

    def statements():
        worker = WorkerFactory()
        worker_events.publish_on_commit(worker.pk, "ping")
        with CaptureQueriesContext(connection) as queries:
            _, dispatched = job_submit(config_name="c", actor=actor)
        assert dispatched
        return [q["sql"] for q in queries.captured_queries if q["sql"] not in ("BEGIN", "COMMIT", "BEGIN IMMEDIATE")]

    plain = statements()
    limits_set(scope=LimitScope.TEAM, team="nlp", values={"max_running_jobs": 100}, actor=ADMIN)
    limited = statements()
    assert len(plain) == (9 if connection.vendor == "postgresql" else 10), "\n".join(plain)
    assert len(limited) == len(plain) + 2, "\n".join(limited)  # the limits' rows locked, the active jobs counted


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_dispatchers_never_run_a_team_past_its_limit(postgres_url):
    import random

    from job_queue.tests.factories import JobFactory
    from job_queue.tests.test_concurrency import run_concurrently

    alice, bob = UserFactory(username="alice"), UserFactory(username="bob")
    nlp, vision = Team.objects.create(name="nlp"), Team.objects.create(name="vision")
    limits_set(scope=LimitScope.TEAM, team="nlp", values={"max_running_jobs": 3}, actor=ADMIN)
    limits_set(scope=LimitScope.USER, username="bob", values={"max_running_jobs": 2}, actor=ADMIN)
    jobs = [JobFactory(team=nlp, submitted_by=alice) for _ in range(12)] + [JobFactory(team=vision, submitted_by=bob) for _ in range(6)]
    workers = WorkerFactory.create_batch(10)
    job_ids, worker_ids = [job.pk for job in jobs], [worker.pk for worker in workers]

    def pending():
        while dispatch.dispatch_pending():
            pass

    def by_job():
        while any([dispatch.dispatch_for_job(job_id) for job_id in random.sample(job_ids, len(job_ids))]):
            pass

    def by_worker():
        while any([dispatch.dispatch_for_worker(worker_id) for worker_id in random.sample(worker_ids, len(worker_ids))]):
            pass

    run_concurrently([pending, by_job, by_worker, by_job, by_worker, pending])

    running = Job.objects.filter(status=JobStatus.DISPATCHED)
    assert running.filter(team=nlp).count() == 3
    assert running.filter(submitted_by=bob).count() == 2


def test_the_pass_after_a_job_ends_tries_only_the_jobs_under_a_limit(people, commit, monkeypatch):
    a = WorkerFactory(name="a", labels={"pool": "main"})
    WorkerFactory(name="b", labels={"gpu": "a100"})
    limits_set(scope=LimitScope.TEAM, team="nlp", values={"max_running_jobs": 1}, actor=ADMIN)
    with commit():
        running = submit(people["alice"], worker_labels={"pool": "main"})
        held = submit(people["alice"], worker_labels={"gpu": "a100"})
        unfit = submit(people["bob"], worker_labels={"gpu": "h100"})  # fits no worker, under no limit
    assert running.worker_id == a.pk
    tried = []
    real = dispatch.dispatch_for_job
    monkeypatch.setattr(dispatch, "dispatch_for_job", lambda job_id, **kw: tried.append(job_id) or real(job_id, **kw))

    with commit():
        complete(running)

    assert tried == [held.pk]
    held.refresh_from_db()
    unfit.refresh_from_db()
    assert (held.status, unfit.status) == (JobStatus.DISPATCHED, JobStatus.QUEUED)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_limit_another_dispatch_holds_is_passed_over_not_waited_for_after_the_first(postgres_url):
    import threading
    from datetime import timedelta

    from django.db import transaction
    from django.utils import timezone

    from job_queue.tests.factories import JobFactory
    from tenancy.models import Limits

    users = [UserFactory(username=name) for name in ("a", "b", "c")]
    teams = [Team.objects.create(name=f"team-{user.username}") for user in users]
    limits_set(scope=LimitScope.TEAM, team="team-a", values={"max_running_jobs": 0}, actor=ADMIN)
    limits_set(scope=LimitScope.TEAM, team="team-b", values={"max_running_jobs": 5}, actor=ADMIN)
    start = timezone.now() - timedelta(minutes=5)
    jobs = [JobFactory(team=team, submitted_by=user, submitted_at=start + timedelta(seconds=i)) for i, (team, user) in enumerate(zip(teams, users))]
    holding, release = threading.Event(), threading.Event()

    def hold():
        try:
            with transaction.atomic():
                list(Limits.objects.select_for_update().filter(team__name="team-b"))
                holding.set()
                release.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert holding.wait(30)
        # a's job (first in fair order) is held by its own limit, read waiting; b's limit, read next, is held by
        # another transaction: b's job is passed over; c's, under no limit, goes
        taken = dispatch.dispatch_for_worker(WorkerFactory().pk)
    finally:
        release.set()
        holder.join(30)
    assert taken.pk == jobs[2].pk
