"""The submit-and-dispatch hot path: one commit, few statements, labels pre-filtered in SQL, same choices."""

import json
import threading
from unittest import mock

import pytest
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from django_eventstream.models import Event

from audit import actions
from audit.models import AuditEvent
from audit.services import Actor
from common.prepared import PreparedQuery
from job_queue import dispatch
from job_queue.models import Job, JobStatus, JobTarget
from job_queue.services import job_submit
from job_queue.tests.factories import JobFactory, job_on_worker
from realtime.publish import worker_channel
from worker_agent import protocol
from workers import events as worker_events
from workers.models import Worker, WorkerStatus, WorkerType
from workers.tests.factories import UserFactory, WorkerFactory
from workers.tests.support import sent_events

OPERATOR_NAME = "alice"


@pytest.fixture
def actor():
    return Actor.for_user(UserFactory(username=OPERATOR_NAME), "10.0.0.5")


@pytest.mark.django_db(transaction=True)
def test_a_dispatching_submit_commits_once_with_its_audit_rows_and_its_stored_event(actor):
    # steady state: the worker's event channel exists (a first submit makes it)
    WorkerFactory(name="warm-up")
    job_submit(config_name="c", actor=actor)
    worker = WorkerFactory()
    worker_events.publish_on_commit(worker.pk, "ping")
    commits = mock.patch.object(connection, "commit", wraps=connection.commit)
    with commits as counted, CaptureQueriesContext(connection) as queries:
        job, dispatched = job_submit(config_name="c", actor=actor)

    assert dispatched and job.status == JobStatus.DISPATCHED and job.worker_id == worker.pk
    statements = [q["sql"] for q in queries.captured_queries if q["sql"] not in ("BEGIN", "COMMIT", "BEGIN IMMEDIATE")]
    # One commit: the job, its dispatch, the job_submit it publishes (stored for replay) and every audit
    # row; only the push to the stream waits for the commit, and it writes nothing.
    assert counted.call_count == 1
    # the audit rows go last, in one INSERT, unsealed: the transaction reads or locks no chain head (the sealer
    # chains them after the commit), and forces no deferred check early
    assert 'INSERT INTO "audit_auditevent"' in statements[-1]
    assert not [sql for sql in statements if "audit_auditchainhead" in sql or sql.startswith("SET CONSTRAINTS")]
    first = {kind: next(i for i, sql in enumerate(statements) if kind in sql) for kind in (
        'UPDATE "queue_job"', 'INSERT INTO "django_eventstream_event"', 'INSERT INTO "audit_auditevent"'
    )}
    # the event is stored after the dispatch, before the audit rows
    assert first['UPDATE "queue_job"'] < first['INSERT INTO "django_eventstream_event"'] < first['INSERT INTO "audit_auditevent"']
    assert any(sql.startswith('INSERT INTO "queue_job"') for sql in statements)
    assert any('INSERT INTO "audit_auditevent"' in sql for sql in statements)
    stored = Event.objects.filter(channel=worker_channel(worker.pk), eid__gt=0).order_by("eid").last()
    assert (stored.type, json.loads(json.loads(stored.data))["job_id"]) == (protocol.JOB_SUBMIT, job.pk)
    # the submission and the dispatch are both audited, in that order
    assert list(AuditEvent.objects.filter(target_id=job.pk).order_by("id").values_list("action", flat=True)[:1]) == [
        actions.JOB_SUBMITTED
    ]
    assert AuditEvent.objects.filter(target_id=job.pk, action=actions.JOB_DISPATCHED).count() == 1
    # a guard against the statement count creeping back (before issue 13: 27 statements in 3 transactions;
    # then 11 with BEGIN and COMMIT plus the event library's own transaction of 7; then 13 and one commit:
    # one of them the stored-config lookup of issue 15; a first attempt looks up no checkpoint to resume
    # from; then 11: the first worker offered is read and locked in one statement; on PostgreSQL 9: the
    # event's counter and row in one statement, the audit rows and the chain's head in one, plus the
    # deferred checks forced before the head's lock; now the audit chain's head is no longer read or moved
    # here: 9, and on PostgreSQL 8; then one more (issue 29): the submitter's teams and limits, in one statement)
    assert len(statements) <= (9 if connection.vendor == "postgresql" else 10), "\n".join(statements)
    # no GPU-hour quota applies: no usage read; whether a running or GPU limit applies rides on the worker's read
    worker_reads = [sql for sql in statements if sql.startswith('SELECT "workers_worker"')]
    assert sum(1 for sql in statements if "tenancy_" in sql and sql not in worker_reads) == 1
    assert all("tenancy_limits" in sql for sql in worker_reads)
    assert sum(1 for sql in statements if sql.startswith('SELECT "workers_worker"')) == 1
    assert not any("artifacts_checkpoint" in sql for sql in statements)
    assert not any(sql.startswith("DECLARE") for sql in statements)  # no server-side cursor for the candidates
    worker.refresh_from_db()
    assert worker.status == WorkerStatus.BUSY and worker.current_job_id == job.pk


@pytest.mark.django_db
def test_exact_label_selectors_are_matched_in_sql_and_globs_in_python(commit, actor):
    WorkerFactory(name="a", labels={"team": "vision", "zone.eu/x__y": "1"})
    b = WorkerFactory(name="b", labels={"team": "nlp", "zone.eu/x__y": "2"})

    def narrowed(selectors):
        exact = dispatch._exact_labels(selectors)
        labels = {f"label_{i}": text for i, text in enumerate(exact.values())}
        return [w.name for w in dispatch._WORKERS_FOR_JOB.run(JobTarget.AUTO, tuple(exact), 0, 10, gpu_count=0, **labels)]

    assert narrowed({"team": "nlp", "zone.eu/x__y": "2"}) == ["b"]
    assert narrowed({"team": "vision", "zone.eu/x__y": "1"}) == ["a"]  # the same plan, other values
    # a glob is left to labels_match: the pre-filter keeps every worker
    assert sorted(narrowed({"team": "n*"})) == ["a", "b"]
    # a pattern that only looks like text in SQL (case differs) matches nothing, as labels_match says
    assert narrowed({"team": "NLP"}) == []

    with commit():
        job, dispatched = job_submit(config_name="c", actor=actor, worker_labels={"team": "n?p", "zone.eu/x__y": "2"})
    assert dispatched and job.worker_id == b.pk


@pytest.mark.django_db
def test_candidates_past_the_first_batch_are_still_tried(commit, actor, monkeypatch):
    monkeypatch.setattr(dispatch, "FIRST_CANDIDATES", 2)
    monkeypatch.setattr(dispatch, "CANDIDATE_BATCH", 4)
    for i in range(7):
        WorkerFactory(name=f"cpu-{i}", labels={"gpu": "none"})
    fitting = WorkerFactory(name="gpu", labels={"gpu": "a100"})
    with commit():
        job, dispatched = job_submit(config_name="c", actor=actor, worker_labels={"gpu": "a1*"})  # a glob: no pre-filter
    assert dispatched and job.worker_id == fitting.pk


@pytest.mark.django_db
@pytest.mark.parametrize("count", [0, 1, 2, 3, 4, 5, 7])
def test_the_candidates_are_every_row_once_in_order_across_the_batches(monkeypatch, count):
    monkeypatch.setattr(dispatch, "FIRST_CANDIDATES", 2)
    monkeypatch.setattr(dispatch, "CANDIDATE_BATCH", 4)
    for i in range(count):
        WorkerFactory(name=f"w-{i}")
    rows = PreparedQuery(lambda start, stop: dispatch._available_workers().order_by("name")[start:stop])
    with CaptureQueriesContext(connection) as queries:
        names = [worker.name for worker in dispatch._candidates(rows)]
    assert names == [f"w-{i}" for i in range(count)]
    # a short first batch ends it; a full one reads the next; a full second one goes on through a cursor
    assert len(queries) == (1 if count < 2 else 2 if count < 4 else 3)


def _plan(query):
    """The plan of ``query`` (a select_for_update queryset) as text, after ANALYZE: the plan a fleet gets."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {query.model._meta.db_table}")
        sql, params = query.query.sql_with_params()
        cursor.execute(("EXPLAIN " if connection.vendor == "postgresql" else "EXPLAIN QUERY PLAN ") + sql, params)
        return "\n".join(str(row[-1]) for row in cursor.fetchall())


@pytest.mark.django_db
@pytest.mark.parametrize("target", [JobTarget.AUTO, JobTarget.WORKER, JobTarget.LOCAL])
def test_the_first_offered_worker_is_read_in_offer_order_from_the_index_not_sorted(target):
    # A fleet: most workers idle, some busy or without a stream, some local, some that finished a job.
    Worker.objects.bulk_create(
        Worker(
            name=f"w-{i}",
            status=WorkerStatus.BUSY if i % 10 == 0 else WorkerStatus.IDLE,
            stream_id=None if i % 7 == 0 else f"s-{i}",
            worker_type=WorkerType.LOCAL if i % 50 == 0 else WorkerType.PERSISTENT,
            last_job_finished_at=timezone.now() if i % 2 else None,
            gpu_count=1,
        )
        for i in range(2000)
    )

    plan = _plan(dispatch._first_worker_for_job(target, (), gpu_count=1))

    assert "worker_offer_order" in plan, plan
    if target != JobTarget.LOCAL:  # the few local workers (one, built in) are found by rank: sorting them is cheap
        assert "Sort" not in plan and "TEMP B-TREE" not in plan, plan


@pytest.mark.django_db
def test_the_first_queued_job_for_a_worker_is_read_in_queue_order_from_the_index_not_sorted():
    # A backlog: most jobs queued, some finished; two priorities, many ties on the submission time.
    submitted = timezone.now()
    Job.objects.bulk_create(
        Job(
            config_name=f"c-{i}",
            status=JobStatus.COMPLETED if i % 5 == 0 else JobStatus.QUEUED,
            priority=i % 2,
            submitted_at=submitted,
        )
        for i in range(2000)
    )

    plan = _plan(dispatch._first_job_for_worker(WorkerType.PERSISTENT, gpu_count=1))

    assert "job_dispatch_order" in plan, plan
    assert "Sort" not in plan and "TEMP B-TREE" not in plan, plan


@pytest.mark.django_db
def test_a_submit_that_finds_no_worker_commits_the_queued_job(actor):
    job, dispatched = job_submit(config_name="c", actor=actor, worker_labels={"team": "nobody"})
    assert not dispatched
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED and job.worker_id is None


@pytest.mark.django_db(transaction=True)
def test_a_completion_and_the_next_dispatch_to_that_worker_commit_once(worker_client):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.RUNNING)
    following = JobFactory()
    worker_events.publish_on_commit(worker.pk, "ping")  # the channel exists: steady state
    commits = mock.patch.object(connection, "commit", wraps=connection.commit)
    with commits as counted:
        response = worker_client(worker).post(f"/api/workers/job/{job.pk}/status", {"status": "completed", "attempt": job.lease_id})

    assert response.status_code == 200 and response.json()["status"] == JobStatus.COMPLETED
    assert counted.call_count == 1  # the completion, the freed worker, the next job's dispatch and its stored job_submit
    following.refresh_from_db()
    assert (following.status, following.worker_id) == (JobStatus.DISPATCHED, worker.pk)
    assert [e["type"] for e in sent_events(worker.pk)] == ["ping", protocol.JOB_SUBMIT]


@pytest.mark.django_db
def test_a_failed_offer_to_the_freed_worker_is_made_again_after_the_commit(worker_client, commit, monkeypatch, caplog):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.RUNNING)
    following = JobFactory()
    real = dispatch.dispatch_for_worker
    calls = []

    def failing_once(worker_id, **kwargs):
        calls.append(worker_id)
        if len(calls) == 1:
            with transaction.atomic():  # as the real one: a savepoint, rolled back by the error
                Job.objects.filter(pk=following.pk).update(priority=99)
                raise DatabaseError("could not serialize access")
        return real(worker_id, **kwargs)

    monkeypatch.setattr(dispatch, "dispatch_for_worker", failing_once)
    with commit():
        response = worker_client(worker).post(f"/api/workers/job/{job.pk}/status", {"status": "completed", "attempt": job.lease_id})
        assert response.status_code == 200  # the completion stands
        assert Job.objects.get(pk=following.pk).status == JobStatus.QUEUED

    assert calls == [worker.pk, worker.pk]
    job.refresh_from_db()
    following.refresh_from_db()
    assert job.status == JobStatus.COMPLETED
    assert (following.status, following.worker_id, following.priority) == (JobStatus.DISPATCHED, worker.pk, 0)
    assert "dispatch to freed worker" in caplog.text


@pytest.mark.django_db
def test_a_job_requeued_by_its_report_is_placed_before_its_worker_is_offered_work(worker_client, commit):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.RUNNING, retry_on_failure=True)
    other = WorkerFactory(name="other")  # idle, never used: least recently used
    with commit():
        response = worker_client(worker).post(
            f"/api/workers/job/{job.pk}/status", {"status": "failed", "attempt": job.lease_id, "error": "oom"}
        )
        assert response.status_code == 200
        job.refresh_from_db()
        assert job.status == JobStatus.QUEUED  # not taken back by the worker it failed on in that transaction
    job.refresh_from_db()
    assert (job.status, job.worker_id) == (JobStatus.DISPATCHED, other.pk)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("dispatching", ["a new job", "to a freed worker"])
def test_the_first_offered_row_held_by_another_transaction_is_skipped_not_waited_for(postgres_url, actor, dispatching):
    """The first worker (or queued job) offered is read and locked in one statement, SKIP LOCKED: one that
    another transaction holds is passed over for the next, without waiting for it."""
    assert connection.vendor == "postgresql"
    if dispatching == "a new job":
        # "held" is offered first: the least recently finished (never) goes first
        held, free = WorkerFactory(name="held"), WorkerFactory(name="free", last_job_finished_at=timezone.now())
    else:
        worker = WorkerFactory()
        # the higher priority is offered first; two shares (submitters), as a share's head held by another
        # transaction hides the jobs behind it from the shares' heads (fairshare.offered_jobs)
        held, free = JobFactory(priority=5, submitted_by=UserFactory()), JobFactory(priority=1, submitted_by=UserFactory())
    holding, release = threading.Event(), threading.Event()

    def hold():
        try:
            with transaction.atomic():
                list(type(held).objects.select_for_update().filter(pk=held.pk))
                holding.set()
                release.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert holding.wait(30)
        with CaptureQueriesContext(connection) as queries:
            if dispatching == "a new job":
                job, dispatched = job_submit(config_name="c", actor=actor)
                assert dispatched and job.worker_id == free.pk
            else:
                assert dispatch.dispatch_for_worker(worker.pk).pk == free.pk
    finally:
        release.set()
        holder.join(30)
    table = type(held)._meta.db_table
    locking = [q["sql"] for q in queries.captured_queries if q["sql"].startswith(f'SELECT "{table}"') and "SKIP LOCKED" in q["sql"]]
    assert len(locking) == 1, locking
